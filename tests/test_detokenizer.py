"""IncrementalDetokenizer on a byte-level BPE (``builders.save_tokenizer``) and on a small
sentencepiece-style BPE with byte-fallback ``<0xNN>`` tokens (Llama's decoder chain, and a
Metaspace one).

Exact checks, for random and adversarial token sequences (multi-byte characters split byte by
byte, stray continuation bytes, special tokens) fed one token or a few at a time: the deltas
concatenate to ``text`` at every step; ``text`` is at every step the decode of the tokens so far
(less an incomplete character at its end) and at the end the decode of the output; U+FFFD comes
out only where the output's decode has one; a decode touches a bounded window of tokens.
Stop strings against a character-by-character oracle: the emitted text is at every step the
text so far, cut at the first stop string to complete, less the longest end that could still
begin one.
"""

import random

import pytest

from builders import save_tokenizer
from chitu_core.engine.detokenizer import IncrementalDetokenizer

MULTI_BYTE = "東京 naïve café 😀 Zürich ½ € ñ"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("byte-level-tokenizer"))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def byte_ids(tok, text: str) -> list[int]:
    """``text`` as one token per UTF-8 byte, in the byte-level or the byte-fallback vocabulary."""
    if tok.convert_tokens_to_ids("<0x41>") not in (None, tok.unk_token_id):
        names = [f"<0x{b:02X}>" for b in text.encode()]
    else:
        table = bytes_to_unicode()
        names = [table[b] for b in text.encode()]
    ids = tok.convert_tokens_to_ids(names)
    assert tok.unk_token_id not in ids and None not in ids
    return ids


BF_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Héllo wörld, naïve café and Zürich.",
             "What is the capital of France? Paris is."]


def byte_fallback_tokenizer(decoder: str):
    """A sentencepiece-style BPE (Metaspace, ``▁`` for spaces) whose unknown characters fall back to
    ``<0xNN>`` byte tokens; ``decoder`` "llama" is Llama-2's chain (Replace, ByteFallback, Fuse,
    Strip one leading space), "metaspace" strips the first token's ``▁``."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator(BF_CORPUS * 4, trainers.BpeTrainer(vocab_size=200, special_tokens=specials, limit_alphabet=60))
    model = json.loads(trained.to_str())["model"]
    vocab = {name: i for i, name in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for name in model["vocab"]:
        vocab.setdefault(name, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    if decoder == "llama":
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def byte_fallback(request):
    return byte_fallback_tokenizer(request.param)


def is_byte_token(tok, token_id: int) -> bool:
    name = tok.convert_ids_to_tokens(token_id)
    return len(name) == 6 and name.startswith("<0x") and name.endswith(">")


def runs_are_valid(tok, ids: list[int]) -> bool:
    """Every maximal run of byte-fallback tokens in ``ids`` is valid UTF-8."""
    run = []
    for i in ids + [None]:
        if i is not None and is_byte_token(tok, i):
            run.append(int(tok.convert_ids_to_tokens(i)[3:5], 16))
            continue
        try:
            bytes(run).decode("utf-8")
        except UnicodeDecodeError:
            return False
        run = []
    return True


def chunked(ids: list[int], rng: random.Random, most: int) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, most)
        out.append(ids[i : i + n])
        i += n
    return out


def check_stream(tok, prompt: list[int], chunks: list[list[int]], skip_special_tokens: bool = True) -> IncrementalDetokenizer:
    """Streams ``chunks`` without stop strings and checks the invariants at every step: the deltas
    concatenate to ``text``; ``text`` is a prefix of the final decode of the output after the
    prompt, and equal to the decode so far unless that ends in U+FFFD (an incomplete character);
    no U+FFFD is emitted that the final decode does not have. Ends with ``flush``."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=skip_special_tokens)  # noqa: E731
    if decode(prompt).endswith("\ufffd"):
        prompt = []  # a prompt that ends inside a character gives no context: the output reads alone
    prompt_text = decode(prompt)
    output: list[int] = []
    emitted = ""
    final = decode(prompt + [t for c in chunks for t in c])
    assert final.startswith(prompt_text)
    for chunk in chunks:
        output += chunk
        delta = detok.step(chunk)
        emitted += delta
        assert emitted == detok.text
        assert final[len(prompt_text):].startswith(detok.text), (output, detok.text)  # never taken back
        so_far = decode(prompt + output)[len(prompt_text):]
        if not so_far.endswith("\ufffd"):  # nothing incomplete: everything is out
            assert detok.text == so_far, (output, so_far, detok.text)
        assert detok.text.count("\ufffd") <= final.count("\ufffd")
    emitted += detok.flush()
    assert emitted == detok.text == final[len(prompt_text):]
    assert not detok.finished and detok.stop_reason is None
    assert detok.step([output[0]] if output else []) == "" and detok.flush() == ""
    return detok


# ----- byte-level BPE -----


def test_byte_level_random_sequences_decode_exactly(byte_level):
    rng = random.Random(0)
    vocab = len(byte_level)
    split = byte_ids(byte_level, MULTI_BYTE)
    sentences = [byte_level.encode(s, add_special_tokens=False) for s in ("Héllo wörld, naïve café", "東京 and Zürich.")]
    for trial in range(300):
        pieces = []
        for _ in range(rng.randint(1, 12)):
            kind = rng.random()
            if kind < 0.4:
                pieces += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]  # anything, specials included
            elif kind < 0.8:
                start = rng.randrange(len(split))
                pieces += split[start : start + rng.randint(1, 8)]  # bytes of multi-byte characters, cut anywhere
            else:
                pieces += rng.choice(sentences)
        prompt = rng.choice([[], sentences[0], [rng.randrange(vocab) for _ in range(6)], split[:2]])
        check_stream(byte_level, prompt, chunked(pieces, rng, rng.choice([1, 1, 3])), skip_special_tokens=trial % 3 > 0)


def test_a_character_comes_out_once_its_last_byte_is_in(byte_level):
    ids = byte_ids(byte_level, MULTI_BYTE)
    detok = IncrementalDetokenizer(byte_level, [])
    want = [d for ch in MULTI_BYTE for d in [""] * (len(ch.encode()) - 1) + [ch]]
    assert [detok.step([i]) for i in ids] == want
    assert detok.flush() == "" and detok.text == MULTI_BYTE


def test_a_cut_character_is_flushed_as_the_tokenizer_decodes_it(byte_level):
    ids = byte_ids(byte_level, "ab東")[:-1]  # "ab" and 2 of 東's 3 bytes
    detok = IncrementalDetokenizer(byte_level, [])
    assert [detok.step([i]) for i in ids] == ["a", "b", "", ""]
    assert detok.flush() == byte_level.decode(ids)[2:] and "\ufffd" in detok.text
    assert detok.text == byte_level.decode(ids)


def test_a_prompt_ending_inside_a_character(byte_level):
    ids = byte_ids(byte_level, "x東京")
    detok = check_stream(byte_level, ids[:3], [[i] for i in ids[3:]])  # the prompt holds 東's first two bytes
    assert detok.text == byte_level.decode(ids[3:]) and detok.text.startswith("\ufffd") and detok.text.endswith("京")


def test_the_window_does_not_grow_with_the_output(byte_level):
    class Counting:
        def __init__(self, tok):
            self.tok, self.sizes = tok, []

        def decode(self, ids, skip_special_tokens):
            self.sizes.append(len(ids))
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting(byte_level)
    text = "What is the capital of France? Paris, 東京 😀 naïve. " * 80
    ids = byte_level.encode(text, add_special_tokens=False) + byte_ids(byte_level, MULTI_BYTE * 20)
    detok = IncrementalDetokenizer(counting, byte_level.encode("A long prompt " * 50, add_special_tokens=False))
    for i in ids:
        detok.step([i])
    detok.flush()
    assert detok.text == text + MULTI_BYTE * 20
    assert len(ids) > 2000 and max(counting.sizes) <= 10 and len(counting.sizes) <= 2 * len(ids) + 3


# ----- byte-fallback (sentencepiece-style) -----


def test_byte_fallback_valid_sequences_decode_exactly(byte_fallback):
    tok, rng = byte_fallback, random.Random(1)
    normal = [i for i in range(len(tok)) if not is_byte_token(tok, i) and i not in tok.all_special_ids]
    chars = [byte_ids(tok, ch) for ch in sorted(set(MULTI_BYTE + "ab."))]
    for trial in range(300):
        units = []
        for _ in range(rng.randint(1, 15)):
            kind = rng.random()
            units += ([rng.choice(normal)] if kind < 0.5 else rng.choice(chars) if kind < 0.9
                      else [rng.choice(tok.all_special_ids)])
        assert runs_are_valid(tok, units)
        prompt = rng.choice([[], tok.encode("What is the capital of", add_special_tokens=False), [tok.bos_token_id]])
        detok = check_stream(tok, prompt, chunked(units, rng, rng.choice([1, 1, 4])), skip_special_tokens=trial % 4 > 0)
        assert "\ufffd" not in detok.text
        if not prompt or (prompt == [tok.bos_token_id] and trial % 4 > 0):  # a skipped BOS is no context
            assert detok.text == tok.decode(units, skip_special_tokens=trial % 4 > 0)


def test_byte_fallback_characters_come_out_once_complete_and_spaces_follow_the_prompt(byte_fallback):
    tok = byte_fallback
    the = tok.convert_tokens_to_ids("▁the")
    ids = [the] + byte_ids(tok, "東京")
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.step([i]) for i in ids] == ["the", "", "", "東", "", "", "京"]
    assert detok.text == tok.decode(ids) == "the東京"
    # After a prompt, the first token keeps its space: the output reads as it does after the prompt.
    prompt = tok.encode("What is", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    assert [detok.step([i]) for i in ids] == [" the", "", "", "東", "", "", "京"]
    assert tok.decode(prompt + ids) == tok.decode(prompt) + " the東京"


def test_byte_fallback_adversarial_sequences(byte_fallback):
    """Random ids over the whole vocabulary: byte runs are often invalid UTF-8, which the decoder
    turns into U+FFFD as a whole. The stream keeps its invariants, decodes exactly whenever the
    runs are valid, and on the pinned cases below keeps the characters it already emitted."""
    tok, rng = byte_fallback, random.Random(2)
    exact = 0
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 20))]
        detok = IncrementalDetokenizer(tok, [])
        emitted = "".join(detok.step(c) for c in chunked(ids, rng, 2))
        emitted += detok.flush()
        assert emitted == detok.text
        if runs_are_valid(tok, ids):
            assert detok.text == tok.decode(ids, skip_special_tokens=True)
            exact += 1
    assert exact > 30

    the = tok.convert_tokens_to_ids("▁the")
    assert the != tok.unk_token_id
    cut = [the] + byte_ids(tok, "東京")[:5]  # the output stops inside 京
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.step([i]) for i in cut) == "the東"
    assert tok.decode(cut) == "the" + "\ufffd" * 5  # the decoder gives up on the whole run
    assert detok.flush() == "\ufffd" * 2 and detok.text == "the東\ufffd\ufffd"  # one per byte, as the decoder

    stray = byte_ids(tok, "東") + [tok.convert_tokens_to_ids("<0x80>"), the]
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.step([i]) for i in stray] == ["", "", "東", "", "\ufffd the"]
    assert tok.decode(stray) == "\ufffd" * 4 + " the"


# ----- stop strings -----


def stop_oracle(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Character by character: (the text to emit, the stop string matched or None)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            longest = max(ending, key=len)  # the one that starts first
            return text[: end - len(longest)], longest
    held = next((n for n in range(len(text)) if any(s.startswith(text[n:]) for s in stops)), len(text))
    return text[:held], None


def check_stops(tok, text_ids: list[int], stops: list[str], chunks: list[list[int]]) -> IncrementalDetokenizer:
    """Streams with stop strings; at every step the emitted text is the oracle's on what the
    tokens so far decode to (up to the last step whose decode was complete)."""
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    output, complete, emitted = [], "", ""
    for chunk in chunks:
        output += chunk
        delta = detok.step(chunk)
        emitted += delta
        decoded = tok.decode(output, skip_special_tokens=True)
        if not decoded.endswith("\ufffd"):
            complete = decoded
        want, reason = stop_oracle(complete, stops)
        assert (detok.text, detok.stop_reason, detok.finished) == (want, reason, reason is not None), (output, complete)
        assert emitted == detok.text
    full = tok.decode(text_ids, skip_special_tokens=True)
    want, reason = stop_oracle(full, stops)
    emitted += detok.flush()
    assert emitted == detok.text
    assert detok.text == (want if reason else full) and detok.stop_reason == reason
    return detok


SENTENCE = "What is the capital of France? Paris is the capital of France."
STOP_CASES = {  # name: (text, stop strings, the text that comes out)
    "spans tokens": (SENTENCE, ["capital of F"], "What is the "),
    "at the very start": (SENTENCE, ["What"], ""),
    "earliest to complete wins": (SENTENCE, ["Paris", "capital"], "What is the "),
    "in any order": (SENTENCE, ["capital", "Paris"], "What is the "),
    "the shorter completes first": (SENTENCE, ["the capital of France? Paris", "France"], "What is the capital of "),
    "same end: the longer": (SENTENCE, ["France?", "of France?"], "What is the capital "),
    "a prefix that never completes": (SENTENCE, ["capital of Germany", "Paris was"], SENTENCE),
    "ends on a stop prefix": ("Paris is the capital of", ["capital of Germany"], "Paris is the capital of"),
    "a multi-byte stop": ("Héllo wörld, naïve café, 東京 and Zürich", ["京"], "Héllo wörld, naïve café, 東"),
    "a stop across characters": ("Héllo wörld, naïve café, 東京 and Zürich", ["é, 東"], "Héllo wörld, naïve caf"),
    "the same first bytes": ("Héllo wörld, naïve café, 東京 and Zürich", ["東亰", "ö r"], "Héllo wörld, naïve café, 東京 and Zürich"),
    "an emoji": ("smile 😀 and 😀", ["😀 b"], "smile 😀 and 😀"),
    "an emoji stop": ("smile 😀 and 😀", ["😀"], "smile "),
}


@pytest.mark.parametrize("name", list(STOP_CASES))
@pytest.mark.parametrize("split", ["tokens", "bytes", "chunks", "whole"])
def test_stop_strings(byte_level, name, split):
    """The same text cut into steps differently ends the same way."""
    text, stops, want = STOP_CASES[name]
    ids = byte_level.encode(text, add_special_tokens=False) if split != "bytes" else byte_ids(byte_level, text)
    assert byte_level.decode(ids) == text
    rng = random.Random(list(STOP_CASES).index(name))
    chunks = {"chunks": chunked(ids, rng, 3), "whole": [ids]}.get(split, [[i] for i in ids])
    detok = check_stops(byte_level, ids, stops, chunks)
    assert detok.text == want
    assert detok.step(ids[:2]) == "" and detok.flush() == "" and detok.text == want


def test_stop_strings_on_byte_fallback_tokens(byte_fallback):
    tok = byte_fallback
    ids = tok.encode("Héllo 東京 naïve café 😀 the fox", add_special_tokens=False)
    assert any(is_byte_token(tok, i) for i in ids) and tok.decode(ids) == "Héllo 東京 naïve café 😀 the fox"
    for stops, want in [(["京 na"], "Héllo 東"), (["😀 the"], "Héllo 東京 naïve café "), (["東亰"], None),
                        (["fox"], "Héllo 東京 naïve café 😀 the ")]:
        detok = check_stops(tok, ids, stops, [[i] for i in ids])
        assert detok.text == (want if want is not None else tok.decode(ids))


def test_held_text_is_released_by_flush_and_nothing_follows_a_stop(byte_level):
    ids = byte_level.encode("Paris is the capital of", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level, [], stop=["capital of Germany"])
    streamed = "".join(detok.step([i]) for i in ids)
    assert streamed == detok.text == "Paris is the "
    assert detok.flush() == "capital of" and detok.text == "Paris is the capital of" and not detok.finished

    detok = IncrementalDetokenizer(byte_level, [], stop=["capital"])
    streamed = "".join(detok.step([i]) for i in ids)
    assert streamed == "Paris is the " and detok.finished and detok.stop_reason == "capital"
    assert detok.step(byte_level.encode(" more text", add_special_tokens=False)) == "" and detok.flush() == ""
    assert detok.text == "Paris is the "

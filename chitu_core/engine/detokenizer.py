"""Incremental detokenization: the text a sequence's new tokens add, safe to stream, and stop strings.

The window technique of vLLM and transformers' ``TextStreamer``: a step decodes a short window,
the tokens that last made text (the context) and those after them, once without and once with
the latter; the difference is the new text, and the window then moves on. The context keeps the
spaces that sentencepiece-style decoders strip at the start of a text (the first output token
takes a few prompt tokens as context), and a step's work does not grow with the output. Tokens
wait in the window while they add no text, or while the decode ends in U+FFFD: an incomplete
UTF-8 character (split across byte-level or byte-fallback tokens) comes out once complete.

The text is what the output reads as after the prompt: for byte-level BPE it is exactly
``tokenizer.decode(output_ids)`` (as for any tokenizer after a prompt that ends inside a
character, which gives no context); where a decoder strips the leading space of a text
(sentencepiece), the first output token keeps the space it has after the prompt, as
``decode(prompt + output)`` minus ``decode(prompt)`` would show (vLLM does the same).

Stop strings are matched on that text. The output ends at the first point where the text
contains a stop string; if several complete there, the one that starts first is cut. This does
not depend on how the text is split into steps. Text that could still begin a stop string (the
longest end of the text that is a proper prefix of one) is held back, so no part of a stop
string is ever emitted; ``flush`` releases it when the output ends for another reason.
"""

from collections.abc import Sequence

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for its leading space
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a sequence's output tokens into text deltas, step by step.

    ``step(ids)`` returns the text that ``ids`` complete and that is safe to emit; ``flush()``
    returns what was held back, once no more tokens will come. The deltas concatenate to
    ``text`` at every step. After a stop string matched (``finished``, ``stop_reason``), ``text``
    ends right before it and both return "".

    Any object with ``decode(ids, skip_special_tokens=...)`` works as ``tokenizer``. One caveat
    for byte-fallback tokenizers (``<0xNN>`` tokens): their decoder turns a whole run of byte
    tokens into U+FFFD when any part of it is invalid UTF-8, including characters completed
    earlier in the run. Characters are streamed once complete, so for such a run (only a cut or
    malformed output has one) the text keeps them and gets the decoder's U+FFFD for the rest.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.text = ""
        self.stop_reason: str | None = None
        self.finished = False
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_INCOMPLETE):
            context = []  # the prompt ends inside a character: its output starts with the rest of it
        self._tokens = context  # the window: context, then tokens not yet decoded from _read on
        self._read = len(context)
        self._read_text: str | None = None  # decode(_tokens[:_read]), kept while it holds
        self._held = ""  # decoded text not yet emitted: it could begin a stop string
        self._flushed = False

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add the sequence's new tokens; returns the text now safe to emit (often "")."""
        if self.finished or self._flushed:
            return ""
        self._tokens.extend(new_token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """The output ended (length, EOS, stop token): returns all text still held back, including
        an incomplete character as the tokenizer decodes it."""
        if self.finished or self._flushed:
            return ""
        self._flushed = True
        return self._emit(self._decode_new(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """The text of the tokens from _read on; moves the window past them. "" while they
        complete nothing (no new text, or a character still incomplete), unless final."""
        if self._read_text is None:
            self._read_text = self._decode(self._tokens[: self._read])
        read_text = self._read_text
        text = self._decode(self._tokens)
        if not final and (len(text) <= len(read_text) or text.endswith(_INCOMPLETE)):
            return ""
        if text.startswith(read_text):
            new = text[len(read_text):]
        else:  # the decoder rewrote text already emitted (an invalid byte-fallback run): keep it
            new = self._decode(self._tokens[self._read:])
        self._tokens = self._tokens[self._read:]
        self._read = len(self._tokens)
        self._read_text = None
        return new

    def _emit(self, new: str, final: bool) -> str:
        """Stop-string handling on the new text; returns the delta and appends it to ``text``."""
        pending = self._held + new
        # Only the held text and the new text can hold a stop string: anything emitted could no
        # longer begin one, or it would have been held.
        hits = [(start + len(s), start, s) for s in self.stop if (start := pending.find(s)) >= 0]
        if hits:
            _, start, self.stop_reason = min(hits)
            delta, self.finished, self._held, self._tokens = pending[:start], True, "", []
        else:
            keep = 0 if final else self._stop_prefix_len(pending)
            delta, self._held = pending[: len(pending) - keep], pending[len(pending) - keep:]
        self.text += delta
        return delta

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._longest_stop - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

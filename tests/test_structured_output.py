"""Structured output (a grammar's token bitmask applied on the device) and logit_bias.

On a tiny random model through the real server and the real openai client: random weights never
write JSON, so outputs that validate show the mask is applied. The sampler's mask and bias are
checked exactly against xgrammar's own CPU kernel and a hand-masked run; async scheduling never
launches a constrained row ahead; a repeated schema compiles once. Last, the issue's acceptance on
the embedded SmolLM2.
"""

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from chitu_cpu.backend import CpuBackend

from builders import build_chat_model
from chitu_core import LLM, SamplingParams
from chitu_core.config import EngineConfig
from chitu_core.engine.async_engine import AsyncLLM
from chitu_core.plugins import backend_ops, get_backend
from chitu_core.sampling.grammar import unpack_bitmask
from chitu_core.sampling.params import StructuredOutput
from chitu_core.sampling.sampler import Sampler, SamplingBatch
from chitu_core.server.app import build_app
from serving import LiveServer, cpu_engine

MODEL = "tiny-chat"
CPU = torch.device("cpu")
SAMPLER = Sampler(backend_ops(get_backend("cpu")))

# Three fields; the string's pattern keeps it plain (xgrammar's maxLength strings admit raw control characters).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "color": {"enum": ["red", "green", "blue"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "color", "age"],
    "additionalProperties": False,
}


def valid(text: str) -> bool:
    """``text`` is JSON that SCHEMA accepts (checked by hand: no jsonschema dependency)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "color", "age"}
            and isinstance(value["name"], str) and re.fullmatch("[a-z]{1,8}", value["name"]) is not None
            and value["color"] in ("red", "green", "blue")
            and type(value["age"]) is int and 0 <= value["age"] <= 120)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured-llama")
    build_chat_model(path)
    return path


@pytest.fixture(scope="module")
def llm(model_path):
    with cpu_engine(model_path) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(llm):
    with LiveServer(build_app(llm, [MODEL], max_pending=64)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


# ----- the sampler: mask and bias on the device, exactly -----


def packed(allowed: list[list[int] | None], vocab: int) -> torch.Tensor:
    """xgrammar's bitmask layout, built by hand: None is a row with every token allowed."""
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for row, ids in enumerate(allowed):
        for t in range(vocab) if ids is None else ids:
            words[row, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # as two's complement


def test_the_grammar_bitmask_masks_exactly_the_disallowed_tokens():
    import xgrammar as xgr

    vocab = 70  # three words, the last one partial; token 31 is a word's sign bit
    allowed = [[3, 31, 32, 69], None, [0, 31], [64]]
    bitmask = packed(allowed, vocab)
    want = torch.zeros(4, vocab, dtype=torch.bool)
    for row, ids in enumerate(allowed):
        want[row, slice(None) if ids is None else ids] = True
    assert torch.equal(unpack_bitmask(bitmask, vocab), want)

    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 4
    oracle = logits.clone()
    xgr.apply_token_bitmask_inplace(oracle, bitmask, backend="torch_native")  # the library's own kernel
    assert torch.equal(oracle.isinf(), ~want)

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
              SamplingParams(temperature=1.0, top_k=3)]
    seeds, empty = [11, 12, 13, 14], [[] for _ in params]
    for counter in range(20):
        batch = SamplingBatch.build(params, seeds, [counter] * 4, CPU, vocab, empty, empty, empty, bitmask=bitmask)
        assert batch.allowed is not None and batch.allowed.dtype == torch.int32
        got = SAMPLER(logits, batch).tokens
        by_hand = SAMPLER(oracle, SamplingBatch.build(params, seeds, [counter] * 4, CPU, vocab, empty, empty, empty)).tokens
        assert torch.equal(got, by_hand)  # greedy and random rows both honour it, row 1 is untouched
        assert all(want[row, t] for row, t in enumerate(got.tolist()))
    assert got[1] == logits[1].argmax() and got[3] == 64
    assert SamplingBatch.build(params, seeds, [0] * 4, CPU, vocab, empty, empty, empty).allowed is None


def test_logit_bias_is_added_before_temperature_and_filters():
    vocab = 10
    logits = torch.arange(vocab, dtype=torch.float32).repeat(3, 1)  # token 9 is the argmax
    params = [SamplingParams(temperature=0.0, logit_bias={2: 100.0}), SamplingParams(temperature=0.0, logit_bias={9: -100.0}),
              SamplingParams(temperature=0.0)]
    empty = [[] for _ in params]
    batch = SamplingBatch.build(params, [1, 2, 3], [0, 0, 0], CPU, vocab, empty, empty, empty)
    want = torch.zeros(3, vocab)
    want[0, 2], want[1, 9] = 100.0, -100.0
    assert torch.equal(batch.bias, want)
    assert SAMPLER(logits, batch).tokens.tolist() == [2, 8, 9]
    # A top-k of 1 keeps the biased argmax: the bias comes first.
    hot = [SamplingParams(temperature=1.0, top_k=1, logit_bias={0: 50.0, 99: 1.0})]
    batch = SamplingBatch.build(hot, [5], [0], CPU, vocab, [[]], [[]], [[]])
    assert SAMPLER(logits[:1], batch).tokens.tolist() == [0]  # id 99 is outside this vocabulary: ignored
    assert SamplingBatch.build(params[2:], [1], [0], CPU, vocab, [[]], [[]], [[]]).bias is None


# ----- the engine: async scheduling and the grammar cache -----


def test_constrained_rows_are_never_launched_ahead_and_share_batches(model_path, monkeypatch):
    monkeypatch.setattr(CpuBackend, "attention_backends", lambda self: {})
    regex = StructuredOutput(regex="[a-z]{2}-[0-9]{3}")
    requests = [("free", SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)),
                ("json", SamplingParams(max_tokens=64, temperature=0.7, seed=5, structured_output=StructuredOutput(json_schema=SCHEMA))),
                ("regex", SamplingParams(max_tokens=20, temperature=0.7, seed=6, structured_output=regex))]

    def run(async_scheduling: bool):
        engine = LLM(model_path, device="cpu", dtype="float32", load_progress=False,
                     async_scheduling=async_scheduling).engine
        launches, original = [], engine.runner.launch

        def launch(batch, ids=None, ahead=0):  # which sequences each step ran, and whether ahead
            launches.append(([s.request.request_id for s in batch.seqs], ahead))
            return original(batch, ids, ahead)

        engine.runner.launch = launch
        ids = engine.tokenizer.encode("The quick brown fox")
        handles = [engine.add_request(rid, ids, params) for rid, params in requests]
        while engine.has_unfinished():
            engine.step()
        return engine, launches, [(h.seqs[0].output_token_ids, h.seqs[0].finish_reason) for h in handles]

    _, _, want = run(async_scheduling=False)
    engine, launches, got = run(async_scheduling=True)
    assert got == want  # the same tokens, constrained or not
    tok = engine.tokenizer
    assert valid(tok.decode(got[1][0], skip_special_tokens=True)) and got[1][1] == "stop"
    assert re.fullmatch("[a-z]{2}-[0-9]{3}", tok.decode(got[2][0], skip_special_tokens=True)) and got[2][1] == "stop"
    assert launches[0] == (["free", "json", "regex"], 0)  # one batch, constrained and not
    assert all(ahead == 0 for seqs, ahead in launches if {"json", "regex"} & set(seqs))
    assert any(ahead for _, ahead in launches)  # once alone, the free request runs ahead again
    assert engine.runner.constraints.grammars.num_compiled == 2 and len(engine.runner.constraints) == 0  # dropped
    bm = engine.block_manager
    assert not engine._in_flight and bm.num_free == bm.num_blocks


def test_a_repeated_schema_compiles_once(llm):
    async def go():
        params = SamplingParams(max_tokens=3, temperature=0.0, structured_output=StructuredOutput(json_schema={"type": "integer"}))
        before = llm.engine.runner.constraints.grammars.num_compiled if llm.engine.runner.constraints else 0
        for _ in range(3):
            async for _ in llm.generate([5, 6, 7], params):
                pass
        return llm.engine.runner.constraints.grammars.num_compiled - before

    assert asyncio.run(go()) == 1 and len(llm.engine.runner.constraints) == 0


# ----- the server -----


def test_json_schema_outputs_validate_10_of_10_at_temperature_0_7(client):
    r = client.chat.completions.create(
        model=MODEL, messages=chat("Describe a person."), n=10, temperature=0.7, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    texts = [c.message.content for c in r.choices]
    assert all(valid(t) for t in texts), texts
    assert [c.finish_reason for c in r.choices] == ["stop"] * 10
    assert len(set(texts)) > 1  # sampled, not one greedy answer


def test_json_schema_streamed_deltas_make_valid_json(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=chat("Describe a person."), temperature=0.7, seed=3, max_tokens=64, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    chunks = [c.choices[0] for c in stream if c.choices]
    assert valid("".join(c.delta.content or "" for c in chunks)) and chunks[-1].finish_reason == "stop"


def test_json_object_outputs_are_json_objects(client):
    # Random weights may ramble inside a string until max_tokens; whatever stops is an object.
    r = client.chat.completions.create(model=MODEL, messages=chat("Give me JSON."), n=8, temperature=0.7, seed=0,
                                       max_tokens=48, response_format={"type": "json_object"})
    stopped = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert len(stopped) >= 2 and all(isinstance(json.loads(t), dict) for t in stopped)
    assert all(c.message.content.startswith("{") for c in r.choices)


def test_regex_and_grammar_outputs_fullmatch(client):
    r = client.completions.create(model=MODEL, prompt="The code is", n=5, temperature=0.9, max_tokens=20,
                                  extra_body={"guided_regex": r"[A-Z][a-z]{2}-\d{2,4}"})
    assert all(re.fullmatch(r"[A-Z][a-z]{2}-\d{2,4}", c.text) for c in r.choices), [c.text for c in r.choices]
    grammar = 'root ::= ("cat" | "dog") " says " word\nword ::= [a-z]{1,6} "."'
    r = client.chat.completions.create(model=MODEL, messages=chat("Speak."), n=3, temperature=0.9, max_tokens=24,
                                       extra_body={"guided_grammar": grammar})
    texts = [c.message.content for c in r.choices]
    assert all(re.fullmatch(r"(cat|dog) says [a-z]{1,6}\.", t) for t in texts), texts
    assert [c.finish_reason for c in r.choices] == ["stop"] * 3


def test_constrained_and_free_requests_in_one_batch(client):
    free = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    alone = client.completions.create(**free).choices[0].text

    def constrained(seed):
        return client.completions.create(model=MODEL, prompt="Person:", max_tokens=64, temperature=0.7, seed=seed,
                                         extra_body={"response_format": {"type": "json_schema",
                                                                         "json_schema": {"name": "p", "schema": SCHEMA}}})

    with ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(constrained, seed) for seed in range(4)] + [pool.submit(client.completions.create, **free)
                                                                        for _ in range(2)]
        results = [j.result() for j in jobs]
    assert all(valid(r.choices[0].text) for r in results[:4])
    assert [r.choices[0].text for r in results[4:]] == [alone, alone]


def test_logit_bias_forces_and_bans_tokens(client, llm):
    tok = llm.tokenizer
    fox = tok.encode(" fox", add_special_tokens=False)
    assert len(fox) == 1
    kw = dict(model=MODEL, messages=chat("hi"), max_tokens=6, temperature=0, logprobs=True,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw, logit_bias={str(fox[0]): 100})
    assert r.choices[0].message.content == " fox" * 6
    plain = [t.token for t in client.chat.completions.create(**kw).choices[0].logprobs.content]
    # A token of the greedy answer that is whole text (some are parts of a UTF-8 character).
    favourite = next(t for t in plain if len(tok.encode(t, add_special_tokens=False)) == 1)
    favourite_id = tok.encode(favourite, add_special_tokens=False)[0]
    banned = client.chat.completions.create(**kw, logit_bias={str(favourite_id): -100})
    tokens = [t.token for t in banned.choices[0].logprobs.content]
    assert favourite not in tokens and tokens != plain
    c = client.completions.create(model=MODEL, prompt="The", max_tokens=3, temperature=0, logit_bias={str(fox[0]): 100},
                                  extra_body={"ignore_eos": True})
    assert c.choices[0].text == " fox" * 3


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", 'Unsupported type "strin"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema", "needs json_schema"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex", "Lookbehind is not supported"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", 'Rule "missing" is not defined'),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "at most one output constraint"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "token id 999999, outside the vocabulary"),
    ({"logit_bias": {"fox": 5}}, "logit_bias.fox", "fox"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, None, "min_tokens cannot be combined"),
])
def test_bad_constraints_and_biases_are_400s_naming_the_problem(server, body, param, words):
    for path, extra in (("/v1/chat/completions", {"messages": chat("hi")}), ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 4, **extra, **body}, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and words in error["message"] and error["param"] == param, error


def test_a_text_response_format_is_no_constraint(client):
    kw = dict(model=MODEL, messages=chat("hi"), max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert (client.chat.completions.create(**kw, response_format={"type": "text"}).choices[0].message.content
            == client.chat.completions.create(**kw).choices[0].message.content)


# ----- the acceptance, on the embedded default -----


SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "country": {"enum": ["France", "Germany", "Italy", "Spain"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


def test_the_embedded_default_answers_10_json_schema_requests_validly(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CHITU_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    engine = AsyncLLM(EngineConfig(device="cpu", dtype="float32", max_model_len=512, load_progress=False))
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SMALL_SCHEMA, "strict": True}}
    question = chat("Name a large European city, its country and its population in millions, as JSON.")
    try:
        with LiveServer(build_app(engine, ["SmolLM2-135M-Instruct"])) as live:
            client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused")
            with ThreadPoolExecutor(10) as pool:  # ten requests at once, sampled in one batch
                replies = list(pool.map(lambda _: client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", messages=question, temperature=0.7, max_tokens=64,
                    response_format=fmt), range(10)))
    finally:
        asyncio.run(engine.shutdown())
    texts = [r.choices[0].message.content for r in replies]
    for text in texts:
        value = json.loads(text)
        assert set(value) == {"city", "country", "population_millions"}, text
        assert re.fullmatch("[A-Za-z ]{1,12}", value["city"]) and value["country"] in SMALL_SCHEMA["properties"]["country"]["enum"]
        assert type(value["population_millions"]) is int and 0 <= value["population_millions"] <= 50
    assert [r.choices[0].finish_reason for r in replies] == ["stop"] * 10 and len(set(texts)) > 1

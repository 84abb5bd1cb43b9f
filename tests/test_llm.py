"""The offline API: prompts as text or token ids, per-prompt params, chat templates, errors, KV hygiene."""

import pytest
import torch

from builders import build_chat_model
from chitu_core import LLM, SamplingParams
from chitu_core.errors import ChituError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat-llama")
    hf, tok = build_chat_model(path)
    return path, hf, tok


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir[0], device="cpu", dtype="float32", load_progress=False)


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free == bm.num_blocks and not llm.engine.scheduler.has_unfinished()


def test_text_prompts_in_order_with_per_prompt_params(llm, model_dir):
    _, hf, tok = model_dir
    prompts = ["What is the capital of France?", "The quick brown fox", "Zürich"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 9, 3)]
    outs = llm.generate(prompts, params)
    assert [o.prompt for o in outs] == prompts
    for prompt, p, out in zip(prompts, params, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=p.max_tokens, min_new_tokens=p.max_tokens, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert all_blocks_free(llm)


def test_chat_applies_the_template(llm, model_dir):
    tok = model_dir[2]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    chat = llm.chat(messages, params)[0]
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert chat.prompt == text
    assert chat.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    plain = llm.generate({"prompt_token_ids": chat.prompt_token_ids}, params)[0]
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    two = llm.chat([messages, [{"role": "user", "content": "hi"}]], params)
    assert len(two) == 2 and two[0].outputs[0].token_ids == chat.outputs[0].token_ids


def test_eos_stops_unless_ignored(llm, model_dir):
    eos = model_dir[2].eos_token_id
    free = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    first = free.outputs[0].token_ids[2]
    stopped = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[first]))[0]
    assert stopped.outputs[0].token_ids == free.outputs[0].token_ids[: free.outputs[0].token_ids.index(first) + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    assert llm.engine.eos_token_ids == {eos}


def test_seeded_sampling_is_reproducible_across_batches(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": [9, 8, 7]}, p)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=7, temperature=0.7, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": [1] * 11}, {"prompt_token_ids": [9, 8, 7]}, {"prompt_token_ids": [4, 2]}], [others, p, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate({"prompt_token_ids": [9, 8, 7]}, p.model_copy(update={"seed": 99}))[0].outputs[0].token_ids
    assert other_seed != alone


def test_logprobs(llm):
    out = llm.generate({"prompt_token_ids": [11, 12, 13]}, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, lps in zip(out.token_ids, out.logprobs):
        assert token in lps and len(lps) == 3  # greedy: the chosen token is the top one
        assert max(lps, key=lps.get) == token and all(v <= 0 for v in lps.values())
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(out.logprobs, out.token_ids)))


def test_preemption_under_a_small_cache_keeps_outputs(model_dir):
    path = model_dir[0]
    prompts = [{"prompt_token_ids": list(range(20 + i, 60 + i))} for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = LLM(path, device="cpu", dtype="float32", load_progress=False)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    per_block = roomy.engine.attention.bytes_per_block() * 2  # two layers
    tight = LLM(path, device="cpu", dtype="float32", load_progress=False, kv_cache_memory=per_block * 16, max_model_len=256)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert all_blocks_free(tight)


def test_bad_inputs_say_what_is_wrong(llm):
    with pytest.raises(ValueError, match="got 2 prompts but 3 SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams()] * 3)
    with pytest.raises(ValueError, match="needs the key 'prompt_token_ids'"):
        llm.generate({"tokens": [1]})
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 512\)"):
        llm.generate({"prompt_token_ids": [1, 512]})
    with pytest.raises(ValueError, match="more than max_model_len=512"):
        llm.generate({"prompt_token_ids": [1] * 500}, SamplingParams(max_tokens=13))
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(TypeError, match="not int"):
        llm.generate([5])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    assert all_blocks_free(llm)


def test_unsupported_dtype_and_no_tokenizer(model_dir, tiny_llama):
    with pytest.raises(ChituError, match="does not support dtype float16; it supports float32, bfloat16"):
        LLM(model_dir[0], device="cpu", dtype="float16", load_progress=False)
    bare = LLM(tiny_llama[0], device="cpu", dtype="float32", load_progress=False)
    with pytest.raises(ChituError, match="has no tokenizer; pass"):
        bare.generate("hello")


def test_bfloat16_runs_close_to_float32(model_dir):
    path = model_dir[0]
    ids = {"prompt_token_ids": list(range(30, 70))}
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    f32 = LLM(path, device="cpu", dtype="float32", load_progress=False).generate(ids, params)[0].outputs[0]
    bf16_llm = LLM(path, device="cpu", dtype="bfloat16", load_progress=False)
    assert bf16_llm.engine.dtype == torch.bfloat16
    bf16 = bf16_llm.generate(ids, params)[0].outputs[0]
    top_f32 = f32.logprobs[0]
    shared = set(top_f32) & set(bf16.logprobs[0])
    assert len(shared) >= 3
    assert max(abs(top_f32[t] - bf16.logprobs[0][t]) for t in shared) < 0.15


def test_stop_strings_are_cut_and_reported(llm):
    free = llm.generate("The quick brown fox", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].outputs[0]
    text = free.text
    assert len(text) >= 6
    stop = text[3:6]  # a stop string that first completes inside the output
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[0].outputs[0]
    cut = text.index(stop)
    assert out.text == text[:cut] and stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == free.token_ids[: len(out.token_ids)] and len(out.token_ids) < 24
    assert all_blocks_free(llm)


def test_min_tokens_bans_stop_tokens_until_reached(llm):
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free = llm.generate({"prompt_token_ids": [3, 4, 5]}, base)[0].outputs[0].token_ids
    stop_token = free[1]
    early = llm.generate({"prompt_token_ids": [3, 4, 5]}, base.model_copy(update={"stop_token_ids": [stop_token]}))[0].outputs[0]
    assert early.token_ids == free[: free.index(stop_token) + 1] and early.stop_reason == stop_token
    late = llm.generate({"prompt_token_ids": [3, 4, 5]},
                        base.model_copy(update={"stop_token_ids": [stop_token], "min_tokens": 6}))[0].outputs[0]
    assert stop_token not in late.token_ids[:6] and len(late.token_ids) >= 6
    if late.finish_reason == "stop":
        assert late.token_ids[-1] == stop_token and stop_token not in late.token_ids[:-1]
    else:
        assert late.finish_reason == "length" and len(late.token_ids) == 30


def test_penalties_change_greedy_choices(llm):
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = llm.generate({"prompt_token_ids": [7, 7, 7]}, base)[0].outputs[0].token_ids
    penalized = llm.generate({"prompt_token_ids": [7, 7, 7]}, base.model_copy(update={"frequency_penalty": 2.0}))[0].outputs[0].token_ids
    assert penalized != plain
    assert max(penalized.count(t) for t in set(penalized)) <= max(plain.count(t) for t in set(plain))

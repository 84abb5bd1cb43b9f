"""Gemma 2 and Gemma 3 (text) against transformers on the same random weights (float32, CPU).

Small random configs of each family, with the features that set Gemma apart made to matter at this
size: a sliding window of 8 positions on the sliding layers (prompts and continuations run far past
it), query_pre_attn_scalar unlike head_dim, Gemma 2's attention and final logit soft-capping at caps
small enough that tanh bends them, Gemma 3's q/k norms and its two RoPE tables (a local base for the
sliding layers, a linearly scaled global one for the full layers). Last-token logits of several
prompts from one batched prefill within NMSE 1e-5, 64-token greedy continuations identical to
transformers' generate (its eager attention, the one that soft-caps).
"""

import pytest
import torch
import transformers as tf

from builders import TINY
from chitu_core import LLM, SamplingParams
from test_models import PROMPTS, batched_last_logits
from test_models_phi_glm import NEW_TOKENS, TOKENS, save_random

WINDOW = 8
COMMON = dict(TINY, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, **TOKENS)
CASES = {
    "gemma2": lambda: tf.Gemma2Config(**dict(COMMON, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": lambda: tf.Gemma3TextConfig(**dict(
        COMMON, num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    config = CASES[request.param]()
    config._attn_implementation = "eager"
    hf = save_random(path, config)
    return request.param, hf, LLM(path, device="cpu", dtype="float32", load_progress=False)


def test_served_by_the_plugin_with_the_cpu_attention(pair):
    case, hf, llm = pair
    assert type(llm.engine.model).__name__ == hf.config.architectures[0]
    assert type(llm.engine.model).__module__ == "chitu_models.gemma"
    assert llm.engine.attention.name == "sdpa"  # the CPU attention implements both variants: no fallback
    assert llm.engine.max_model_len == hf.config.max_position_embeddings  # the window does not cap the context


def test_last_token_logits_match_transformers(pair):
    case, hf, llm = pair
    ours = batched_last_logits(llm, PROMPTS)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    nmse = ((ours - ref).pow(2).sum() / ref.pow(2).sum()).item()
    assert nmse <= 1e-5, f"{case}: logits NMSE {nmse:.3g}"


def test_greedy_continuations_match_transformers(pair):
    case, hf, llm = pair
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        assert len(ref) == NEW_TOKENS and out.outputs[0].token_ids == ref, f"{case}: prompt of {len(prompt)} tokens"


def test_the_window_and_the_caps_change_the_result(pair):
    """Without its window (or Gemma 2's caps) the model gives other logits: the features are exercised."""
    case, hf, llm = pair
    ours = batched_last_logits(llm, PROMPTS[2:3])
    layers = [layer.self_attn.attn for layer in llm.engine.model.model.layers]
    saved = [dict(a.variant) for a in layers]
    try:
        for a in layers:
            a.variant.pop("window", None)
        unwindowed = batched_last_logits(llm, PROMPTS[2:3])
        assert not torch.allclose(ours, unwindowed, atol=1e-3)
        if case == "gemma2":
            for a in layers:
                a.variant.pop("softcap")
            assert not torch.allclose(unwindowed, batched_last_logits(llm, PROMPTS[2:3]), atol=1e-3)
    finally:
        for a, v in zip(layers, saved):
            a.variant.clear()
            a.variant.update(v)


def test_an_attention_without_the_variants_gives_way_to_the_reference(caplog):
    """A backend's attention written before contract 1.6 never gets the new keywords: the engine runs the
    core's reference attention for a model that needs them, and says so."""
    from chitu_core.attention.reference import ReferenceAttention
    from chitu_core.attention.build import build_attention
    from chitu_core.model import KVGeometry
    from chitu_cpu.attention import CpuSdpaAttention

    class Older(CpuSdpaAttention):  # overrides forward without the keywords: inherits no variants
        name = "older"

        def forward(self, q, k, v, kv_cache, meta, scale, kv_scale=None):
            return super().forward(q, k, v, kv_cache, meta, scale, kv_scale)

    class Backend:
        @staticmethod
        def attention_backends():
            return {"older": Older}

    plain = KVGeometry(2, 4, 2, 16)
    windowed = KVGeometry(2, 4, 2, 16, attention_variants=frozenset({"sliding_window"}))
    assert type(build_attention(Backend, plain, None, torch.float32, torch.device("cpu"))) is Older
    with caplog.at_level("WARNING"):
        assert type(build_attention(Backend, windowed, None, torch.float32, torch.device("cpu"))) is ReferenceAttention
    assert "lacks the attention variant(s) sliding_window" in caplog.text
    assert CpuSdpaAttention.supported_variants() == {"softcap", "sliding_window"} and Older.supported_variants() == set()

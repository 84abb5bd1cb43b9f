"""Phi-3/3.5 and GLM-4 (0414) against transformers on the same random weights (float32, CPU).

Small random configs of each family (Phi-3 with and without LongRoPE, with and without partial
rotary, under a sliding window; GLM-4 with q/k/v bias, half-head interleaved rotary, head_dim unlike
hidden / heads; GQA throughout): last-token logits of several prompts from one batched prefill
within NMSE 1e-5, and 64-token greedy continuations identical to transformers' generate.

LongRoPE: where the context passes original_max_position_embeddings (64 here) the engine rotates
with the long factors throughout, as transformers does for a sequence longer than 64, so those
prompts are longer than 64; a config whose context is the original one gets the short factors.
"""

import pytest
import torch
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from builders import TINY
from chitu_core import LLM, SamplingParams
from chitu_core.layers.rotary import inv_freq_table, rope_config
from test_models import PROMPTS, batched_last_logits

NEW_TOKENS = 64
ORIGINAL = 64  # original_max_position_embeddings of the LongRoPE configs
LONG_PROMPTS = [list(range(5, 75)), [7] * 65 + [3, 9], list(range(200, 300)), [5 + (i * 37) % 500 for i in range(90)]]
TOKENS = dict(pad_token_id=0, bos_token_id=1)


def longrope(rot_dim: int) -> dict:
    half = rot_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(half)], "long_factor": [1.0 + 0.6 * i for i in range(half)]}


def phi3(**overrides) -> tf.Phi3Config:
    return tf.Phi3Config(**{**TINY, "original_max_position_embeddings": ORIGINAL, **TOKENS, **overrides})


CASES = {  # name -> (config, prompts)
    "phi3": (lambda: phi3(sliding_window=256), PROMPTS),
    "phi3-window": (lambda: phi3(sliding_window=8), PROMPTS),  # prompts and continuations far past the window
    "phi3-partial": (lambda: phi3(partial_rotary_factor=0.5), PROMPTS),
    "phi3-longrope": (lambda: phi3(rope_parameters=longrope(16)), LONG_PROMPTS),
    "phi3-longrope-partial": (lambda: phi3(rope_parameters=dict(longrope(8), partial_rotary_factor=0.5)), LONG_PROMPTS),
    "phi3-longrope-short": (lambda: phi3(rope_parameters=longrope(16), max_position_embeddings=ORIGINAL * 4,
                                         original_max_position_embeddings=ORIGINAL * 4), PROMPTS),
    "glm4": (lambda: tf.Glm4Config(**dict(TINY, head_dim=32, attention_bias=True, partial_rotary_factor=0.5, **TOKENS)),
             PROMPTS),
}


def save_random(path, config) -> torch.nn.Module:
    """A random transformers model of ``config``, saved to ``path``; its weights widened (norms around
    1) so that logits are far from ties."""
    config.eos_token_id = None  # so transformers' generate runs NEW_TOKENS steps as ignore_eos does
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    make_config, prompts = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random(path, make_config())
    return request.param, hf, LLM(path, device="cpu", dtype="float32", load_progress=False), prompts


def test_architecture_is_served_by_its_plugin(pair):
    case, hf, llm, _ = pair
    assert type(llm.engine.model).__name__ == hf.config.architectures[0]
    assert type(llm.engine.model).__module__ == f"chitu_models.{case.split('-')[0]}"


def test_last_token_logits_match_transformers(pair):
    case, hf, llm, prompts = pair
    ours = batched_last_logits(llm, prompts)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    nmse = ((ours - ref).pow(2).sum() / ref.pow(2).sum()).item()
    assert nmse <= 1e-5, f"{case}: logits NMSE {nmse:.3g}"


def test_greedy_continuations_match_transformers(pair):
    case, hf, llm, prompts = pair
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        assert len(ref) == NEW_TOKENS and out.outputs[0].token_ids == ref, f"{case}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("case", ["phi3-longrope", "phi3-longrope-partial", "phi3-longrope-short"])
def test_longrope_table_is_transformers_for_the_context(case):
    """Long factors where the context passes the original one (transformers' choice for a sequence of
    original + 1 tokens), short ones where it does not; the attention factor either way."""
    config = CASES[case][0]()
    rope = rope_config(config)
    rot_dim = int(16 * rope.partial_rotary_factor)
    long = config.max_position_embeddings > config.original_max_position_embeddings
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=ORIGINAL + 1 if long else None)
    assert torch.equal(inv_freq_table(rope, rot_dim, 1, config.max_position_embeddings)[0], ref_inv_freq)
    assert rope.attention_factor == pytest.approx(ref_factor, rel=1e-12)
    assert (rope.attention_factor > 1.2) == long  # sqrt(1 + ln 8 / ln 64) for 512 / 64


def test_a_sliding_window_does_not_cap_the_context(pair):
    """The window is an attention variant (contract 1.6), not a cap: the whole context is served."""
    case, hf, llm, _ = pair
    assert llm.engine.max_model_len == hf.config.max_position_embeddings
    window = getattr(hf.config, "sliding_window", None)
    assert llm.engine.model.kv_geometry(hf.config, 1).attention_variants == ({"sliding_window"} if window else set())

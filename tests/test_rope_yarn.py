"""YaRN rotary scaling against transformers' own ``ROPE_INIT_FUNCTIONS["yarn"]``: the inverse
frequencies bit for bit, the attention factor, and the cos|sin table against transformers' rotary
module, for DeepSeek's settings (V2-Lite, V3, and an mscale that differs from mscale_all_dim) and a
Qwen-style config; both config spellings (rope_parameters, and rope_theta + rope_scaling).
Then a tiny Qwen2 with YaRN end to end: last-token logits against transformers.
"""

import types

import pytest
import torch
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from builders import build_model
from chitu_core import LLM
from chitu_core.layers.rotary import RotaryEmbedding, inv_freq_table, rope_config, yarn_mscale
from test_models import batched_last_logits

DEEPSEEK_YARN = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1)
DEEPSEEK = dict(qk_rope_head_dim=64, max_position_embeddings=163840, num_attention_heads=16, hidden_size=2048)

CASES = {
    "deepseek-v2-lite": lambda: tf.DeepseekV2Config(
        rope_parameters=dict(DEEPSEEK_YARN, rope_theta=10000.0, mscale=0.707, mscale_all_dim=0.707), **DEEPSEEK),
    "deepseek-v3": lambda: tf.DeepseekV3Config(
        rope_parameters=dict(DEEPSEEK_YARN, rope_theta=10000.0, mscale=1.0, mscale_all_dim=1.0), **DEEPSEEK),
    "deepseek-uneven-mscale": lambda: tf.DeepseekV3Config(
        rope_parameters=dict(DEEPSEEK_YARN, rope_theta=10000.0, mscale=1.0, mscale_all_dim=0.707), **DEEPSEEK),
    "deepseek-untruncated": lambda: tf.DeepseekV3Config(
        rope_parameters=dict(DEEPSEEK_YARN, rope_theta=10000.0, mscale=1.0, mscale_all_dim=1.0, truncate=False), **DEEPSEEK),
    "qwen": lambda: tf.Qwen2Config(
        rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=32768),
        max_position_embeddings=131072, hidden_size=1024, num_attention_heads=8),
}


def rot_dim(config) -> int:
    return getattr(config, "qk_rope_head_dim", None) or config.hidden_size // config.num_attention_heads


@pytest.mark.parametrize("case", CASES)
def test_inverse_frequencies_and_attention_factor_match_transformers(case):
    config = CASES[case]()
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    rope = rope_config(config)
    ours = inv_freq_table(rope, rot_dim(config), 1, config.max_position_embeddings)[0]
    assert torch.equal(ours, ref_inv_freq)
    assert rope.attention_factor == pytest.approx(ref_factor, rel=1e-12)
    if case == "deepseek-uneven-mscale":
        assert rope.attention_factor == pytest.approx(yarn_mscale(40, 1.0) / yarn_mscale(40, 0.707))
        assert rope.attention_factor > 1.05  # so the factor is seen in cos and sin
    if case == "qwen":
        assert rope.attention_factor == pytest.approx(0.1 * torch.tensor(4.0).log().item() + 1)


@pytest.mark.parametrize("case", ["deepseek-v3", "deepseek-uneven-mscale", "qwen"])
def test_cos_sin_table_matches_transformers_rotary(case):
    config = CASES[case]()
    ctx = types.SimpleNamespace(ops=None, device=torch.device("cpu"))
    ours = RotaryEmbedding(rot_dim(config), config.max_position_embeddings, rope_config(config), ctx).cos_sin_cache
    positions = torch.tensor([[0, 1, 7, 4095, 4096, 33000, config.max_position_embeddings - 1]])
    rotary = (tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding if case != "qwen"
              else tf.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding)(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, R]: cat(freqs, freqs)
    half = ours.shape[-1] // 2
    torch.testing.assert_close(ours[positions[0], :half], cos[0, :, :half], rtol=0, atol=2e-6)
    torch.testing.assert_close(ours[positions[0], half:], sin[0, :, :half], rtol=0, atol=2e-6)


def test_both_config_spellings_give_the_same_table():
    params = dict(mscale=0.707, mscale_all_dim=0.707, factor=40, original_max_position_embeddings=4096,
                  beta_fast=32, beta_slow=1)
    new = types.SimpleNamespace(max_position_embeddings=163840,
                                rope_parameters=dict(params, rope_type="yarn", rope_theta=10000.0))
    legacy = types.SimpleNamespace(max_position_embeddings=163840, rope_theta=10000.0,
                                   rope_scaling=dict(params, type="yarn"))
    a, b = rope_config(new), rope_config(legacy)
    assert (a.rope_type, a.theta, a.attention_factor) == (b.rope_type, b.theta, b.attention_factor) == ("yarn", 10000.0, 1.0)
    assert torch.equal(inv_freq_table(a, 64, 1, 163840), inv_freq_table(b, 64, 1, 163840))


def test_missing_original_length_and_factor_follow_transformers():
    """No original_max_position_embeddings: the context length; no factor: max / original."""
    config = types.SimpleNamespace(max_position_embeddings=8192, original_max_position_embeddings=2048,
                                   rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=None))
    rope = rope_config(config)
    assert rope.params["original_max_position_embeddings"] == 2048 and rope.params["factor"] == 4.0


def test_qwen2_with_yarn_matches_transformers(tmp_path):
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)
    hf = build_model(tmp_path, "qwen2", rope_parameters=rope, max_position_embeddings=128)
    assert hf.model.rotary_emb.attention_scaling > 1.1
    llm = LLM(tmp_path, device="cpu", dtype="float32", load_progress=False)
    prompts = [list(range(1, 60)), [5, 6, 7], list(range(100, 140))]
    ours = batched_last_logits(llm, prompts)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    nmse = ((ours - ref).square().sum() / ref.square().sum()).item()
    assert nmse <= 1e-10, nmse

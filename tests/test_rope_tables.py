"""RoPE tables (``chitu_core.layers.rotary``) against transformers' own: every rope type the layer reads,
within and past the original context, partial rotary; and the config spellings it accepts."""

from types import SimpleNamespace

import pytest
import torch

from chitu_core.layers.rotary import RotaryEmbedding, inv_freq_table, rope_config
from test_ops import OPS

HEAD_DIM, MAX_POS = 32, 64
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def hf_config(scaling: dict | None, theta: float = 50000.0):
    from transformers import LlamaConfig

    params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return LlamaConfig(hidden_size=HEAD_DIM * 2, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=MAX_POS, rope_parameters=params)


def hf_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]  # [P, D] each, the half table repeated twice


def chitu_cache(config) -> torch.Tensor:
    ctx = SimpleNamespace(ops=OPS, device=torch.device("cpu"))
    return RotaryEmbedding(HEAD_DIM, MAX_POS, rope_config(config), ctx).cos_sin_cache


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3", "dynamic"])
def test_rope_table_matches_transformers_within_the_original_context(rope_type):
    config = hf_config(SCALINGS[rope_type])
    positions = torch.arange(MAX_POS)
    cos, sin = hf_cos_sin(config, positions)
    half = HEAD_DIM // 2
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    cache = chitu_cache(config)
    extended = MAX_POS * SCALINGS[rope_type]["factor"] if rope_type == "dynamic" else MAX_POS
    assert cache.dtype == torch.float32 and cache.shape == (extended, HEAD_DIM)
    cache = cache[:MAX_POS]
    assert torch.equal(cache[:, :half], cos[:, :half])
    assert torch.equal(cache[:, half:], sin[:, :half])
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        want, _ = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        got = inv_freq_table(rope_config(config), HEAD_DIM, MAX_POS, MAX_POS)
        assert torch.equal(got, want.expand(MAX_POS, -1))


def test_dynamic_rope_past_the_original_context_uses_the_base_for_position_plus_one():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_config(SCALINGS["dynamic"])
    positions = int(MAX_POS * SCALINGS["dynamic"]["factor"])
    table = inv_freq_table(rope_config(config), HEAD_DIM, positions, MAX_POS)
    cache = chitu_cache(config)
    assert cache.shape[0] == positions
    half = HEAD_DIM // 2
    for pos in [MAX_POS - 1, MAX_POS, MAX_POS + 1, MAX_POS + 7, positions - 1]:
        want, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=pos + 1)
        assert torch.equal(table[pos], want)
        angles = torch.tensor(float(pos)) * want  # float32, as transformers' forward
        assert torch.equal(cache[pos, :half], angles.cos()) and torch.equal(cache[pos, half:], angles.sin())
    # At the last position, transformers' own forward agrees (it rescales for max(position) + 1);
    # it forms angles with a matmul rather than a product, hence float32 rounding, not equality.
    cos, sin = hf_cos_sin(config, torch.tensor([positions - 1]))
    torch.testing.assert_close(cache[positions - 1, :half], cos[0, :half])
    torch.testing.assert_close(cache[positions - 1, half:], sin[0, :half])


def test_partial_rotary_table_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_config({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5})
    want, _ = ROPE_INIT_FUNCTIONS["linear"](config, None)
    assert want.shape == (HEAD_DIM // 4,)
    got = inv_freq_table(rope_config(config), HEAD_DIM // 2, MAX_POS, MAX_POS)
    assert torch.equal(got, want.expand(MAX_POS, -1))


@pytest.mark.parametrize(
    "config,want",
    [
        (SimpleNamespace(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
         ("llama3", 5e5, {"factor": 8.0})),
        (SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), ("default", 1e6, {})),
        (SimpleNamespace(rope_theta=2e5, rope_scaling={"type": "linear", "factor": 2.0}),
         ("linear", 2e5, {"factor": 2.0})),
        (SimpleNamespace(rope_theta=2e5, rope_scaling={"rope_type": "dynamic", "factor": 3.0}),
         ("dynamic", 2e5, {"factor": 3.0})),
        (SimpleNamespace(rope_theta=3e4, rope_scaling=None), ("default", 3e4, {})),
        (SimpleNamespace(), ("default", 10000.0, {})),
    ],
    ids=["v5-llama3", "v5-default", "legacy-type", "legacy-rope_type", "legacy-none", "nothing"],
)
def test_rope_config_reads_both_spellings(config, want):
    rope = rope_config(config)
    params = {k: v for k, v in rope.params.items() if k not in ("type", "rope_type")}
    assert (rope.rope_type, rope.theta, params) == want


def test_rope_config_reads_transformers_configs():
    rope = rope_config(hf_config(SCALINGS["llama3"], theta=5e5))
    assert (rope.rope_type, rope.theta) == ("llama3", 5e5)
    assert rope.params["factor"] == 8.0 and rope.params["original_max_position_embeddings"] == 16
    from transformers import LlamaConfig

    legacy = LlamaConfig(rope_theta=2e5, rope_scaling={"type": "linear", "factor": 2.0})
    rope = rope_config(legacy)
    assert (rope.rope_type, rope.theta, rope.params["factor"]) == ("linear", 2e5, 2.0)
    with pytest.raises(Exception, match="not supported"):
        rope_config(SimpleNamespace(rope_parameters={"rope_type": "made-up", "rope_theta": 1e4}))
    with pytest.raises(Exception, match="needs the context length"):
        rope_config(SimpleNamespace(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}))

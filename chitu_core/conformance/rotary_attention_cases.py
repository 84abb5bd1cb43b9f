"""Conformance of an attention backend's fused RoPE (``fuses_rotary``: ``rotary_and_write_kv``, then
``attend``) and of contract 1.12's per-head q/k norms inside it (``fuses_qk_norm``, ``qk_norm=``).

Each case runs two sequences through the fused path twice, a prefill step and then a decode step, and
compares each step's attention output with float64: the norms where given (each head of q and k times
rsqrt(mean square + eps) and the weight, rounded once to the dtype, as the contract says), the rotation
of q and k at their positions (``reference.rotary_embedding``: neox or interleaved pairs, channels past
the table's width passed through), then dense causal attention over every key the sequence has written.
The decode step attends over the prefill's keys as the cache holds them, so a key rotated at the wrong
position, or written unrotated, fails it. Rows ``attention/NAME/rotary`` (``.../rotary+qk_norm``);
declined where the backend does not declare the fusion (the model's layer then rotates and normalises
itself, through the ops).
"""

import math
from dataclasses import dataclass
from functools import partial

import torch

from chitu_core.attention.contract import AttentionBackend, AttentionMetadata
from chitu_core.conformance.attention_cases import allocate_blocks, dense_attention, metadata
from chitu_core.conformance.case import Case, Outcome, Target, randn, raised
from chitu_core.conformance.compare import Verdict, check_tensor, compare, worst
from chitu_core.ops import reference

HEADS, KV_HEADS, HEAD_DIM, EPS = 8, 2, 64, 1e-6
PREFILL = (13, 5)  # two sequences' prompt lengths; the decode step adds one token to each
POSITIONS = 64  # rows of the cos|sin table


@dataclass(frozen=True)
class RotaryPlan:
    is_neox: bool
    rot: int  # the table's width: channels rot.. pass through
    qk_norm: bool

    @property
    def label(self) -> str:
        return (f"{'neox' if self.is_neox else 'interleaved'} rot={self.rot} Hq={HEADS} Hk={KV_HEADS} D={HEAD_DIM} "
                f"prefill {'+'.join(map(str, PREFILL))} then decode" + (" qk_norm" if self.qk_norm else ""))


PLANS = (RotaryPlan(True, HEAD_DIM, False), RotaryPlan(False, HEAD_DIM, False), RotaryPlan(True, 32, False),
         RotaryPlan(True, HEAD_DIM, True), RotaryPlan(False, 32, True))


def _normed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The per-head norm as contract 1.12 has it: in float64, rounded once to x's dtype."""
    xd = x.double()
    return (xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + EPS) * weight.double()).to(x.dtype)


def run_rotary_case(attn_cls: type[AttentionBackend], plan: RotaryPlan, case: Case, target: Target) -> Outcome:
    gen, device, dtype = case.generator(), target.device, case.dtype
    try:
        attn = attn_cls(HEADS, KV_HEADS, HEAD_DIM, attn_cls.block_sizes[0], dtype, device)
        attn.set_kv_cache_dtype("auto")
        tables, num_blocks = allocate_blocks(gen, [n + 1 for n in PREFILL], attn.block_size)
        cache = attn.allocate_kv_cache(num_blocks)
    except Exception as exc:
        return Outcome(raised(exc, f"{attn_cls.__name__} construction").verdict)
    angles = torch.rand(POSITIONS, plan.rot // 2, generator=gen, dtype=torch.float64) * 100.0
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1).float()
    weights = [randn(gen, HEAD_DIM, dtype=dtype, scale=0.5, offset=1.0) for _ in range(2)] if plan.qk_norm else None
    scale, threshold = 1 / math.sqrt(HEAD_DIM), target.threshold(case)
    keys, values = [[] for _ in PREFILL], [[] for _ in PREFILL]
    verdicts = []
    for step, (contexts, news) in enumerate((((0, 0), PREFILL), (PREFILL, (1, 1)))):
        meta = metadata(tables, list(contexts), list(news), attn.block_size)
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, news)])
        total = sum(news)
        q, k, v = (randn(gen, total, h, HEAD_DIM, dtype=dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
        dev = AttentionMetadata(*(t.to(device) for t in (meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                                         meta.context_lens, meta.query_start_loc)),
                                meta.max_query_len, meta.max_seq_len, meta.block_size)
        norms = {"qk_norm": (weights[0].to(device), weights[1].to(device), EPS)} if plan.qk_norm else {}
        try:
            dev.backend_state = attn.prepare(dev)
            rotated, _ = attn.rotary_and_write_kv(positions.to(device), q.to(device), k.to(device), v.to(device),
                                                  cos_sin.to(device), plan.is_neox, cache, dev, **norms)
            out = attn.attend(rotated, cache, dev, scale)
        except Exception as exc:  # the backend's own failure is the case's result
            return Outcome(raised(exc, "rotary_and_write_kv / attend").verdict)
        if problem := check_tensor(out, (total, HEADS, HEAD_DIM), dtype, device, "attend's output"):
            return Outcome(Verdict.fail(f"step {step + 1}: {problem}"))
        if plan.qk_norm:
            q, k = _normed(q, weights[0]), _normed(k, weights[1])
        rq, rk = reference.rotary_embedding(positions, q.double(), k.double(), cos_sin.double(), plan.is_neox)
        start = 0
        for b, (c, n) in enumerate(zip(contexts, news)):
            keys[b].append(rk[start:start + n])
            values[b].append(v[start:start + n].double())
            want = dense_attention(rq[start:start + n], torch.cat(keys[b]), torch.cat(values[b]), c, scale)
            verdicts.append(compare(out[start:start + n], want, threshold, f"step {step + 1} sequence {b}"))
            start += n
    return Outcome(worst(verdicts))


def rotary_attention_cases(backend, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
    """A row per declared attention backend and norm choice; none for the reference fallback."""
    cases = []
    for name, cls in dict(backend.attention_backends()).items():
        for dtype in dtypes:
            for plan in PLANS:
                row = f"attention/{name}/rotary" + ("+qk_norm" if plan.qk_norm else "")
                declined = ("" if cls.fuses_rotary else "fuses_rotary is False: the model's layer rotates q and k "
                            "through the rotary_embedding op")
                if plan.qk_norm and not declined and not cls.fuses_qk_norm:
                    declined = "fuses_qk_norm is False (contract 1.12): the model's layer runs the per-head norms"
                params = {"backend": name, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                          "block_size": cls.block_sizes[0], "kind": "mixed", "max_seq_len": max(PREFILL) + 1,
                          "max_query_len": max(PREFILL)}
                cases.append(Case(row, "attention", "attention", dtype, params, plan.label,
                                  partial(run_rotary_case, cls, plan), declined=declined))
    return cases

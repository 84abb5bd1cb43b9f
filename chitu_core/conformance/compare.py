"""The metrics of ``thresholds.METRICS``: a backend's output against the float64 reference.

Each comparison returns a ``Verdict``: whether it passed, the error the metric measures and the
bound it is held to (close: the worst element's share of its tolerance, bound 1; nmse: the NMSE and
its limit; exact and argmax: the number of wrong elements or rows, bound 0; zscore: the largest
|z| and its limit), and a sentence saying what was wrong.
"""

from dataclasses import dataclass

import torch

from chitu_core.conformance.thresholds import Threshold

Tensor = torch.Tensor


@dataclass
class Verdict:
    ok: bool
    error: float | None = None
    bound: float | None = None
    detail: str = ""

    @classmethod
    def fail(cls, detail: str) -> "Verdict":
        return cls(False, None, None, detail)


def worst(verdicts: list[Verdict]) -> Verdict:
    """The first failure, else the passing verdict nearest its bound."""
    for v in verdicts:
        if not v.ok:
            return v
    return max(verdicts, key=lambda v: (v.error or 0.0) / (v.bound or 1.0))


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def check_tensor(got: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, name: str) -> str:
    """An empty string if ``got`` is a tensor of this shape, dtype and device, else what is wrong."""
    if not isinstance(got, torch.Tensor):
        return f"{name} is a {type(got).__name__}, not a tensor"
    if tuple(got.shape) != tuple(shape):
        return f"{name} has shape {list(got.shape)}, the contract gives {list(shape)}"
    if got.dtype != dtype:
        return f"{name} has dtype {got.dtype}, the contract gives {dtype}"
    if got.device.type != device.type:
        return f"{name} is on {got.device}, not on the backend's device {device}"
    return ""


def compare(got: Tensor, want: Tensor, threshold: Threshold, name: str = "output") -> Verdict:
    """got (the backend's, any device) against want (the reference's, float64 or integer, on the CPU)."""
    if threshold.metric == "argmax":
        raise ValueError("argmax verdicts need the reference scores: use compare_argmax")
    if not got.is_floating_point():
        wrong = got.cpu() != want.to(got.dtype).cpu()
        n = int(wrong.sum())
        if n:
            i = _index(int(wrong.flatten().nonzero()[0]), wrong.shape)
            return Verdict(False, float(n), 0.0, f"{name}: {n} of {wrong.numel()} elements differ, first at {list(i)}: "
                                                 f"got {got.cpu()[i].item()}, reference {want[i].item()}")
        return Verdict(True, 0.0, 0.0)
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    nans = g.isnan()
    if nans.any():
        i = _index(int(nans.flatten().nonzero()[0]), g.shape)
        return Verdict(False, float("inf"), None, f"{name}: {int(nans.sum())} of {g.numel()} elements are NaN "
                                                   f"(first at {list(i)}; unwritten, or read outside its operand?)")
    infinite = g.isinf() | w.isinf()
    inf_wrong = infinite & (g != w)
    if inf_wrong.any():
        i = _index(int(inf_wrong.flatten().nonzero()[0]), g.shape)
        return Verdict(False, float("inf"), None, f"{name}: {int(inf_wrong.sum())} infinities differ from the reference "
                                                   f"in sign or place (first at {list(i)}: got {g[i].item()}, "
                                                   f"reference {w[i].item()})")
    finite = ~infinite
    g, w = torch.where(finite, g, 0.0), torch.where(finite, w, 0.0)
    diff = (g - w).abs()
    if threshold.metric == "exact":
        n = int((diff > 0).sum())
        if n:
            i = _index(int(diff.flatten().argmax()), diff.shape)
            return Verdict(False, float(n), 0.0, f"{name}: {n} of {g.numel()} elements differ, the most at {list(i)}: "
                                                 f"got {g[i].item():.6g}, reference {w[i].item():.6g}")
        return Verdict(True, 0.0, 0.0)
    if threshold.metric == "close":
        share = diff / (threshold.atol + threshold.rtol * w.abs())
        error = float(share.max()) if share.numel() else 0.0
        if error > 1.0:
            i = _index(int(share.flatten().argmax()), share.shape)
            return Verdict(False, error, 1.0, f"{name}: element {list(i)} is {g[i].item():.6g}, reference "
                                              f"{w[i].item():.6g}: {error:.3g} times its tolerance "
                                              f"({threshold.describe()})")
        return Verdict(True, error, 1.0)
    if threshold.metric == "nmse":
        power = float(w.pow(2).sum())
        nmse = float(diff.pow(2).sum()) / power if power > 0 else float(diff.pow(2).sum())
        elem_bound = threshold.rtol * float(w.abs().max()) if w.numel() else 0.0
        if nmse > threshold.limit or nmse != nmse:
            return Verdict(False, nmse, threshold.limit, f"{name}: NMSE {nmse:.3g} exceeds {threshold.limit:.3g}")
        if diff.numel() and float(diff.max()) > elem_bound:
            i = _index(int(diff.flatten().argmax()), diff.shape)
            return Verdict(False, nmse, threshold.limit,
                           f"{name}: NMSE {nmse:.3g} passes, but element {list(i)} is {g[i].item():.6g} where the "
                           f"reference has {w[i].item():.6g} (off by more than {threshold.rtol:.2g} of max|ref|: "
                           f"unwritten or garbage?)")
        return Verdict(True, nmse, threshold.limit)
    raise ValueError(f"unknown metric {threshold.metric!r}")


def compare_argmax(got: Tensor, scores: Tensor, threshold: Threshold, name: str = "output") -> Verdict:
    """got: int64 [B], one index per row; scores: float64 [B, V], the reference's scores of each index."""
    g = got.detach().cpu().long()
    if g.min() < 0 or g.max() >= scores.shape[-1]:
        return Verdict(False, float(g.numel()), 0.0, f"{name}: indices outside [0, {scores.shape[-1]})")
    best = scores.max(dim=-1).values
    mine = scores.gather(1, g[:, None])[:, 0]
    if threshold.rtol or threshold.atol:
        ok = mine >= best - (threshold.atol + threshold.rtol * best.abs())
    else:
        lowest = (scores == best[:, None]).int().argmax(dim=-1)
        ok = g == lowest
    bad = (~ok).nonzero().flatten().tolist()
    if bad:
        r = bad[0]
        want = int((scores[r] == best[r]).int().argmax())
        return Verdict(False, float(len(bad)), 0.0,
                       f"{name}: {len(bad)} of {g.numel()} rows chose another index, first row {r}: got {int(g[r])} "
                       f"(reference score {mine[r].item():.6g}), reference {want} ({best[r].item():.6g}); "
                       f"{threshold.describe()}")
    return Verdict(True, 0.0, 0.0)


def compare_draws(counts: Tensor, probs: Tensor, threshold: Threshold, name: str = "draws") -> Verdict:
    """counts: int [V] of N draws; probs: float64 [V], the reference distribution. zscore metric."""
    n = float(counts.sum())
    counts, probs = counts.double().cpu(), probs.double().cpu()
    impossible = (probs == 0) & (counts > 0)
    if impossible.any():
        t = int(impossible.nonzero()[0])
        return Verdict(False, float("inf"), threshold.limit,
                       f"{name}: drew token {t} {int(counts[t])} times, though its probability is 0")
    possible = probs > 0
    sd = (n * probs * (1 - probs)).sqrt()
    z = torch.where(possible & (sd > 0), (counts - n * probs) / sd.clamp_min(1e-300), 0.0).abs()
    error = float(z.max())
    if error > threshold.limit:
        t = int(z.argmax())
        return Verdict(False, error, threshold.limit,
                       f"{name}: token {t} drawn {int(counts[t])} times in {int(n)}, expected {n * probs[t].item():.1f} "
                       f"(|z| = {error:.3g} > {threshold.limit:.3g})")
    return Verdict(True, error, threshold.limit)

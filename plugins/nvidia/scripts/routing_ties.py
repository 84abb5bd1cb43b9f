"""Where a mixture-of-experts model's greedy run parts from transformers' float32 one: did our bf16 routing
choose other experts than float64 somewhere along the shared tokens, and was each such choice a near-tie?

An expert switched by rounding moves the hidden state by a whole expert's output, so the tokens after it
may part at a logit gap far wider than bf16 noise: the logit near-tie rule (``models_check.near_tie``)
cannot see it. This looks at the cause instead. For each MoE layer and each position of the shared
sequence (prompt + our tokens before the parting):

- ours: the experts our kernels chose (our router logits as our run computed them, through our
  ``moe_route``) along the shared sequence itself, teacher-forced: one eager prefill of each prompt and
  our tokens up to the parting. (A free-running eager run of the prompts parted from the graph run's
  tokens at near-ties of its own on some prompts, and then judged routing along other tokens: DeepSeek-V3
  showed runs of "flips" at clear margins at every position after such a split.)
- float64: the layer's routing (``reference.moe_route``, our layer's arguments and correction bias) of
  the router logits of transformers' float32 model, its gate's input times its weight in float64;
- noise: sigma, the RMS over experts of transformers-bf16's own error on those router logits (its
  bf16 model's gate input times its own, rounded, weight) at that position; where our router logits are
  known (``our_routing``'s) and noisier there, up to twice sigma, their error instead (beyond that our
  forward is at fault there, and only a flip within 3 sigma is a near-tie).

A position where ours differs from float64 is a routing flip. A flip that an earlier one explains (at a
lower MoE layer and a position no later: its expert output reached this input) is not judged; each
other (root) flip is a near-tie when float64 chooses otherwise too once one chosen and one unchosen
expert's logits move 1.5 sqrt(2) sigma each, toward each other (3 sigma of a difference of two logits,
as the logit rule: ``tie_margin`` at most 3). A parting is explained by routing when there are root
flips and every one is a near-tie; a root flip that is not would be a fault.
"""

import torch

from chitu_core.ops import reference


def gates(model) -> list[torch.nn.Module]:
    """transformers' MoE routers in layer order: modules named ``*.gate`` with a weight [experts, hidden]."""
    return [m for n, m in model.named_modules() if n.endswith(".gate") and getattr(m, "weight", None) is not None
            and m.weight.dim() == 2]


class GateInputs:
    """While open, records each router's input rows ([T, H], float32, on the host) per forward call, and
    each router's weight as it is on entry: the logits are the model's own as it ran, whatever is done to
    it afterwards (models_check casts its float32 model to bfloat16 once the float32 runs are recorded;
    a weight read then would put bf16 rounding into the float64 reference)."""

    def __init__(self, model):
        self.gates, self.inputs, self._handles, self.weights = gates(model), [], [], []

    def __enter__(self):
        self.weights = [g.weight.detach().to("cpu", torch.float64, copy=True) for g in self.gates]
        for i, gate in enumerate(self.gates):
            self._handles.append(gate.register_forward_pre_hook(
                lambda _m, args, i=i: self.inputs[-1][i].append(args[0].reshape(-1, args[0].shape[-1]).float().cpu())))
        return self

    def call(self) -> None:
        """Start recording a new forward call (one prompt)."""
        self.inputs.append([[] for _ in self.gates])

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def logits(self, call: int, layer: int, dtype=torch.float64) -> torch.Tensor:
        """The router logits [T, E] of one recorded call, the input times the gate's weight in ``dtype``."""
        x = torch.cat(self.inputs[call][layer])
        return x.to(dtype) @ self.weights[layer].to(dtype).T


def our_routing(llm, sequences: list[list[int]]) -> tuple[list[list[torch.Tensor]], list, list[list[torch.Tensor]]]:
    """Our eager prefill of ``sequences`` (teacher-forced: the tokens given, none sampled into them): per
    sequence and MoE layer the experts chosen at every position ([len(sequence), top_k], sorted), the
    layers (for their arguments), and per sequence and layer our router logits ([len(sequence), E],
    float32 on the host)."""
    from chitu_core import SamplingParams
    from chitu_core.layers.moe import FusedMoE

    engine = llm.engine
    layers = [m for m in engine.model.modules() if isinstance(m, FusedMoE)]
    steps_seen: list[tuple[list[tuple[int, int]], list, list]] = []  # ((seq, rows) a step, ids a layer, logits a layer)
    launch = engine.runner.launch

    def recording_launch(batch, *args, **kwargs):
        steps_seen.append(([(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)], [None] * len(layers),
                           [None] * len(layers)))
        return launch(batch, *args, **kwargs)

    def hook(layer, inputs, _out, i):
        _, ids = layer.ops.moe_route(inputs[1], correction_bias=layer.e_score_correction_bias, **layer.route_args)
        steps_seen[-1][1][i] = ids.sort(-1).values.cpu()
        steps_seen[-1][2][i] = inputs[1].float().cpu()

    handles = [m.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i)) for i, m in enumerate(layers)]
    engine.runner.launch = recording_launch
    caching, engine.block_manager.enable_prefix_caching = engine.block_manager.enable_prefix_caching, False
    try:
        llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1, temperature=0.0,
                                                                                    ignore_eos=True))
    finally:  # (no prefix caching: a cached prefix would be routed by no step of this run)
        engine.runner.launch = launch
        engine.block_manager.enable_prefix_caching = caching
        for h in handles:
            h.remove()
    seq_of = {}  # seq id -> prompt index, in the order the sequences first appear (arrival order)
    per_seq: dict[int, tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]] = {}
    for rows, ids, logits in steps_seen:
        start = 0
        for seq_id, n in rows:
            seq_of.setdefault(seq_id, len(seq_of))
            chunks, logit_chunks = per_seq.setdefault(seq_id, ([[] for _ in layers], [[] for _ in layers]))
            for li in range(len(layers)):
                chunks[li].append(ids[li][start:start + n])
                logit_chunks[li].append(logits[li][start:start + n])
            start += n
    order = sorted(seq_of, key=seq_of.get)
    routing = [[torch.cat(c) for c in per_seq[sid][0]] for sid in order]
    our_logits = [[torch.cat(c) for c in per_seq[sid][1]] for sid in order]
    for r, s in zip(routing, sequences):
        if any(len(ids) != len(s) for ids in r):
            raise RuntimeError(f"routed {[len(ids) for ids in r]} positions of a sequence of {len(s)} tokens")
    return routing, layers, our_logits


def _route(logits: torch.Tensor, layer) -> torch.Tensor:
    bias = layer.e_score_correction_bias
    args = dict(layer.route_args)
    return reference.moe_route(logits, correction_bias=None if bias is None else bias.detach().cpu().double(),
                               **args)[1].sort(-1).values


def own_routing(recorded: "GateInputs", layers: list, call: int, position: int) -> list[torch.Tensor]:
    """A recorded model's own experts at one position, per MoE layer ([top_k] sorted): its router logits
    there, as it ran, routed in float64 by the layer's rule."""
    return [_route(recorded.logits(call, li)[position:position + 1], layer)[0] for li, layer in enumerate(layers)]


def _changes(logits: torch.Tensor, layer, chosen: torch.Tensor, i: int, j: int, step: float) -> bool:
    """Whether float64's choice for one row changes once expert i's logit moves down by ``step`` and
    expert j's up by as much."""
    nudged = logits.clone()
    nudged[i] -= step
    nudged[j] += step
    return not torch.equal(_route(nudged[None], layer)[0], chosen)


def _pairs(logits: torch.Tensor, chosen: torch.Tensor) -> list[tuple[int, int]]:
    """(chosen, unchosen) expert pairs of one row."""
    others = [j for j in range(logits.shape[-1]) if j not in set(chosen.tolist())]
    return [(i, j) for i in chosen.tolist() if i >= 0 for j in others]


def tie_margin(logits: torch.Tensor, sigma: float, layer, chosen: torch.Tensor, most: float = 20.0) -> float:
    """How far float64's choice for one row is from changing: the least move, in sigmas of a difference of
    two logits (each of the two logits moving ``sqrt(2) / 2`` of it), of one chosen and one unchosen expert
    toward each other that changes it (bisected to 1%); ``most`` where none up to it does. A near-tie
    is a margin of at most 3 (``explain``: in sigmas of the noise there)."""
    def changes(d: float, i: int, j: int) -> bool:
        return _changes(logits, layer, chosen, i, j, d * sigma / 2 ** 0.5)

    best = most
    for i, j in _pairs(logits, chosen):
        if not changes(best, i, j):
            continue
        lo, hi = 0.0, best
        while hi - lo > 0.01 * hi:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if changes(mid, i, j) else (mid, hi)
        best = hi
    return best


def explain(ours: list[torch.Tensor], layers: list, fp32: "GateInputs", bf16: "GateInputs", call: int,
            positions: int, our_logits: list[torch.Tensor] | None = None) -> dict:
    """Routing flips of ours against float64 over the first ``positions`` positions of recorded call
    ``call`` (the shared sequence). A flip at (layer, position) whose input a flip at an earlier MoE layer
    and a position no later already changed (by a whole expert's output, through the residual stream or
    attention) follows from that one; the others are root flips, and each must be a near-tie.

    With ``our_logits`` (``our_routing``'s), two checks that tell a fault's place where a root flip is not a
    near-tie: ``routing_op_mismatches``, the positions where our routing op chose otherwise than the
    float64 reference routing of our own logits (a routing kernel's fault: only exact float32 ties may
    differ), and for each root flip our logits' error against float64's in sigmas (``where``'s fifth entry;
    about 1 where ours is as noisy as transformers-bf16, far above where our forward went wrong)."""
    flips = []  # (layer, position) in layer order
    exact_of, ref_of = [], []
    for li, layer in enumerate(layers):
        exact = fp32.logits(call, li)[:positions]
        ref_ids = _route(exact, layer)
        exact_of.append(exact)
        ref_of.append(ref_ids)
        flips += [(li, pos) for pos in (ours[li][:positions] != ref_ids).any(-1).nonzero().flatten().tolist()]
    roots = [(li, pos) for li, pos in flips if not any(l2 < li and p2 <= pos for l2, p2 in flips)]
    where = []
    for li, pos in roots:
        noisy = bf16.logits(call, li, torch.float32)[pos].double()
        sigma = float((noisy - exact_of[li][pos]).square().mean().sqrt())
        margin = tie_margin(exact_of[li][pos], sigma, layers[li], ref_of[li][pos])
        noise = 1.0  # the noise a near-tie is measured in, in sigmas (module docstring)
        if our_logits is not None:
            error = float((our_logits[li][pos].double() - exact_of[li][pos]).square().mean().sqrt()) / max(sigma, 1e-30)
            noise = error if 1.0 < error <= 2.0 else 1.0
        entry = (li, pos, margin <= 3 * noise, round(margin, 2))
        where.append(entry if our_logits is None else entry + (round(error, 2),))
    near = sum(w[2] for w in where)
    far = [w[3] for w in where if not w[2]]
    out = dict(routing_flips=len(flips), routing_roots=len(roots), routing_near_ties=near, routing_where=where[:8],
               routing_far_margins=far, routing_explains=bool(roots) and near == len(roots))
    if our_logits is not None:
        out["routing_far_errors"] = [w[4] for w in where if not w[2]]
        out["routing_op_mismatches"] = sum(int((_route(our_logits[li][:positions].double(), layer) != ours[li][:positions])
                                               .any(-1).sum()) for li, layer in enumerate(layers))
    return out

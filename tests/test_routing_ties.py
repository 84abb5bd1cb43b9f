"""The routing near-tie rule of the GPU models check (plugins/nvidia/scripts/routing_ties.py): a parting
is explained only by root routing flips that are near-ties under bf16 noise; a flip at a clear margin
fails it, and a flip an earlier one explains is not judged."""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "nvidia" / "scripts"))
import routing_ties  # noqa: E402

E = 4


class TwoRouters(nn.Module):
    """Two MoE layers' routers (identity weights: the router logits are the input rows)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for layer in self.layers:
            layer.mlp = nn.Module()
            layer.mlp.gate = nn.Linear(E, E, bias=False)
            nn.init.eye_(layer.mlp.gate.weight)

    def forward(self, x0, x1):
        self.layers[0].mlp.gate(x0)
        self.layers[1].mlp.gate(x1)


LAYER = SimpleNamespace(route_args=dict(top_k=1, scoring="softmax"), e_score_correction_bias=None)
CLEAR = [4.0, 1.0, 0.0, 0.0]  # expert 0 by a wide margin
TIE = [2.0, 1.999, 0.0, 0.0]  # experts 0 and 1 a hair apart


def recorded(rows0, rows1, noise):
    """GateInputs of the float32 model (the rows exactly) and of the bf16 one (the rows plus ``noise``)."""
    model, out = TwoRouters(), []
    for shift in (0.0, noise):
        gates = routing_ties.GateInputs(model)
        with gates:
            gates.call()
            model(torch.tensor(rows0) + shift, torch.tensor(rows1) + shift * torch.tensor([1.0, -1.0, 0, 0]))
        out.append(gates)
    return out


def explain(rows0, rows1, ours0, ours1, noise=0.01):
    fp32, bf16 = recorded(rows0, rows1, noise)
    ours = [torch.tensor(ours0)[:, None], torch.tensor(ours1)[:, None]]
    return routing_ties.explain(ours, [LAYER, LAYER], fp32, bf16, 0, len(rows0))


def test_no_flip_explains_nothing():
    r = explain([CLEAR, TIE], [CLEAR, CLEAR], [0, 0], [0, 0])
    assert (r["routing_flips"], r["routing_explains"]) == (0, False)


def test_a_flip_at_a_near_tie_explains_the_parting():
    r = explain([CLEAR, TIE], [CLEAR, CLEAR], [0, 1], [0, 0])
    assert (r["routing_flips"], r["routing_roots"], r["routing_near_ties"], r["routing_explains"]) == (1, 1, 1, True)


def test_a_flip_at_a_clear_margin_is_a_fault():
    r = explain([CLEAR, TIE], [CLEAR, CLEAR], [1, 0], [0, 0])
    assert (r["routing_flips"], r["routing_near_ties"], r["routing_explains"]) == (1, 0, False)


def test_the_margin_of_a_choice_is_the_least_move_that_changes_it():
    # Top-1 of [4, 1, 0, 0]: expert 1 overtakes 0 once each moves 1.5 toward the other, 1.5 sqrt(2) sigma
    # in sigmas of a difference; beyond ``most`` it is reported as ``most``.
    chosen = torch.tensor([0])
    rows = torch.tensor(CLEAR, dtype=torch.float64)
    assert abs(routing_ties.tie_margin(rows, 0.5, LAYER, chosen) - 1.5 * 2 ** 0.5 / 0.5) <= 0.05
    assert routing_ties.tie_margin(rows, 0.01, LAYER, chosen) == 20.0
    r = explain([CLEAR, TIE], [CLEAR, CLEAR], [1, 0], [0, 0])
    assert len(r["routing_far_margins"]) == 1 and r["routing_far_margins"][0] > 3


def test_our_logits_tell_a_routing_fault_from_a_forward_fault():
    # A clear-margin flip at position 0 of layer 0. Our logits as float64's: our routing op chose against
    # them (one mismatch), and they are 0 sigmas off. Our logits far off instead, and routed as they say:
    # no mismatch, and the error in sigmas tells where it went wrong.
    fp32, bf16 = recorded([CLEAR, TIE], [CLEAR, CLEAR], 0.01)
    ours = [torch.tensor([1, 0])[:, None], torch.tensor([0, 0])[:, None]]
    exact = [torch.tensor([CLEAR, TIE]), torch.tensor([CLEAR, CLEAR])]
    r = routing_ties.explain(ours, [LAYER, LAYER], fp32, bf16, 0, 2, exact)
    assert (r["routing_op_mismatches"], r["routing_far_errors"]) == (1, [0.0])
    off = [torch.tensor([[0.0, 4.0, 0.0, 0.0], TIE]), torch.tensor([CLEAR, CLEAR])]
    r = routing_ties.explain(ours, [LAYER, LAYER], fp32, bf16, 0, 2, off)
    assert r["routing_op_mismatches"] == 0 and r["routing_far_errors"][0] > 100


def test_the_noise_sets_what_is_near():
    # The same flip at the tie is no near-tie when transformers-bf16's own error there is nil.
    r = explain([CLEAR, TIE], [CLEAR, CLEAR], [0, 1], [0, 0], noise=0.0)
    assert (r["routing_near_ties"], r["routing_explains"]) == (0, False)


def test_a_flip_that_an_earlier_flip_explains_is_not_judged():
    # Layer 1 at position 1 flips at a clear margin, after layer 0 flipped at a tie at position 1: a root
    # and its consequence. At position 0 a clear-margin flip of layer 1 has no earlier flip to explain it.
    r = explain([CLEAR, TIE], [CLEAR, CLEAR], [0, 1], [0, 1])
    assert (r["routing_flips"], r["routing_roots"], r["routing_explains"]) == (2, 1, True)
    r = explain([CLEAR, TIE], [CLEAR, CLEAR], [0, 1], [1, 1])
    assert (r["routing_flips"], r["routing_roots"], r["routing_explains"]) == (3, 2, False)


def test_our_routing_is_each_sequence_teacher_forced_alone_or_batched(tmp_path):
    """``our_routing``: per sequence and MoE layer, the experts at every position of the tokens given (one
    prefill, nothing sampled into them); a sequence's routing in a batch of three is its routing alone,
    and is what float64 chooses from transformers' own router inputs (fp32 ours, wide weights: no near-ties)."""
    from test_moe_models import build_moe, load

    hf = build_moe(tmp_path, "mixtral")
    llm = load(tmp_path)
    sequences = [[5, 9, 300, 2, 11], list(range(40, 57)), [7] * 9]
    batched, layers, logits = routing_ties.our_routing(llm, sequences)
    assert len(layers) == 3 and all(layer.route_args["top_k"] == 2 for layer in layers)
    gates = routing_ties.GateInputs(hf)
    with gates, torch.no_grad():
        for i, seq in enumerate(sequences):
            alone, _, _ = routing_ties.our_routing(llm, [seq])
            assert [r.shape for r in batched[i]] == [(len(seq), 2)] * 3
            assert [x.shape for x in logits[i]] == [(len(seq), 4)] * 3
            assert all(torch.equal(a, b) for a, b in zip(alone[0], batched[i]))
            gates.call()
            hf(torch.tensor([seq]))
            r = routing_ties.explain(batched[i], layers, gates, gates, i, len(seq), logits[i])
            assert r["routing_flips"] == 0 and r["routing_op_mismatches"] == 0, (i, r)
            torch.testing.assert_close(logits[i][0].double(), gates.logits(i, 0)[:len(seq)], rtol=1e-4, atol=1e-4)


def test_recorded_logits_keep_the_weights_the_model_ran_with():
    # models_check records its float32 model, then casts it to bfloat16 for transformers' own bf16 run: the
    # float32 recording's logits must still use the float32 weights, and a recording made after the cast
    # the bf16 ones (a third, not a power of two, is rounded by the cast).
    model = TwoRouters()
    for layer in model.layers:
        layer.mlp.gate.weight.data.fill_(1 / 3)
    rows = torch.ones(1, E)
    fp32, bf16 = routing_ties.GateInputs(model), routing_ties.GateInputs(model)
    with fp32, torch.no_grad():
        fp32.call()
        model(rows, rows)
    model.to(torch.bfloat16)
    with bf16, torch.no_grad():
        bf16.call()
        model(rows.bfloat16(), rows.bfloat16())
    third = torch.tensor(1 / 3, dtype=torch.float32).double()
    assert torch.equal(fp32.logits(0, 1), torch.full((1, E), float(third) * E, dtype=torch.float64))
    rounded = torch.tensor(1 / 3, dtype=torch.bfloat16).double()
    assert torch.equal(bf16.logits(0, 1), torch.full((1, E), float(rounded) * E, dtype=torch.float64))
    assert rounded != third


def test_a_flip_is_a_near_tie_in_the_larger_noise_up_to_twice_transformers():
    # Top-1 of [4, 1, 0, 0] at transformers-bf16 noise 0.5: a margin of 4.24 sigmas, no near-tie in its
    # noise. Ours 1.5 times as noisy there (RMS 0.75): within 3 of ours. Ours 3 times as noisy: our
    # forward's fault there, and the margin is judged in transformers' noise again.
    fp32, bf16 = recorded([CLEAR, TIE], [CLEAR, CLEAR], 0.5)
    ours = [torch.tensor([1, 0])[:, None], torch.tensor([0, 0])[:, None]]
    rows = [torch.tensor([CLEAR, TIE]), torch.tensor([CLEAR, CLEAR])]
    verdicts = []
    for error in (0.0, 0.75, 1.5):
        logits = [rows[0] + torch.tensor([[error, -error, error, -error], [0.0] * E]), rows[1]]
        r = routing_ties.explain(ours, [LAYER, LAYER], fp32, bf16, 0, 2, logits)
        assert abs(r["routing_where"][0][3] - 4.24) <= 0.05 and abs(r["routing_where"][0][4] - error / 0.5) <= 1e-6
        verdicts.append(r["routing_explains"])
    assert verdicts == [False, True, False]


def test_the_nmse_verdict_leaves_out_last_tokens_routed_otherwise():
    # Three prompts of two tokens; float64 routes every last token to expert 0. Ours routes prompt 1's
    # last token (a near-tie) to expert 1, transformers-bf16 prompt 2's (its noise pushed the TIE row
    # over): both leave the verdict, which compares prompt 0 alone; ours counted and explained. Without
    # routing (a dense model) every prompt counts, and ours' switched last token sets the mean.
    import models_check

    rows = [[CLEAR, CLEAR], [CLEAR, TIE], [CLEAR, TIE]]
    model = TwoRouters()
    fp32, bf16 = routing_ties.GateInputs(model), routing_ties.GateInputs(model)
    with fp32, torch.no_grad():
        for r in rows:
            fp32.call()
            model(torch.tensor(r), torch.tensor([CLEAR, CLEAR]))
    with bf16, torch.no_grad():
        for i, r in enumerate(rows):
            bf16.call()
            shift = torch.tensor([[0.0] * E, [-0.01, 0.01, 0, 0] if i == 2 else [0.004, -0.004, 0, 0]])
            model(torch.tensor(r) + shift, torch.tensor([CLEAR, CLEAR]))
    zero, one = torch.tensor([[0], [0]]), torch.tensor([[0], [1]])
    routing = [[zero, zero], [one, zero], [zero, zero]]
    logits = [[torch.tensor(r), torch.tensor([CLEAR, CLEAR])] for r in rows]
    got = models_check.judged_nmse([[1, 2]] * 3, [1.0, 50.0, 1.0], [2.0, 1.0, 3.0], (routing, [LAYER, LAYER], logits),
                                   fp32, bf16)
    assert got["nmse_left_out"] == {"ours": [1], "hf_bf16": [2]} and got["nmse_left_out_explained"] == 1
    assert got["nmse_judged"] == dict(prompts=1, ours=1.0, hf_bf16=2.0, ours_median=1.0, hf_bf16_median=2.0)
    assert got["nmse_ok"]
    dense = models_check.judged_nmse([[1, 2]] * 3, [1.0, 50.0, 1.0], [2.0, 1.0, 3.0], None, fp32, bf16)
    assert dense["nmse_judged"]["prompts"] == 3 and dense["nmse_left_out"] == {"ours": [], "hf_bf16": []}
    assert not dense["nmse_ok"]
    # Ours switching prompt 2's last token where float64's choice is clear (its row made CLEAR) is no near-tie:
    # the verdict fails whatever the figures.
    logits[2][0], fp32.inputs[2][0] = torch.tensor([CLEAR, CLEAR]), [torch.tensor([CLEAR, CLEAR])]
    bf16.inputs[2][0] = [torch.tensor([CLEAR, CLEAR]) + torch.tensor([0.004, -0.004, 0, 0])]
    routing[2] = [one, zero]
    got = models_check.judged_nmse([[1, 2]] * 3, [1.0, 50.0, 1.0], [2.0, 1.0, 3.0], (routing, [LAYER, LAYER], logits),
                                   fp32, bf16)
    assert got["nmse_left_out"] == {"ours": [1, 2], "hf_bf16": []} and got["nmse_left_out_explained"] == 1
    assert got["nmse_judged"]["prompts"] == 1 and not got["nmse_ok"]

"""A model end to end: a tiny random Llama on the backend against the same model on the reference.

The model class comes from the installed model plugin (``LlamaForCausalLM``); it is built twice from
one random initialisation: on the backend (its resolved ops, its first attention backend, the case
dtype) and on the CPU in float64 with the reference ops and attention. Three prompts of different
lengths prefill in one step over shuffled blocks, then ``DECODE_STEPS`` decode steps follow,
teacher-forced with the reference's greedy tokens. Two rows judge it: the logits of every step
(nmse) and the backend's greedy tokens (its own ``greedy_sample``) against the reference logits.
"""

from functools import partial

import torch

from chitu_core.attention.reference import ReferenceAttention
from chitu_core.conformance.attention_cases import allocate_blocks, metadata
from chitu_core.conformance.case import Case, Outcome, Target, raised
from chitu_core.conformance.compare import Verdict, compare, compare_argmax
from chitu_core.distributed.communicator import Communicator
from chitu_core.errors import ChituError
from chitu_core.layers.context import BuildContext, StepContext
from chitu_core.ops.table import resolve_ops

ARCH = "LlamaForCausalLM"
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
PROMPTS = (5, 17, 30)
DECODE_STEPS = 6


def _build(model_cls, hf_config, ops, attention_cls, block_size, dtype, device):
    attn = attention_cls(CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"],
                         CONFIG["hidden_size"] // CONFIG["num_attention_heads"], block_size, dtype, device)
    ctx = BuildContext(ops, attn, Communicator.single(), dtype, device)
    return model_cls(hf_config, ctx).eval(), attn


class _Stepper:
    """Runs steps of one model through its own KV caches, as the engine's model runner would."""

    def __init__(self, model, attn, tables: torch.Tensor, device: torch.device):
        self.model, self.attn, self.tables, self.device = model, attn, tables, device
        self.caches = [attn.allocate_kv_cache(int(tables.max()) + 1) for _ in range(CONFIG["num_hidden_layers"])]

    def step(self, ids: list[torch.Tensor], contexts: list[int]) -> torch.Tensor:
        """Logits [B, V] of each sequence's last new token; ids: each sequence's new tokens."""
        news = [len(i) for i in ids]
        meta = metadata(self.tables, contexts, news, self.attn.block_size)
        for f in ("slot_mapping", "block_tables", "seq_lens", "context_lens", "query_start_loc"):
            setattr(meta, f, getattr(meta, f).to(self.device))
        meta.backend_state = self.attn.prepare(meta)
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, news)]).to(self.device)
        with torch.inference_mode():
            hidden = self.model(torch.cat(ids).to(self.device), positions, StepContext(meta, self.caches))
            last = (torch.tensor(news).cumsum(0) - 1).to(self.device)
            return self.model.compute_logits(hidden[last])


class ModelRun:
    """Runs the reference and the backend once per dtype; both rows read the result."""

    def __init__(self, model_cls):
        self.model_cls = model_cls
        self.results: dict[torch.dtype, tuple] = {}

    def get(self, target: Target, case: Case):
        if case.dtype not in self.results:
            self.results[case.dtype] = self._run(target, case)
        return self.results[case.dtype]

    def _run(self, target: Target, case: Case):
        from transformers import LlamaConfig

        gen = torch.Generator().manual_seed(1234)
        hf_config = LlamaConfig(**CONFIG)
        cpu = torch.device("cpu")
        reference, ref_attn = _build(self.model_cls, hf_config, resolve_ops("reference", {}), ReferenceAttention,
                                     16, torch.float64, cpu)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5, generator=gen)
                else:
                    p.normal_(0.0, 0.08, generator=gen)
        attention_cls = next(iter(target.backend.attention_backends().values()), ReferenceAttention)
        try:
            model, attn = _build(self.model_cls, hf_config, target.ops, attention_cls, attention_cls.block_sizes[0],
                                 case.dtype, target.device)
            with torch.no_grad():
                for (_, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
                    p.copy_(ref)
        except Exception as exc:  # the backend's own failure is the case's result
            return None, None, raised(exc, f"building {ARCH}").verdict.detail
        prompts = [torch.randint(0, CONFIG["vocab_size"], (n,), generator=gen) for n in PROMPTS]
        lens = [n + DECODE_STEPS for n in PROMPTS]
        ref_run = _Stepper(reference, ref_attn, allocate_blocks(gen, lens, 16)[0], cpu)
        # The reference decides the tokens fed back (teacher forcing).
        steps, want = [(prompts, [0] * len(PROMPTS))], []
        for s in range(DECODE_STEPS + 1):
            want.append(ref_run.step(*steps[-1]))
            steps.append(([t.view(1) for t in want[-1].argmax(-1)], [n + s for n in PROMPTS]))
        try:
            run = _Stepper(model, attn, allocate_blocks(gen, lens, attn.block_size)[0], target.device)
            got = [run.step(ids, contexts) for ids, contexts in steps[:-1]]
            greedy = [target.ops.greedy_sample(g) for g in got]
        except Exception as exc:  # the backend's own failure is the case's result
            return None, None, raised(exc, f"{ARCH} forward").verdict.detail
        return (torch.cat(want), torch.cat([g.cpu() for g in got]), torch.cat([g.cpu() for g in greedy])), \
            _source(target), ""


def _source(target: Target) -> str:
    if not target.backend.attention_backends() and not any(s.kind != "fallback" for s in target.ops.sources.values()):
        return "fallback"
    return "native"


def run_model_case(run: ModelRun, what: str, case: Case, target: Target) -> Outcome:
    result, source, problem = run.get(target, case)
    if problem:
        return Outcome(Verdict.fail(problem))
    want, got, greedy = result
    if what == "logits":
        return Outcome(compare(got.float(), want, target.threshold(case), "logits"), source)
    return Outcome(compare_argmax(greedy, want, target.threshold(case), "greedy tokens"), source)


def model_cases(dtypes: tuple[torch.dtype, ...]) -> list[Case]:
    from chitu_core.plugins.discovery import load_model_class

    try:
        model_cls, skip = load_model_class(ARCH), ""
    except ChituError as exc:
        model_cls, skip = None, f"no model plugin provides {ARCH} ({exc})"
    run = ModelRun(model_cls)
    cases = []
    head_dim = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    for dtype in dtypes:
        for what in ("logits", "greedy"):
            params = {"architecture": ARCH, "num_heads": CONFIG["num_attention_heads"],
                      "num_kv_heads": CONFIG["num_key_value_heads"], "head_dim": head_dim}
            label = f"2 layers, H={CONFIG['hidden_size']}, prompts {PROMPTS}, {DECODE_STEPS} decode steps"
            cases.append(Case(f"model/{ARCH}/{what}", "model", f"model_{what}", dtype, params, label,
                              partial(run_model_case, run, what), skip=skip))
    return cases

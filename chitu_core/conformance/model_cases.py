"""Models end to end: every installed architecture on a small random config of its own family.

Which architectures: each one registered under ``chitu_core.models`` whose class declares the
classmethod ``conformance_config()``, returning an HF config dict with its ``model_type``
(docs/writing-a-model.md); an architecture whose class does not declare one is listed as skipped,
with the reason.

Each model is built twice from one set of random weights: on the CPU in float64 with the reference
ops and attention, and on the backend (its resolved ops, its attention for the model's geometry,
the case dtype). Where transformers knows the ``model_type`` the weights are a transformers model's
own, loaded through the model's ``load_weights`` as a checkpoint would be; otherwise the reference's
parameters are drawn directly. Weights are drawn far from ties: for a mixture-of-experts model, also
from ties of its routing (a draw where a relative nudge of ``ROUTING_NUDGE`` to some token's router
logits changes the experts the float64 reference picks is drawn again, from the next seed: an expert
switched by rounding moves the logits by more than any dtype's threshold, a flaw of the draw, not of
the backend). Three prompts of different lengths prefill in one step over shuffled
blocks, then ``DECODE_STEPS`` decode steps follow, teacher-forced with the reference's greedy tokens.
Three rows judge it: the backend's logits of every step (nmse) and its greedy tokens (its own
``greedy_sample``) against the reference's, and, once (float32 column), the reference's logits against
transformers' in float64: that row judges the model plugin, the same on every backend.
"""

from collections.abc import Callable
from functools import partial

import torch

from chitu_core.conformance.attention_cases import allocate_blocks, metadata
from chitu_core.conformance.case import Case, Outcome, Target, raised
from chitu_core.conformance.compare import Verdict, compare, compare_argmax
from chitu_core.distributed.communicator import Communicator
from chitu_core.errors import ChituError
from chitu_core.layers.context import BuildContext, StepContext
from chitu_core.ops import reference
from chitu_core.ops.table import resolve_ops

ROWS = ("logits", "greedy", "transformers")
PROMPTS = (5, 17, 30)
DECODE_STEPS = 6
REFERENCE_BLOCK = 16
ROUTING_NUDGE = 0.012
"""Relative size (of a token's router-logit spread) of the nudges a draw's routing must withstand."""
MAX_DRAWS = 60


def hf_config(config: dict):
    """(HF config object, whether transformers knows its model_type) of a ``conformance_config()`` dict."""
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

    values = dict(config)
    model_type = values.pop("model_type", None)
    if model_type in CONFIG_MAPPING:
        return AutoConfig.for_model(model_type, **values), True
    return PretrainedConfig(**values), False  # a family transformers lacks: a plain config with its attributes


def _checkpoint_weights(hf) -> dict:
    """A transformers model's weights named and laid out as its ``save_pretrained`` writes them: since
    transformers 5 a model may hold some fused in memory (an MoE layer's experts as one tensor) that a
    checkpoint keeps apart."""
    state = hf.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # before transformers 5 the state dict is the checkpoint's layout
        return state
    return revert_weight_conversion(hf, state)


class _NoAttention:
    """A backend without attention classes: ``build_attention`` then gives the core's reference."""

    @staticmethod
    def attention_backends() -> dict:
        return {}

    @staticmethod
    def mla_attention_backends() -> dict:
        return {}


def _build(model_cls, config, backend, ops, dtype, device, block_size=None):
    from chitu_core.attention.build import build_attention

    geometry = model_cls.kv_geometry(config, 1)
    attn = build_attention(backend, geometry, block_size, dtype, device)
    model = model_cls(config, BuildContext(ops, attn, Communicator.single(), dtype, device)).eval()
    return model, attn, geometry.num_layers


def _widen(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights far from ties: norms around 1, the rest N(0, 0.08)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=gen)
            else:
                p.normal_(0.0, 0.08, generator=gen)


class _Stepper:
    """Runs steps of one model through its own KV caches, as the engine's model runner would."""

    def __init__(self, model, attn, num_layers: int, tables: torch.Tensor, device: torch.device):
        self.model, self.attn, self.tables, self.device = model, attn, tables, device
        self.caches = [attn.allocate_kv_cache(int(tables.max()) + 1) for _ in range(num_layers)]

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
    """One architecture: the reference (and transformers) once, the backend once per dtype; the rows read them."""

    def __init__(self, arch: str, model_cls, config: dict):
        self.arch, self.model_cls, self.config = arch, model_cls, config
        self.results: dict[torch.dtype, tuple] = {}
        self.reference_run: tuple | None = None

    def reference(self):
        """(reference model, the steps' tokens, its logits of every step, transformers' logits or None)."""
        if self.reference_run is None:
            self.reference_run = self._reference()
        return self.reference_run

    def _reference(self):
        for draw in range(MAX_DRAWS):  # the first draw, unless its routing sits on a tie
            routes: list[tuple] = []
            model, steps, want, hf, prompts = self._draw(1234 + draw, routes)
            if not _routing_near_tie(routes):
                break
        theirs = None
        if hf is not None:  # transformers on the kept draw's tokens
            fed = torch.stack([w.argmax(-1) for w in want[:-1]], dim=1)  # [B, DECODE_STEPS]
            with torch.no_grad():
                full = [hf(torch.cat([p, f])[None]).logits[0, len(p) - 1:] for p, f in zip(prompts, fed)]
            theirs = torch.cat([torch.stack([f[s] for f in full]) for s in range(DECODE_STEPS + 1)])
        return model, steps, torch.cat(want), theirs

    def _draw(self, seed: int, routes: list[tuple]):
        """One draw's reference run: (model, steps, each step's logits, transformers' model or None,
        prompts); ``routes`` gets every routing call's inputs."""
        gen = torch.Generator().manual_seed(seed)
        config, known = hf_config(self.config)
        cpu = torch.device("cpu")

        def moe_route(router_logits, *args, **kwargs):  # the reference's, its inputs kept for _routing_near_tie
            routes.append((router_logits.clone(), args, kwargs))
            return reference.moe_route(router_logits, *args, **kwargs)

        model, attn, layers = _build(self.model_cls, config, _NoAttention, resolve_ops("reference", {"moe_route": moe_route}),
                                     torch.float64, cpu, REFERENCE_BLOCK)
        hf = None
        if known:  # transformers' own weights, loaded by name as a checkpoint is
            from transformers import AutoModelForCausalLM

            config._attn_implementation = "eager"
            config._experts_implementation = "eager"  # a loop over experts: the grouped GEMM takes no float64
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
            _widen(hf, gen)
            model.load_weights(_checkpoint_weights(hf).items())
        else:
            _widen(model, gen)
            model.process_weights_after_loading()
        vocab = config.vocab_size
        prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in PROMPTS]
        lens = [n + DECODE_STEPS for n in PROMPTS]
        run = _Stepper(model, attn, layers, allocate_blocks(gen, lens, REFERENCE_BLOCK)[0], cpu)
        # The reference decides the tokens fed back (teacher forcing).
        steps, want = [(prompts, [0] * len(PROMPTS))], []
        for s in range(DECODE_STEPS + 1):
            want.append(run.step(*steps[-1]))
            steps.append(([t.view(1) for t in want[-1].argmax(-1)], [n + s for n in PROMPTS]))
        return model, steps[:-1], want, hf, prompts

    def get(self, target: Target, case: Case):
        if case.dtype not in self.results:
            self.results[case.dtype] = self._run(target, case)
        return self.results[case.dtype]

    def _run(self, target: Target, case: Case):
        try:
            reference, steps, want, _ = self.reference()
        except Exception as exc:  # the model plugin's failure, not the backend's
            return None, None, raised(exc, f"{self.arch} on the reference ops (a model plugin problem)").verdict.detail
        config, _ = hf_config(self.config)
        try:
            model, attn, layers = _build(self.model_cls, config, target.backend, target.ops, case.dtype, target.device)
            with torch.no_grad():
                for (_, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
                    p.copy_(ref)
            model.process_weights_after_loading()
        except Exception as exc:  # the backend's own failure is the case's result
            return None, None, raised(exc, f"building {self.arch}").verdict.detail
        lens, gen = [n + DECODE_STEPS for n in PROMPTS], torch.Generator().manual_seed(4321)  # the same tables every run
        try:
            run = _Stepper(model, attn, layers, allocate_blocks(gen, lens, attn.block_size)[0], target.device)
            got = [run.step(ids, contexts) for ids, contexts in steps]
            greedy = [target.ops.greedy_sample(g) for g in got]
        except Exception as exc:  # the backend's own failure is the case's result
            return None, None, raised(exc, f"{self.arch} forward").verdict.detail
        return (want, torch.cat([g.cpu() for g in got]), torch.cat([g.cpu() for g in greedy])), _source(target), ""


def _routing_near_tie(routes: list[tuple]) -> bool:
    """Whether nudging some token's router logits by ROUTING_NUDGE of their spread (eight fixed random
    nudges) changes the set of experts the reference routes it to."""
    gen = torch.Generator().manual_seed(99)
    for logits, args, kwargs in routes:
        chosen = reference.moe_route(logits, *args, **kwargs)[1].sort(-1).values
        spread = logits.std(-1, keepdim=True)
        for _ in range(8):
            nudged = logits + ROUTING_NUDGE * spread * torch.randn(logits.shape, generator=gen, dtype=logits.dtype)
            if not torch.equal(reference.moe_route(nudged, *args, **kwargs)[1].sort(-1).values, chosen):
                return True
    return False


def _source(target: Target) -> str:
    if not target.backend.attention_backends() and not any(s.kind != "fallback" for s in target.ops.sources.values()):
        return "fallback"
    return "native"


def run_model_case(run: ModelRun, what: str, case: Case, target: Target) -> Outcome:
    if what == "transformers":
        try:
            _, _, ours, theirs = run.reference()
        except Exception as exc:  # the model plugin's failure, on the reference
            return raised(exc, f"{run.arch} on the reference ops (a model plugin problem)")
        return Outcome(compare(ours, theirs, target.threshold(case), "logits of the reference model"), "fallback")
    result, source, problem = run.get(target, case)
    if problem:
        return Outcome(Verdict.fail(problem))
    want, got, greedy = result
    if what == "logits":
        return Outcome(compare(got.float(), want, target.threshold(case), "logits"), source)
    return Outcome(compare_argmax(greedy, want, target.threshold(case), "greedy tokens"), source)


def _plan(arch: str) -> tuple[object, dict | None, str]:
    """(model class, conformance config, why skipped) of one installed architecture."""
    from chitu_core.plugins.discovery import load_model_class

    try:
        model_cls = load_model_class(arch)
    except ChituError as exc:
        return None, None, f"the plugin providing {arch} did not load ({exc})"
    # Declared on the class itself: an inherited one is the parent's family (Mistral's would be Llama's).
    declared = "conformance_config" in vars(model_cls)
    if not declared:
        return model_cls, None, (f"{model_cls.__module__}.{model_cls.__name__} declares no conformance_config(); "
                                 "add it to run this architecture (docs/writing-a-model.md)")
    return model_cls, model_cls.conformance_config(), ""


def model_cases(dtypes: tuple[torch.dtype, ...], chosen: Callable[[str, str], bool] = lambda row, op: True) -> list[Case]:
    """The cases of every installed architecture that has some row ``chosen(row, "model")`` accepts."""
    from chitu_core.plugins.discovery import MODELS_GROUP, entries

    installed = [e.name for e in entries(MODELS_GROUP)]
    archs = [a for a in installed if any(chosen(row, "model") for row in (f"model/{a}", *(f"model/{a}/{w}" for w in ROWS)))]
    if not installed:
        return _cases("LlamaForCausalLM", None, None, "no model plugin is installed (pip install chitu-models)", dtypes)
    return [case for arch in archs for case in _cases(arch, *_plan(arch), dtypes)]


def _cases(arch: str, model_cls, config: dict | None, skip: str, dtypes) -> list[Case]:
    params, label, known = {"architecture": arch}, "skipped", False
    if not skip:
        try:
            hf, known = hf_config(config)
            geometry = model_cls.kv_geometry(hf, 1)
        except Exception as exc:  # a config the class cannot read: the plugin's problem, reported
            hf, known, skip = None, False, f"{arch}'s conformance_config() does not build: {type(exc).__name__}: {exc}"
        else:
            params.update(num_heads=geometry.num_heads, num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim)
            label = (f"{geometry.num_layers} layers, H={hf.hidden_size}, prompts {PROMPTS}, "
                     f"{DECODE_STEPS} decode steps")
    if skip:  # one row says why
        return [Case(f"model/{arch}", "model", "model_logits", dtype, dict(params), label, skip=skip) for dtype in dtypes]
    run, cases = ModelRun(arch, model_cls, config), []
    for dtype in dtypes:
        rows = ("logits", "greedy") + (("transformers",) if dtype == torch.float32 and known else ())
        for what in rows:
            cases.append(Case(f"model/{arch}/{what}", "model", f"model_{what}", dtype, dict(params), label,
                              partial(run_model_case, run, what)))
    return cases

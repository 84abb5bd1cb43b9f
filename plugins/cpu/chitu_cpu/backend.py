"""The CPU backend: always available, float32 and bfloat16, gloo collectives, no graphs."""

import itertools
import os
import platform

import torch

from chitu_core.backend import Availability, Backend, MemoryInfo, host_memory_info
from chitu_core.ops.table import checks_asked
from chitu_cpu import ops
from chitu_cpu.packed import pack_linear
from chitu_cpu.attention import CpuSdpaAttention
from chitu_cpu.mla import CpuSdpaMLAAttention

_compiled = itertools.count()  # names for the compiled forwards' code objects


def compile_options() -> dict:
    """Inductor's options for ``CpuBackend.compile_forward`` (see there)."""
    checked = checks_asked()
    return {"assert_indirect_indexing": False, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            "size_asserts": checked, "scalar_asserts": checked, "alignment_asserts": checked}


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    # 1.9: the decode-step fusions (ops.rms_norm_linear, ops.linear_add); 1.10: ops.mla_inputs;
    # 1.11: ops.linear_float32; 1.12: AttentionBackend.fuses_qk_norm (1.13 adds nothing a CPU serves);
    # 1.14: AttentionBackend.commits_on_write; 1.15: AttentionBackend.supports_16bit_kv_cache, step_token_budget
    contract_version = "1.15"
    priority = 0  # any accelerator backend should win under device="auto"

    def is_available(self) -> Availability:
        return Availability(True)

    def device_count(self) -> int:
        return 1

    def memory_info(self, index: int = 0) -> MemoryInfo:
        return host_memory_info()

    def device_name(self, index: int = 0) -> str:
        try:
            with open("/proc/cpuinfo") as f:
                model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
        except OSError:
            model = ""
        return f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} threads"

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)

    def native_ops(self):
        return ops.NATIVE_OPS

    def attention_backends(self):
        return {CpuSdpaAttention.name: CpuSdpaAttention}

    def mla_attention_backends(self):
        return {CpuSdpaMLAAttention.name: CpuSdpaMLAAttention}

    def process_group_backend(self) -> str:
        return "gloo"

    def quant_methods(self) -> frozenset[str]:
        """GGUF (but Q6_K), AWQ and GPTQ layers are repacked at load into PyTorch's int4pack layout
        (``pack_linear``); the rest run on the core's reference ops (a dequantization per call: correct,
        not fast)."""
        return frozenset({"unquantized", "fp8", "int8", "awq", "gptq", "gguf"})

    def pack_linear(self, method, layer, dtype):
        return pack_linear(method, layer, dtype)

    def compile_forward(self, forward):
        """torch.compile (inductor), shapes dynamic from the start: one graph for prefill, one for decode.
        A prefill's attention stays one opaque operator a layer (chitu_cpu::paged_sdpa); a decode step's is
        part of the graph (``attention.decode_attention``: the cache read where it lies, not gathered
        first); the norms, rotary and activations around it fuse. Two checks a step would repeat for
        nothing are left out: indirect indexes inside the graph (every index it takes is the engine's:
        token ids are checked on admission, positions, slots and block tables are the scheduler's own),
        and Dynamo's guards on the model's modules (their weights and attributes, fixed once loaded and
        packed: about 10,000 guards, 1.5 ms of a 9 ms SmolLM2 batch-1 step, 0.33 ms left). Dynamo keeps
        its graphs on the code object it compiles, which without those guards must be this engine's alone
        (another model of the same class in the process could otherwise run this one's graphs): the forward
        is called from a function whose code object is made here. SmolLM2 Q4_1 on the 2-core CPU page
        (docs/benchmarks/cpu-smollm2.md), eager -> compiled: 10.9 -> 8.0 ms a batch-1 decode step, 42.1 ->
        30.6 ms at batch 16, for ~35 s of compiling.

        The generated step's own checks of its operators' output sizes, strides, alignment and scalar
        bounds run in Python around every operator (about 400 a SmolLM2 step); they are kept only under
        ``CHITU_CHECK_OPS=1``, the switch that checks every op's outputs (``ops.table.checks_asked``)."""
        def run(*args, **kwargs):
            return forward(*args, **kwargs)

        run.__code__ = run.__code__.replace(co_name=f"compiled_forward_{next(_compiled)}")
        return torch.compile(run, dynamic=True, options=compile_options())

    def tolerances(self):
        # The packed 4-bit kernel multiplies in bfloat16 (chitu_cpu.packed): float32 rows take bfloat16's threshold.
        return {("quant_matmul", torch.float32): {"limit": 1e-4, "rtol": 3e-2}}

    def kv_cache_budget(self, index: int = 0) -> int:
        # Host memory is shared with everything else (and zero-filling it costs seconds per GiB):
        # an eighth of what is available, at most 1 GiB, unless the user sets kv_cache_memory.
        return min(self.memory_info(index).free_bytes // 8, 1 << 30)

    def step_token_budget(self) -> int | None:
        # A step's activations and the heap they leave are host memory: a burst of 16 chat prompts prefilled
        # at once raised the embedded default server's peak from 525 to 633 MiB (8,192 tokens a step).
        return 512

    def set_num_threads(self, threads: int | None) -> None:
        torch.set_num_threads(threads or os.cpu_count() or 1)

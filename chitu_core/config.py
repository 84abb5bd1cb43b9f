"""Configuration: one pydantic-settings model for the engine, shared by ``LLM`` and the server.

Every field can be given as a keyword (``LLM(model=..., max_num_seqs=8)``), a
``CHITU_<FIELD>`` environment variable, or, for the server, a ``--kebab-case``
flag or a config file (``python -m chitu_core.serve --help`` lists them all).
"""

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

SETTINGS = SettingsConfigDict(env_prefix="CHITU_", extra="forbid", cli_kebab_case=True, cli_implicit_flags=True)


class EngineConfig(BaseSettings):
    """How to load and run a model. Every field has a default that works on a laptop."""

    model_config = SETTINGS

    model: str | None = Field(
        None, description="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    device: str = Field("auto", description="backend name, or 'auto' for the highest-priority available one")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto': the checkpoint's dtype if the backend supports it, else the backend's default")
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="auto: read the checkpoint's weights; dummy: random weights made in place on the device "
        "from config.json alone (for benchmarks)")
    quantization: Literal["fp8", "int8", "int4"] | None = Field(
        None, description="quantize a 16-bit checkpoint while loading it: fp8 (128x128 blocks), int8 (W8A8, per "
        "channel) or int4 (W4A16, groups of 128); quantized checkpoints need no flag")
    max_model_len: int | None = Field(None, ge=1, description="longest prompt + output (default: the model's)")
    max_num_seqs: int = Field(256, ge=1, description="most sequences in one step")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="most new tokens in one step (default: the backend's step_token_budget(), else 8192)")
    kv_cache_memory: int | None = Field(None, ge=1, description="bytes for the KV cache (default: the backend's budget)")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="share of the device's memory the engine may use in all (weights, activations, "
        "KV cache); the KV cache gets what a profiled largest step leaves (default: the backend's budget)")
    enforce_eager: bool = Field(False, description="run decode steps eagerly where the backend could replay graphs")
    compile_forward: bool = Field(
        False, description="run the model's forward through the backend's compiler (Backend.compile_forward; CPU: "
        "torch.compile), compiled while the engine starts: faster steps for a longer start")
    pack_linear: bool = Field(
        True, description="offer loaded linear layers to the backend's own weight layout (Backend.pack_linear, "
        "contract 1.7); off: the quantization method's own tensors and ops (a quantized file's exact dequantized "
        "weights where the method dequantizes), e.g. to compare against a packed run")
    async_scheduling: bool = Field(
        True, description="launch each decode step before the host has processed the previous step's tokens, so that "
        "the host's work overlaps the device's (a sequence that stops wastes one row of the step after; "
        "profile_steps turns it off)")
    max_graph_batch_size: int = Field(256, ge=1, description="largest decode batch captured as a graph")
    max_prefill_graph_tokens: int = Field(
        4096, ge=0, description="largest step of prompts (new tokens, with or without decodes beside them) captured as "
        "a graph, in buckets of 16 to this (at most max_num_batched_tokens), where the backend captures graphs and its "
        "attention allows it (captures_prefill); larger steps run eagerly; 0: every such step runs eagerly")
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of prompt prefixes seen before")
    block_size: int | None = Field(None, ge=1, description="tokens per KV block (default: the attention backend's)")
    kv_cache_dtype: Literal["auto", "model", "fp8", "float16", "bfloat16"] = Field(
        "auto", description="KV cache elements: 'fp8' float8_e4m3fn with a per-layer scale for keys and one for "
        "values (the checkpoint's, else 1.0), half the bytes a block (twice the blocks in the same memory), where the "
        "attention backend supports it; 'float16' or 'bfloat16' a float32 model's cache in 16 bits (half its bytes), "
        "where the attention backend supports it; 'model' the model dtype; 'auto' fp8 where the checkpoint declares an "
        "FP8 KV cache (kv_cache_scheme, kv_cache_quant_algo), float16 for a float32 model from a GGUF file where the "
        "attention backend keeps one (as llama.cpp keeps its cache), else the model dtype")
    seed: int = Field(0, description="seeds the per-request seeds of requests that set none")
    num_threads: int | None = Field(None, ge=1, description="host threads, for backends that use them "
                                    "(default: the backend's choice)")
    load_progress: bool = Field(True, description="show a progress bar while loading weights")
    profile_steps: bool = Field(False, description="time every step and its forward (adds a device sync per step)")
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="ranks a pipeline stage's layers are split over (default: the launch's WORLD_SIZE over "
        "pipeline_parallel_size); launch with torchrun, one process per device")
    pipeline_parallel_size: int = Field(1, ge=1, description="pipeline stages the layers are split into, in order")
    enable_expert_parallel: bool = Field(
        False, description="MoE: give each tensor-parallel rank whole routed experts (a 1/tp share of them) instead of "
        "a 1/tp slice of every expert")
    cpu_experts: str | None = Field(
        None, description="MoE: keep the routed experts of these layers in host memory and run them on the CPU backend "
        "('all', or layer indices and ranges: '0-11,20'), for models whose experts do not fit on the device; "
        "decode then runs without graphs")

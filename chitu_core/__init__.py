"""Chitu-core: a hardware-neutral LLM inference core.

The core holds the contracts that device backends and model architectures
implement (``backend``, ``ops``, ``attention``, ``distributed``,
``quantization``), their discovery through entry points (``plugins``), the
shared model layers (``layers``), the loader and the engine. It names no
device vendor: everything device-specific comes from a backend plugin.

    from chitu_core import LLM, SamplingParams
"""

from chitu_core.version import CONTRACT_VERSION, __version__

__all__ = ["LLM", "SamplingParams", "CONTRACT_VERSION", "__version__"]


def __getattr__(name: str):
    # Lazy so that `python -m chitu_core.plugins` stays light.
    if name == "LLM":
        from chitu_core.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from chitu_core.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'chitu_core' has no attribute {name!r}")

"""Quantization methods: how a linear layer's weights are created, transformed at load, and multiplied.

A method is registered by name (``register_quant_method``, or a plugin's
``chitu_quant_methods`` hook); a backend declares the names it runs
(``Backend.quant_methods``). Built in: "unquantized", "fp8", "int8", "awq", "gptq" and "gguf"
(see docs/quantization.md).
"""

from chitu_core.quantization.base import QuantMethod, UnquantizedMethod
from chitu_core.quantization.registry import get_quant_method, quant_method_names, register_quant_method

__all__ = ["QuantMethod", "UnquantizedMethod", "get_quant_method", "quant_method_names", "register_quant_method"]

from chitu_core.quantization import awq, fp8, gguf, gptq, int8  # noqa: E402,F401  registers the built-in methods

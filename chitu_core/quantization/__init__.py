"""Quantization methods: how a linear layer's weights are created, transformed at load, and multiplied.

A method is registered by name (``register_quant_method``, or a plugin's
``chitu_quant_methods`` hook); a backend declares the names it runs
(``Backend.quant_methods``). Only "unquantized" exists so far; formats such as
fp8 block, w8a8 and GGUF types come as further methods.
"""

from chitu_core.quantization.base import QuantMethod, UnquantizedMethod
from chitu_core.quantization.registry import get_quant_method, quant_method_names, register_quant_method

__all__ = ["QuantMethod", "UnquantizedMethod", "get_quant_method", "quant_method_names", "register_quant_method"]

"""The ``act_quant`` option of the 8-bit methods ("fp8", "int8"): whether a linear quantizes its input
activations dynamically before it multiplies.

* ``True`` / ``False``: always / never (contract 1.2).
* An int N >= 1 (contract 1.17): for inputs of at least N rows (tokens), 16-bit activations below. A
  backend sets it through ``Backend.quant_preferences`` where its kernels favour each form at a
  different size: a decode step of a few rows is bound by the weight's bytes, which 16-bit activations
  do not add to, while many rows are bound by the products, which the device runs faster on 8-bit
  operands. The choice depends on a call's row count only, so a step recorded in a device graph
  replays the form it was recorded with. Numerics then differ by batch size as the two forms differ
  (the op contract states both: ``chitu_core.ops.spec``).
"""

from typing import Any

import torch

from chitu_core.errors import ChituError


def check_act_quant(method: str, value: Any) -> None:
    """A one-line error for an ``act_quant`` that is neither a bool nor an int >= 1."""
    if isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return
    raise ChituError(f"quantization method {method!r}: option act_quant is {value!r}; expected true, false or "
                     "a number of rows from which activations are quantized (an integer >= 1)")


def quantizes_activations(value: bool | int, x: torch.Tensor) -> bool:
    """Whether a linear with option ``act_quant`` = value quantizes x [..., K]'s activations."""
    if isinstance(value, bool):
        return value
    return x.numel() // max(1, x.shape[-1]) >= value

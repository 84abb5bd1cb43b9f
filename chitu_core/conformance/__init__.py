"""The conformance suite: does a backend compute what the contracts say, op by op, dtype by dtype?

Every op of the op contract, the paged-attention contract, the Sampler, the collectives, each
declared quantization method and a tiny model end to end are run on the backend and compared
with the reference implementation in float64 on the CPU (``thresholds`` holds the one table of
metrics and thresholds). Operands sit in sentinel-guarded buffers and the KV cache is guarded, so
reads and writes outside what a call owns fail the case (``guards``). What the backend declines
(``Backend.supports``) is reported unsupported, ops served by the core's reference are reported
as fallbacks, and every threshold the backend widens (``Backend.tolerances``) is shown.

    python -m chitu_core.conformance --backend NAME [--ops GLOBS] [--dtypes float32,bfloat16]
                                     [--perf] [--format md|json|csv] [--output FILE]
    pytest --pyargs chitu_core.conformance --backend NAME
"""

from chitu_core.conformance.thresholds import Threshold

__all__ = ["Threshold"]

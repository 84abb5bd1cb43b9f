"""acme-chitu-backend: an example out-of-tree backend for chitu-core (see docs/writing-a-backend.md).

"Acme" stands for your accelerator. To keep the example runnable anywhere, its device is simulated
on the host: tensors live on the CPU and its "kernels" are written in PyTorch.
"""

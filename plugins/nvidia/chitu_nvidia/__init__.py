"""chitu-nvidia: the NVIDIA backend of chitu-core (portable Triton kernels, cuBLAS, NCCL)."""

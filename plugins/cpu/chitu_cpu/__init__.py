"""chitu-cpu: the CPU backend of chitu-core (PyTorch ops, SDPA paged attention, gloo)."""

"""Device kernels the core ships as libraries for backends to opt into.

The core never calls them: a backend names them in its ``native_ops()`` and
``attention_backends()``. ``triton/`` holds portable Triton kernels for any
Triton-capable device (NVIDIA, and the DTK/MACA Triton ports).
"""

"""Sampling: per-request parameters, and the batched sampler that runs them on the backend's ops."""

from chitu_core.sampling.params import SamplingParams

__all__ = ["SamplingParams"]

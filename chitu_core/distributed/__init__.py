"""Collective communication over torch.distributed, on the process-group backend a device backend names."""

from chitu_core.distributed.communicator import Communicator

__all__ = ["Communicator"]

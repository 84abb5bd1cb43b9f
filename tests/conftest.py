"""Shared fixtures. Tests run against the installed distributions (see the Makefile)."""

import pytest
import torch

from builders import build_model


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(path, transformers model) of a tiny random Llama with a tokenizer-free directory."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, build_model(path, "llama")

"""return_free_host_memory gives the C heap's freed pages back to the OS (the engine calls it while loading)."""

import subprocess
import sys

import pytest

from chitu_core.backend import _malloc_trim

SCRIPT = """
import torch
from chitu_core.backend import return_free_host_memory

def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) >> 10

for _ in range(3):
    big = torch.ones(8 << 20, dtype=torch.uint8)
    del big  # a freed mapped block raises glibc's mapping threshold: what follows comes from the heap
    parts = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(200)]
    pin = torch.ones(4096, dtype=torch.uint8)  # above them, so that freeing them cannot shrink the heap's top
    del parts
    kept = rss()
    return_free_host_memory()
    print(kept, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or _malloc_trim() is None, reason="glibc's malloc_trim")
def test_freed_heap_pages_go_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    rounds = [tuple(map(int, line.split())) for line in out.split("\n") if line]
    kept_then_trimmed = [(kept, after) for kept, after in rounds if kept - after > 150]
    assert kept_then_trimmed, f"200 MB freed on the heap stayed resident after the call (MB before, after): {rounds}"

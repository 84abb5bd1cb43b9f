"""return_free_host_memory gives the C heap's freed pages back to the OS (the engine calls it while loading)."""

import os
import subprocess
import sys

import pytest

from chitu_core.backend import _malloc_trim
from chitu_core.bench.server_memory import status_mb

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


def mine(field: str) -> float:
    """This process's ``field`` of /proc/self/status in MB (RssShmem: the CPU backend's KV cache is anonymous
    shared pages)."""
    return status_mb(os.getpid())[field]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("attention", ["paged", "latent"])
def test_the_cpu_kv_cache_is_resident_only_for_the_blocks_in_use_at_once(tmp_path, attention):
    # 12 requests one after the other, each with a prompt of its own: released blocks (and the prefixes
    # they cache) are reused, so the 256 MB budget stays untouched beyond the first request's blocks.
    from builders import build_model
    from chitu_core import LLM, SamplingParams
    from test_deepseek import build_deepseek

    build_model(tmp_path, "llama") if attention == "paged" else build_deepseek(tmp_path, "v2")
    rss_before_load = mine("VmRSS")
    llm = LLM(tmp_path, device="cpu", dtype="float32", kv_cache_memory=256 << 20, max_num_seqs=2048, load_progress=False)
    bm, before = llm.engine.block_manager, mine("RssShmem")
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for r in range(12):
        llm.generate([{"prompt_token_ids": [7 + r] * 60}], params)
    per_request = -(-80 // bm.block_size)
    assert bm.reuse_first and bm.ever_taken == per_request
    layers = llm.engine.num_layers
    block_mb = llm.engine.attention.bytes_per_block() * layers / 2**20
    pages_mb = layers * 4 * os.sysconf("SC_PAGE_SIZE") / 2**20  # keys and values of a layer each straddle pages
    grew = mine("RssShmem") - before  # 0.47 MB here when each request writes blocks never written before
    assert grew <= per_request * block_mb + pages_mb, f"{grew:.2f} MB resident for {per_request} blocks of {block_mb:.3f} MB"
    loaded = mine("VmRSS") - rss_before_load
    cache_mb = bm.num_blocks * block_mb  # the whole budget: 2048 sequences could use it
    assert cache_mb > 200 and loaded < cache_mb / 2, f"{loaded:.0f} MB more resident with a {cache_mb:.0f} MB cache"


def test_the_cpu_backend_takes_at_most_512_new_tokens_a_step_unless_told(tmp_path):
    """Contract 1.15's ``step_token_budget``: a CPU step's activations are host memory, so a burst of prompts
    prefills 512 tokens a step (its scheduler chunks the rest), where the user sets no budget of their own."""
    from builders import build_model
    from chitu_core import LLM, SamplingParams
    from chitu_core.backend import Backend

    assert Backend.step_token_budget(None) is None  # the engine's 8192 for a backend that says nothing
    build_model(tmp_path, "llama")
    llm = LLM(tmp_path, device="cpu", dtype="float32", load_progress=False)
    assert llm.engine.max_num_batched_tokens == llm.engine.scheduler.max_num_batched_tokens == 512
    steps = []
    step = llm.engine.step
    llm.engine.step = lambda: steps.append(1) or step()
    out = llm.generate([{"prompt_token_ids": [5 + i] * 300} for i in range(3)], SamplingParams(max_tokens=1))
    assert len(steps) == 2 and all(len(o.outputs[0].token_ids) == 1 for o in out)  # 900 prompt tokens: 512 + 388
    told = LLM(tmp_path, device="cpu", dtype="float32", load_progress=False, max_num_batched_tokens=64)
    assert told.engine.scheduler.max_num_batched_tokens == 64

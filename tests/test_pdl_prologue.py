"""What the decode kernels do before waiting for the kernel before them (programmatic dependent launch,
``chitu_core.kernels.triton.pdl``), read from their PTX for an sm_90 target, compiled here without a GPU:
decode attention asks for its first key and value tiles to be brought into L2 and reads the step's lengths
and block tables before ``griddepcontrol.wait``, rotary reads its positions, cos/sin and slots before it,
and neither reads q, k or v (nor writes anything) before it. The compiler runs in a fresh interpreter: this
suite imports the kernels under Triton's interpreter elsewhere."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

SCRIPT = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from chitu_core.kernels.triton.paged_attention import _attention_kernel as attention
from chitu_core.kernels.triton.rotary import _rotary_kernel as rotary

def ptx(kernel, pointers, floats, const, **options):
    sig = {n: "constexpr" if n in const else pointers.get(n, "fp32" if n in floats else "i32") for n in kernel.arg_names}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

def facts(text):
    wait = text.find("griddepcontrol.wait")
    before = text[:wait] if wait >= 0 else ""
    return {"wait": wait >= 0, "prefetch_before": before.count("prefetch.global.L2"),
            "loads_before": before.count("ld.global"), "stores_before": before.count("st.global"),
            "loads_after": text[wait:].count("ld.global") if wait >= 0 else text.count("ld.global")}

out = {}
p = {n: "*bf16" for n in ("out", "q", "cache")}
p.update({n: "*fp32" for n in ("part_acc", "part_max", "part_sum", "kv_scale")})
p.update({n: "*i32" for n in ("block_tables", "seq_lens", "query_start_loc")})
for pdl in (True, False):
    const = dict(GROUP=4, GROUP_P=4, BLOCK_M=16, BLOCK_N=64, HEAD_DIM=128, HEAD_P=128, BLOCK_SIZE=16, SPLIT=True,
                 PRECISION="tf32", FP8=False, SOFTCAP=False, WINDOW=False, PDL=pdl, DECODE=True, ROW_LINES=2, KV_LINE=64)
    out[f"attention_pdl_{pdl}"] = facts(ptx(attention, p, ("scale_log2", "softcap_log2"), const, num_warps=4, num_stages=2))
r = {n: "*bf16" for n in ("q_out", "k_out", "q", "k", "cos_sin", "v", "cache", "q_norm_w", "k_norm_w")}
r.update({"positions": "*i64", "slot_mapping": "*i64", "kv_scale": "*fp32"})
const = dict(Q_HEADS_P=32, K_HEADS_P=8, HALF_P=64, PASS_P=0, DIM_P=128, IS_NEOX=True, WRITE_CACHE=True, BLOCK_SIZE=16,
             FP8=False, NORM=False, PDL=True)
out["rotary"] = facts(ptx(rotary, r, ("eps",), const, num_warps=4))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def facts():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_decode_attention_prefetches_and_reads_its_inputs_before_the_wait(facts):
    got = facts["attention_pdl_True"]
    assert got["wait"]
    # 2 tiles of 64 keys, 2 lines a key, keys and values: 512 lines over 128 threads
    assert got["prefetch_before"] == 4
    assert got["loads_before"] >= 2  # the sequence's length and its block table entries
    assert got["stores_before"] == 0
    assert got["loads_after"] > 0  # q, keys and values


def test_without_dependent_launch_there_is_no_wait_and_no_prefetch(facts):
    got = facts["attention_pdl_False"]
    assert not got["wait"] and got["prefetch_before"] == 0


def test_rotary_reads_positions_and_slots_before_the_wait(facts):
    got = facts["rotary"]
    assert got["wait"] and got["stores_before"] == 0
    assert got["loads_before"] == 4  # position, cos, sin, slot: one each a thread
    assert got["loads_after"] > got["loads_before"]  # q, k and v

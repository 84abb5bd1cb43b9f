"""Decode attention (``kernels/triton/paged_attention.py``) over tile configurations, at the decode shapes of
the Llama-3.1-8B benches (one GPU and one rank of TP2) and a long context, against the byte floor of the
keys and values a call reads (copy bandwidth measured here). Each layer of a step reads its own cache, so
the calls rotate through enough caches to exceed the L2 cache; timed as graph replays. A table last.

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/attention_sweep.py [SHAPE ...] [--out FILE.json]
        [--splits N ...] [--backend-tiles | --tiles KB:WARPS:STAGES:FILL ...]
"""

import argparse
import json
import sys

import torch

from chitu_core.bench.floor import copy_bandwidth
from chitu_core.kernels.triton.common import num_compute_units
from chitu_core.kernels.triton.paged_attention import TileConfig, paged_attention, plan, split_workspace

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quant_kernels import timed  # noqa: E402

DEV = torch.device("cuda")
BLOCK = 16
# (name, batch, context, query heads, kv heads)
SHAPES = [("8b-b64", 64, 256, 32, 8), ("8b-tp2-b64", 64, 256, 16, 4), ("8b-b1", 1, 256, 32, 8),
          ("8b-tp2-b1", 1, 256, 16, 4), ("1.7b-b4-8k", 4, 8000, 16, 8), ("1.7b-b4-32k", 4, 32000, 16, 8),
          ("1.7b-b128-512", 128, 512, 16, 8), ("1.7b-b8-8k", 8, 8000, 16, 8), ("1.7b-b16-8k", 16, 8000, 16, 8),
          ("1.7b-b32-8k", 32, 8000, 16, 8)]
TILES = [TileConfig(16 << 10, 4), TileConfig(16 << 10, 4, decode_stages=2), TileConfig(16 << 10, 4, decode_stages=4),
         TileConfig(16 << 10, 8), TileConfig(32 << 10, 4), TileConfig(32 << 10, 8), TileConfig(32 << 10, 8, decode_stages=2),
         TileConfig(8 << 10, 4), TileConfig(8 << 10, 2)]


def caches(batch: int, context: int, kv_heads: int, count: int):
    blocks_per_seq = -(-context // BLOCK)
    out = []
    for i in range(count):
        cache = torch.randn((2, batch * blocks_per_seq + 1, BLOCK, kv_heads, 128), device=DEV, dtype=torch.bfloat16)
        perm = torch.randperm(batch * blocks_per_seq, device=DEV).to(torch.int32) + 1  # scattered blocks, as a real cache
        out.append((cache, perm.view(batch, blocks_per_seq)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("shapes", nargs="*", help="names from SHAPES (default: all)")
    parser.add_argument("--splits", type=int, nargs="*", default=[None],
                        help="key ranges to force, each in turn (default: the planner's choice)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--backend-tiles", action="store_true", help="only the NVIDIA backend's own tiles")
    which.add_argument("--tiles", nargs="*", default=[],
                        help="tile configurations KB:WARPS:STAGES:FILL instead of the list (STAGES 0: Triton's default)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(DEV, torch.cuda.synchronize)
    units = num_compute_units(DEV)
    rows = []
    for name, batch, context, heads, kv_heads in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        nbytes = 2 * batch * context * kv_heads * 128 * 2
        sets = caches(batch, context, kv_heads, max(2, -(-(160 << 20) // nbytes)))
        q = torch.randn((batch, heads, 128), device=DEV, dtype=torch.bfloat16)
        seq_lens = torch.full((batch,), context, device=DEV, dtype=torch.int32)
        qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
        ref = None
        tile_set = TILES
        if args.backend_tiles:
            from chitu_nvidia.attention import NvidiaTritonAttention

            tile_set = [NvidiaTritonAttention.tiles]
        if args.tiles:
            tile_set = [TileConfig(int(kb) << 10, int(w), decode_stages=int(st) or None, decode_fill=int(f))
                        for kb, w, st, f in (t.split(":") for t in args.tiles)]
        for tiles, splits in ((t, n) for t in tile_set for n in args.splits):
            step = plan(heads, kv_heads, 1, batch, context, units, splits, tiles=tiles)
            ws = split_workspace(batch, heads, 128, step.num_splits, DEV) if step.num_splits > 1 else None

            def run(step=step, ws=ws):
                for cache, table in sets:
                    paged_attention(q, cache, table, seq_lens, qsl, 128 ** -0.5, step, ws)

            try:
                got = paged_attention(q, sets[0][0], sets[0][1], seq_lens, qsl, 128 ** -0.5, step, ws).float()
                us = timed(run, repeats=9, calls=1) / len(sets)
            except Exception as exc:  # noqa: BLE001  a config the compiler refuses (shared memory)
                print(f"  {name} {tiles}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            ref = got if ref is None else ref
            same = bool(torch.allclose(got, ref, atol=2e-2, rtol=2e-2))
            floor_us = nbytes / bandwidth * 1e6
            rows.append({"shape": name, "key_tile_kb": tiles.key_tile_bytes >> 10, "warps": tiles.warps,
                         "stages": tiles.decode_stages, "fill": tiles.decode_fill, "splits": step.num_splits,
                         "us": round(us, 2), "floor_us": round(floor_us, 2), "of_floor": round(floor_us / us, 3),
                         "agrees": same})
            print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, copy {bandwidth / 1e9:.0f} GB/s")
    print("| shape | key tile KB | warps | stages | fill | splits | us | floor us | of floor | agrees |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['key_tile_kb']} | {r['warps']} | {r['stages']} | {r['fill']} | {r['splits']} "
              f"| {r['us']} | {r['floor_us']} | {100 * r['of_floor']:.0f}% | {r['agrees']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": bandwidth / 1e9, "rows": rows}, f)


if __name__ == "__main__":
    main()

"""Where a decode step's time goes, on the GPU: kernels by device time, launches and device time per
step, the wall time per step around them, and the device's busy time (the kernels' union) with its idle
gaps by the kernel that follows them (what a step waits on between kernels: the host, a transfer).

    python plugins/nvidia/scripts/profile_step.py --model DIR --batch-size 1 [--input-len 128] [--steps 20] [--quantization int4] [--out FILE]
    torchrun --nproc-per-node 2 plugins/nvidia/scripts/profile_step.py --model DIR --tensor-parallel-size 2 ...

Under torchrun every rank runs the same requests and steps (as ``bench offline`` does); each rank
profiles its own device, rank 0 prints, and ``--out`` gets one file per rank (``FILE.rankN``).
"""

import argparse
import os
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from chitu_core import LLM, SamplingParams
from chitu_core.bench.offline import random_prompts


def timeline(prof, steps: int, rows: int = 8) -> tuple[float, list[tuple[str, tuple[float, int]]]]:
    """The device's busy time a step (the union of kernel intervals) and its idle gaps of over 0.5 us
    between kernels, summed by the kernel that follows each gap (the largest ``rows``)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    busy, idle, end = 0.0, {}, None
    for start, stop, name in spans:
        if end is not None and start > end + 0.5:
            us, count = idle.get(name, (0.0, 0))
            idle[name] = (us + start - end, count + 1)
        lo = start if end is None else max(start, end)
        busy += max(0.0, stop - lo)
        end = stop if end is None else max(end, stop)
    return busy / steps / 1e3, sorted(idle.items(), key=lambda kv: -kv[1][0])[:rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=20, help="kernels listed")
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"), help="dummy: random weights, config.json alone")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--quantization", help="in-situ quantization of 16-bit weights (fp8, int8, int4)")
    args = parser.parse_args()
    b, n = args.batch_size, args.steps
    engine = LLM(args.model, device="nvidia", dtype="bfloat16", max_model_len=args.input_len + 3 * n + 64, max_num_seqs=max(b, 1),
                 load_progress=False, load_format=args.load_format,
                 tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization).engine
    for i, p in enumerate(random_prompts(b, args.input_len, engine.vocab_size, 3)):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=3 * n + 20, temperature=0.0, ignore_eos=True))
    for _ in range(10):  # prefill and the first decode steps
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / n * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    kernels = sorted((e for e in prof.key_averages() if e.device_type == DeviceType.CUDA),
                     key=lambda e: -e.self_device_time_total)
    gpu_ms = sum(e.self_device_time_total for e in kernels) / n / 1e3
    launches = sum(e.count for e in kernels) / n
    from chitu_core.kernels.triton.pdl import pdl_launch

    overlap = ("; kernels launch dependent (CHITU_PDL=0 for times without the waits they overlap)"
               if pdl_launch(torch.device("cuda", torch.cuda.current_device())) else "")
    busy_ms, idle = timeline(prof, n)
    lines = [f"{args.model} batch {b}: wall {wall_ms:.3f} ms/step, GPU {gpu_ms:.3f} ms/step in {launches:.0f} launches"
             + overlap,
             f"device busy {busy_ms:.3f} ms/step (kernels' union); idle between kernels, by the kernel after the gap:",
             *(f"{us / n:9.1f} us/step {count / n:6.1f} gaps/step  before {name[:80]}" for name, (us, count) in idle),
             f"{'us/step':>9} {'calls':>6} {'us/call':>8}  kernel"]
    for e in kernels[: args.rows]:
        per_step = e.self_device_time_total / n
        lines.append(f"{per_step:9.1f} {e.count / n:6.0f} {per_step / (e.count / n):8.2f}  {e.key[:90]}")
    text = "\n".join(lines)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(text)
    if args.out:
        with open(args.out + (f".rank{rank}" if args.tensor_parallel_size > 1 else ""), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

"""Where a step's GPU time goes: picockpt's fused step beside Hugging Face's, one torch.profiler trace each.

    python lessons/gpu_profile.py                      # the benchmark's 1.1B model, T = 2048, on a CUDA GPU
    python lessons/gpu_profile.py --policy full --seq 4096
    python lessons/gpu_profile.py --tiny               # the same code on the CPU, in seconds

Each contender runs two warm-up steps, then one step under torch.profiler. Its kernels are summed by kind, the
way the step's time splits: GEMMs (cuBLAS/CUTLASS matmuls), attention (flash, cuDNN, memory-efficient kernels),
elementwise and reductions (everything else launched on the GPU), with the number of launches of each, then the
ten kernels that take longest. picockpt runs `--policy` with fused attention; Hugging Face runs sdpa under
autocast (fp32 master weights), with its activation checkpointing when the policy recomputes (anything but none).
On the CPU (--tiny) the rows are aten ops, which nest (a matmul holds its mm): a check that the code runs, not a split.
"""
import argparse
import collections
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # lessons/: gpu_benchmark
import gpu_benchmark  # noqa: E402  (after the path)

from picockpt.model.config import Config  # noqa: E402
from picockpt.device import resolve_device  # noqa: E402
from picockpt.measurement.measure import make_batch  # noqa: E402
from picockpt.model.params import init_params  # noqa: E402
from picockpt.measurement.reference import ReferenceLlama  # noqa: E402

KINDS = (("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
         ("GEMM", ("gemm", "sm90_xmma", "cutlass", "cublas", "nvjet", "matmul")))


def kind_of(name):
    lower = name.lower()
    return next((kind for kind, marks in KINDS if any(mark in lower for mark in marks)), "elementwise/reduction")


def profile_step(step, device):
    """(total device seconds, {kind: [seconds, launches]}, [(seconds, kernel name)]) of one step."""
    for _ in range(2):
        step()
    activity = torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    # acc_events: one cycle either way; without it torch 2.11 and 2.12 warn that only the last cycle is kept
    with torch.profiler.profile(activities=[activity], acc_events=True) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    kernels = [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA] \
        if device.type == "cuda" else [event for event in prof.events() if event.name.startswith("aten::")]
    by_kind, by_name = collections.defaultdict(lambda: [0.0, 0]), collections.Counter()
    for event in kernels:
        seconds = (event.device_time if device.type == "cuda" else event.cpu_time) / 1e6  # us -> s
        by_kind[kind_of(event.name)][0] += seconds
        by_kind[kind_of(event.name)][1] += 1
        by_name[event.name[:90]] += seconds
    total = sum(seconds for seconds, _ in by_kind.values())
    return total, dict(by_kind), [(seconds, name) for name, seconds in by_name.most_common(10)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0], epilog=__doc__.partition("\n")[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (what CI runs)")
    parser.add_argument("--seq", type=int, help="sequence length (default 2048; --tiny 32); 8192 tokens a step")
    parser.add_argument("--policy", default="none", help="picockpt's policy (default none)")
    args = parser.parse_args(argv)
    device = resolve_device("cpu" if args.tiny else "auto")
    if device.type != "cuda" and not args.tiny:
        print("error: the profile is of a GPU's kernels; on the CPU add --tiny", file=sys.stderr)
        return 2
    seq, tokens = args.seq or (32 if args.tiny else 2048), 64 if args.tiny else 8192
    if seq < 1 or tokens % seq:
        print(f"error: --seq={seq}: use a divisor of {tokens} (the tokens of one step)", file=sys.stderr)
        return 2
    shape = gpu_benchmark.TINY if args.tiny else gpu_benchmark.ONE_B
    cfg = Config(**{**shape, "max_seq": max(shape["max_seq"], seq), "attention": "fused"})
    params = init_params(cfg, seed=0, device=device)
    ids, targets = make_batch(cfg, tokens // seq, seq, device, 0)
    ours = dict(name=f"picockpt fused {args.policy}", kind="picockpt", how=args.policy, attention="fused")
    hf = gpu_benchmark.hf_runs(cfg, params, device)[args.policy != "none":][:1]
    with torch.device(device):
        model = ReferenceLlama(cfg, params)
    print(f"one step of {tokens // seq} x {seq} tokens, L={cfg.layers} h={cfg.hidden} ({cfg.num_params() / 1e9:.2f} B "
          f"parameters) in {cfg.dtype}, on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'the CPU'}")
    for run in [ours] + hf:
        total, kinds, top = profile_step(gpu_benchmark.make_step(run, cfg, params, model, ids, targets), device)
        print(f"\n{run['name']}: {total * 1e3:.1f} ms of kernels")
        for kind, (seconds, launches) in sorted(kinds.items(), key=lambda item: -item[1][0]):
            print(f"  {kind:<22} {seconds * 1e3:8.1f} ms  {launches:5d} launches")
        for seconds, name in top:
            print(f"    {seconds * 1e3:8.2f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kernel rates by shape, measured on this machine: the table the layout search prices kernels with.

    python lessons/kernel_rates.py --out figures_gpu/kernel_rates.json     # a CUDA GPU: about a minute
    python lessons/kernel_rates.py --tiny                                  # the same code on the CPU, in seconds
    python -m picockpt predict --search ... --kernels figures_gpu/kernel_rates.json

It times every matmul a layout search prices for Llama 3 8B, 70B and 405B (each linear's forward, input-gradient
and weight-gradient product, on 1, 2, 4 or 8 tensor-parallel ranks, with 512 to 8,192 rows a micro-batch), and
sdpa's causal attention forward and backward at 512 to 16,384 tokens (16 heads of 128, 16k tokens a batch, as the
published attention benchmarks run it): picockpt/planning/kernel_bench.py. The JSON names the GPU and torch; the
search takes, for a shape it did not measure, the nearest measured one, and the fastest matmul over the
datasheet's peak (--peak-tflops) is the table's matmul efficiency.
"""
import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere, no install
from picockpt.device import exit_if_torch_too_old, resolve_device  # noqa: E402  (after the path)

exit_if_torch_too_old()  # before the imports below, which a torch under the floor may lack: one line, no traceback

from picockpt import Config  # noqa: E402
from picockpt.planning.cost import head_ops, layer_ops  # noqa: E402
from picockpt.planning.kernel_bench import measure_kernel_rates  # noqa: E402
from picockpt.planning.kernel_rates import SEQ_POINTS, gemm_passes  # noqa: E402

MODELS, TPS, ROWS = ("llama3-8b", "llama3-70b", "llama3-405b"), (1, 2, 4, 8), (512, 1024, 2048, 4096, 8192)


def search_gemms(models, tps, rows):
    """Every distinct (m, n, k) of the forward and backward matmuls of these models' layers and heads."""
    shapes = set()
    for name in models:
        cfg = Config.from_preset(name, dtype="bf16").replace(attention="fused")
        for tp in tps:
            for n in rows:
                for op in layer_ops(cfg, 1, n, tp) + head_ops(cfg, 1, n, tp):
                    for shape in op.shapes:
                        if shape is not None and shape[0] == "gemm":
                            shapes.update(p for d in ("forward", "backward") for p in gemm_passes(shape, d))
    return sorted(shapes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="figures_gpu/kernel_rates.json", help="where the JSON goes")
    parser.add_argument("--device", default="auto", help="cuda (default where there is one) or cpu")
    parser.add_argument("--peak-tflops", type=float, default=989.5,
                        help="the datasheet's dense bf16 TFLOP/s the efficiency is taken against (H100/H200 SXM)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls a kernel; the median counts")
    parser.add_argument("--tiny", action="store_true", help="a tiny model's shapes in fp32: a check that it runs")
    args = parser.parse_args(argv)
    if args.repeats < 1 or not args.peak_tflops > 0:
        parser.error("--repeats: 1 or more; --peak-tflops: a positive rate, e.g. 989.5")
    device = resolve_device(args.device)
    if args.tiny:
        gemms, seqs, dtype, tokens = search_gemms(("small",), (1, 2), (64, 128)), (64, 128), torch.float32, 256
    else:
        gemms, seqs, dtype, tokens = search_gemms(MODELS, TPS, ROWS), SEQ_POINTS, torch.bfloat16, 16384
    print(f"{len(gemms)} matmul shapes and attention at {len(seqs)} lengths on {device}", flush=True)
    peak = None if args.tiny else args.peak_tflops * 1e12  # a CPU has no tensor-core datasheet peak
    rates = measure_kernel_rates(device, gemms, seqs, dtype, peak, args.repeats,
                                 progress=lambda text: print(text, flush=True), tokens=tokens)
    best = max(rates.gemms, key=lambda g: g[3])
    print(f"fastest matmul {best[3] / 1e12:.3g} TFLOP/s at {best[0]} x {best[1]} x {best[2]}"
          + ("" if peak is None else f": {rates.gemm_efficiency:.1%} of {args.peak_tflops:g}"))
    for seq, forward, backward in rates.attention:
        print(f"attention, {seq:>6,} tokens: forward {forward / 1e12:7.3g}, backward {backward / 1e12:7.3g} TFLOP/s")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rates.to_json(), indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m picockpt measure: one step under one policy, every number with its unit."""
import sys

from ..planning.fit import check_fits
from ..measurement.measure import measure_policy
from ..device import resolve_device
from ..recompute.policy import POLICY_HELP, parse_policy
from .common import add_run_args, add_shape_args, check_repeats, config_from_args, fmt_bytes, fmt_flops, report


def add_arguments(parser):
    add_shape_args(parser)
    add_run_args(parser)
    parser.add_argument("--policy", default="none", help=POLICY_HELP)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps, median reported (default 3, at least 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--trace", action="store_true", help="print the engine's events of one step")
    parser.add_argument("--no-optimizer", dest="optimizer", action="store_false",
                        help="measure a forward and backward alone: no AdamW step and no optimizer state (8 bytes a "
                             "parameter less), as for a model whose AdamW state would not fit, e.g. "
                             "--preset llama3-8b --seq 8192 --dtype bf16 --attention fused on one 141 GB GPU")
    parser.add_argument("--memory-snapshot", metavar="FILE",
                        help="CUDA only: record the allocator history of one step to FILE (a pickle that "
                             "https://pytorch.org/memory_viz opens)")


def run(args):
    cfg = config_from_args(args)
    check_repeats(args)
    policy = parse_policy(args.policy, cfg)
    device = resolve_device(args.device)
    check_fits(cfg, device, args.batch, args.seq, policy, optimizer=args.optimizer)
    check_fits(cfg, device, args.batch, args.seq, "none", advice="use a smaller --batch or --seq",
               note=" (measure also runs policy none once: its gradients are the baseline every policy is "
                    "compared with)", optimizer=args.optimizer)
    if args.memory_snapshot:
        from ..measurement.snapshot import record_snapshot
        record_snapshot(args.memory_snapshot, cfg, policy, args.batch, args.seq, device, args.seed)
    row = measure_policy(cfg, policy, args.batch, args.seq, device, args.seed, args.repeats,
                         trace=(lambda line: print(line, file=sys.stderr)) if args.json and args.trace
                         else args.trace, optimizer=args.optimizer)
    header = (f"policy {row['policy']} on {row['device']}, {row['dtype']}: L={cfg.layers} h={cfg.hidden} "
              f"H={cfg.heads} KV={cfg.kv_heads} f={cfg.ffn} V={cfg.vocab}, batch {args.batch} x {args.seq} tokens; "
              + ("a training step (AdamW)" if args.optimizer else "forward + backward alone (--no-optimizer)"))
    lines = [
        ("peak stored activations (logical)", fmt_bytes(row["peak_activation_bytes"]),
         f"{row['peak_activation_bytes']:,} bytes"),
        ("predicted by the closed form", fmt_bytes(row["predicted_activation_bytes"]),
         f"{row['predicted_activation_bytes']:,} bytes"),
        ("peak live bytes (physical)", fmt_bytes(row["peak_live_bytes"]), "activations + working memory"),
        ("forward FLOPs", fmt_flops(row["forward_flops"]), ""),
        ("recompute FLOPs", fmt_flops(row["recompute_flops"]),
         f"{row['recompute_flops'] / row['forward_flops']:.1%} of the forward"),
        ("backward FLOPs", fmt_flops(row["backward_flops"]), ""),
        ("step time", f"{row['step_seconds'] * 1e3:.1f} ms", f"median of {args.repeats} "
         f"[{row['step_seconds_min_max'][0] * 1e3:.1f}..{row['step_seconds_min_max'][1] * 1e3:.1f}]"),
        ("loss", f"{row['loss']:.6f}", ""),
        ("max |grad - grad(none)|", f"{row['grad_max_abs_diff_vs_none']:.3g}", "0 means bitwise equal"),
    ]
    if args.optimizer:
        lines.append(("optimizer state (AdamW)", fmt_bytes(row["optimizer_state_bytes"]),
                      "two fp32 moments a parameter, a step count a tensor; made by the first step, in the optimizer "
                      "phase"))
    if "cuda_peak_bytes" in row:
        lines.append(("CUDA max_memory_allocated", fmt_bytes(row["cuda_peak_bytes"]),
                      "the step's increase, its largest phase (per phase below)"))
    if "host_peak_bytes" in row:
        from ..planning.host_walk import DEFAULT_COMPUTE_RATE, DEFAULT_HOST_BANDWIDTH
        lines.append(("peak host bytes (offloaded)", fmt_bytes(row["host_peak_bytes"]),
                      f"{row['host_peak_bytes']:,} bytes; closed form {row['predicted_host_bytes']:,}"))
        for phase, copied in row["copy_bytes"].items():
            lines.append((f"copied in {phase}", fmt_bytes(copied["to_host"] + copied["to_device"]),
                          f"to host {copied['to_host']:,} B, to device {copied['to_device']:,} B"))
        if "measured_exposed_copy_seconds" in row:
            lines.append(("exposed copy time (measured)", f"{row['measured_exposed_copy_seconds'] * 1e3:.3f} ms",
                          "compute stream waiting for copies, CUDA events"))
        lines.append(("exposed copy time (modelled)", f"{row['modelled_exposed_copy_seconds'] * 1e3:.4g} ms",
                      f"at {DEFAULT_HOST_BANDWIDTH / 1e9:.3g} GB/s and {DEFAULT_COMPUTE_RATE / 1e12:.4g} TFLOP/s; "
                      f"modelled, not measured"))
    if report(args, row, header, lines, (36, 16)):
        return
    for phase, peaks in row["phase_peaks"].items():
        if phase == "outside":
            continue
        print(f"  peak in {phase:<10} logical {fmt_bytes(peaks['logical']):>12}  "
              f"physical {fmt_bytes(peaks['physical']):>12}"
              + ("" if peaks.get("cuda") is None else f"  tracked total {fmt_bytes(peaks['total']):>12}  "
                                                       f"CUDA max_memory_allocated {fmt_bytes(peaks['cuda']):>12}"))
    if "cuda_peak_bytes" in row:
        print("  (tracked total: every storage the step made on this GPU, weights' 16-bit copies, gradients and "
              "optimizer state too; CUDA: the allocator's peak above the step's start, per phase)")

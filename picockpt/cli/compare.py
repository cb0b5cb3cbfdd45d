"""python -m picockpt compare: picockpt and torch.utils.checkpoint, side by side, one run."""
import functools
import json
import sys

from ..compare import compare
from ..device import check_fits
from .common import add_run_args, add_shape_args, check_repeats, config_from_args, device_from_args, fmt_bytes, table


def add_arguments(parser):
    add_shape_args(parser)
    add_run_args(parser)
    parser.add_argument("--segment", type=int, default=2, help="C for every:C and its peers (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timed repeats (default 7, at least 1)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def run(args):
    cfg = config_from_args(args)
    if not 1 <= args.segment <= cfg.layers:
        raise ValueError(f"--segment={args.segment}: use 1 <= C <= layers={cfg.layers}")
    check_repeats(args)
    device = device_from_args(args)
    check_fits(cfg, device, args.batch, args.seq, "none", advice="use a smaller --batch or --seq",
               note=" (compare runs every policy, none among them, and plain autograd)")
    say = functools.partial(print, file=sys.stderr if args.json else sys.stdout)  # --json: stdout is JSON alone
    say(f"comparing on {device} ({cfg.dtype}): L={cfg.layers} h={cfg.hidden} H={cfg.heads} "
        f"KV={cfg.kv_heads} f={cfg.ffn} V={cfg.vocab}, batch {args.batch} x {args.seq} tokens")
    rows = compare(cfg, args.batch, args.seq, device, args.segment, args.repeats, args.seed, log=say)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    base = next(r for r in rows if r["name"] == "autograd")
    ratio = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    spread = lambda v, lo_hi, scale=1.0, f="{:.2f}": "-" if v is None else \
        f"{f.format(v * scale)} [{f.format(lo_hi[0] * scale)}..{f.format(lo_hi[1] * scale)}]"  # noqa: E731
    print(table(rows, [
        ("run", lambda r: r["name"]),
        ("peak live", lambda r: fmt_bytes(r["peak_live_bytes"])),
        ("recompute GFLOP", lambda r: f"{r['recompute_flops'] / 1e9:.3f}"),
        ("step ms [min..max]", lambda r: spread(r["step_seconds"], r["step_seconds_min_max"], 1e3, "{:.0f}")),
        ("time / autograd", lambda r: f"{r['step_seconds'] / base['step_seconds']:.2f}"),
        ("vs equivalent: memory", lambda r: ratio(r["memory_vs_equivalent"])),
        ("time [min..max]", lambda r: spread(r["time_vs_equivalent"], r["time_vs_equivalent_min_max"])),
        ("equivalent", lambda r: r["equivalent"] or "-"),
    ]))
    print(f"step ms: median of {args.repeats} interleaved repeats [fastest..slowest]; time vs equivalent: the median "
          f"of the repeat-by-repeat ratios [smallest..largest]. peak live = bytes of all tensors created during the "
          f"step, weight gradients excluded. torch checkpoint_sequential keeps its last segment stored.")
    worst = max(rows, key=lambda r: r["grad_max_rel_diff"])
    print(f"gradients: every run's within {worst['grad_max_rel_diff']:.1e} (max relative difference, worst: "
          f"{worst['name']}) of picockpt none's, same weights and batch")

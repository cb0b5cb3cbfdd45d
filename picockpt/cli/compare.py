"""python -m picockpt compare: picockpt and torch.utils.checkpoint, side by side, one run."""
import functools
import json
import sys

from ..measurement.compare import (AUTOCAST_FACTOR, FP32, GRAD_TOLERANCE, check_min_cut, compare, min_cut_supported,
                       reference_masks_match)
from ..device import resolve_device
from ..planning.fit import check_fits
from .common import add_run_args, add_shape_args, check_repeats, config_from_args, fmt_bytes, table


def add_arguments(parser):
    add_shape_args(parser)
    add_run_args(parser)
    parser.add_argument("--segment", type=int, default=2, help="C for every:C and its peers (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timed repeats (default 7, at least 1)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--min-cut", default="auto", metavar="BUDGETS",
                        help="activation_memory_budget values for torch.compile's min-cut partitioner runs, comma "
                             "separated (e.g. 0.5,0.2,0), or none; auto (default): 0.5,0.2,0 for dense fp32/fp64 "
                             "models without dropout, none otherwise")


AUTO_MIN_CUT = (0.5, 0.2, 0.0)


def min_cut_budgets(args, cfg):
    """--min-cut as a tuple of budgets, and a note when auto leaves them out."""
    text = args.min_cut.strip().lower()
    if text == "none":
        return (), None
    if text == "auto":
        reason = min_cut_supported(cfg) or ("with dropout the partitioner recomputes aten.rand in the backward, "
                                            "drawing other masks (pytorch/pytorch#190758); --min-cut 0.5 runs it "
                                            "anyway, and its gradient check fails" if cfg.dropout else None)
        return ((), f"min-cut runs left out: {reason}") if reason else (AUTO_MIN_CUT, None)
    try:
        budgets = tuple(float(word) for word in text.split(","))
    except ValueError:
        raise ValueError(f"--min-cut={args.min_cut!r}: give budgets between 0 and 1, comma separated (e.g. "
                         f"--min-cut 0.5,0.2,0), or none, or auto") from None
    return check_min_cut(cfg, budgets, "--min-cut"), None


def run(args):
    cfg = config_from_args(args)
    if not 1 <= args.segment <= cfg.layers:
        raise ValueError(f"--segment={args.segment}: use 1 <= C <= layers={cfg.layers}")
    check_repeats(args)
    budgets, note = min_cut_budgets(args, cfg)
    device = resolve_device(args.device)
    check_fits(cfg, device, args.batch, args.seq, "none", advice="use a smaller --batch or --seq",
               note=" (compare runs every policy, none among them, and plain autograd)", optimizer=False)
    say = functools.partial(print, file=sys.stderr if args.json else sys.stdout)  # --json: stdout is JSON alone
    say(f"comparing on {device} ({cfg.dtype}): L={cfg.layers} h={cfg.hidden} H={cfg.heads} "
        f"KV={cfg.kv_heads} f={cfg.ffn} V={cfg.vocab}, batch {args.batch} x {args.seq} tokens")
    if note:
        say(note)
    rows = compare(cfg, args.batch, args.seq, device, args.segment, args.repeats, args.seed, log=say, min_cut=budgets)
    if args.json:
        print(json.dumps(rows, indent=1))
        return report_gradients(rows, cfg, functools.partial(print, file=sys.stderr))
    base = next(r for r in rows if r["name"] == "autograd")
    ratio = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    spread = lambda v, lo_hi, scale=1.0, f="{:.2f}": "-" if v is None else \
        f"{f.format(v * scale)} [{f.format(lo_hi[0] * scale)}..{f.format(lo_hi[1] * scale)}]"  # noqa: E731
    print(table(rows, [
        ("run", lambda r: r["name"]),
        ("peak live", lambda r: fmt_bytes(r["peak_live_bytes"])),
        ("peak total", lambda r: fmt_bytes(r["peak_total_bytes"])),
        ("host", lambda r: fmt_bytes(r["host_peak_bytes"]) if r["host_peak_bytes"] else "-"),
        ("recompute GFLOP", lambda r: f"{r['recompute_flops'] / 1e9:.3f}"),
        ("step ms [min..max]", lambda r: spread(r["step_seconds"], r["step_seconds_min_max"], 1e3, "{:.0f}")),
        ("time / autograd", lambda r: f"{r['step_seconds'] / base['step_seconds']:.2f}"),
        ("vs equivalent: memory", lambda r: ratio(r["memory_vs_equivalent"])),
        ("time [min..max]", lambda r: spread(r["time_vs_equivalent"], r["time_vs_equivalent_min_max"])),
        ("equivalent", lambda r: r["equivalent"] or "-"),
        ("gradients", lambda r: f"{r['grad_max_rel_diff']:.1e} " + ("ok" if r["grad_ok"] else "FAILED")
         + ("" if r["grad_checked_against"] == "picockpt none" else f" vs {r['grad_checked_against']}")),
    ]))
    print(f"step ms: median of {args.repeats} interleaved repeats [fastest..slowest]; time vs equivalent: the median "
          f"of the repeat-by-repeat ratios [smallest..largest]. peak live = bytes of all tensors created during the "
          f"step, weight gradients excluded, host copies apart (host: their peak, save_on_cpu's and offload's); "
          f"peak total = every storage the step made, 16-bit weight copies and weight gradients included (the "
          f"memory ratio in {rows[0]['memory_compared'].replace('_bytes', '').replace('_', ' ')}: in 16 bits "
          f"autocast's copies cannot be told apart). torch checkpoint_sequential keeps its last segment stored.")
    return report_gradients(rows, cfg, print)


def report_gradients(rows, cfg, say):
    """The gradient check, group by group; returns 1 (the exit status) when a run failed it."""
    say(f"gradients: max relative difference (max |difference| / max |reference|, tensor by tensor), same weights "
        f"and batch; {cfg.dtype} passes within {GRAD_TOLERANCE[cfg.dtype]:.0e}")
    autocast = next((r for r in rows if r["grad_checked_against"] == FP32), None)
    if autocast:
        say(f"Hugging Face under autocast rounds elsewhere than picockpt: checked against {FP32}, within "
            f"{AUTOCAST_FACTOR:g}x picockpt none's own distance from it ({autocast['grad_tolerance']:.1e})")
    if not reference_masks_match(cfg):
        say(f"dropout masks differ: with dropout={cfg.dropout} under {cfg.attention} attention picockpt draws each "
            f"tile's mask from a stored seed, the reference model's runs draw eager attention's masks; so those runs "
            f"are checked against autograd, not against picockpt none (a difference between the two would only "
            f"measure the masks)")
    for against in dict.fromkeys(r["grad_checked_against"] for r in rows):
        group = [r for r in rows if r["grad_checked_against"] == against and r["grad_ok"] and r["name"] != against]
        if group:
            worst = max(group, key=lambda r: r["grad_max_rel_diff"])
            say(f"  {len(group)} runs within {worst['grad_max_rel_diff']:.1e} of {against}'s (worst: {worst['name']})")
    failed = [r for r in rows if not r["grad_ok"]]
    for r in failed:
        say(f"  FAILED: {r['name']}: {r['grad_max_rel_diff']:.2e} from {r['grad_checked_against']}'s gradients, "
            f"above {r['grad_tolerance']:.0e}" + (" (with dropout the min-cut partitioner recomputes aten.rand with "
                                                  "fresh numbers: pytorch/pytorch#190758)"
                                                  if r["kind"] == "min-cut" and cfg.dropout else ""))
    if failed:
        say(f"gradient check FAILED for {len(failed)} of {len(rows)} runs")
        return 1
    return 0

"""predict --search: every layout of --gpus GPUs for one model and batch, the ones that fit ranked by modelled step time.

    python -m picockpt predict --search --model llama3-405b --seq 8192 --gpus 16384 --tokens-per-batch 16M \\
        --gpu-gib 80 --hardware h100

Memory from picockpt's closed forms, time from picockpt/cost.py (picockpt/layout_search.py says which terms).
"""
import json
import time

from ..cost import HARDWARE, hardware
from ..layout_search import published_for, rank_of, search
from .predict_parallel import gpu_bytes

TOKEN_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}  # 16M = 2048 sequences of 8,192 (powers of two)
TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "bubble", "dp_exposed")
CHOSEN = ("--tp", "tp", 1), ("--sp", "sp", False), ("--cp", "cp", 1), ("--pp", "pp", 1), ("--dp", "dp", 1), \
    ("--zero", "zero", None), ("--microbatches", "microbatches", None), ("--recompute", "recompute", "none"), \
    ("--batch", "batch", 1), ("--distribute-saved", "distribute_saved", False), ("--schedule", "schedule", "1f1b"), \
    ("--virtual-stages", "virtual_stages", 1)
PRICED = ("--cp-comm", "cp_comm", "ring", "each layer's K/V all-gathered over the cp ranks"), \
    ("--keep-kv", "keep_kv", False, "the gathered K/V not kept (gathered again in the backward)"), \
    ("--attention", "attention", (None, "fused"), "attention as a flash kernel (fused)")  # what the search prices


def add_search_arguments(parser):
    group = parser.add_argument_group("layout search (--search)")
    group.add_argument("--search", action="store_true",
                       help="rank every tp x cp x pp x dp layout of --gpus GPUs, ZeRO stage, pipeline schedule and "
                            "recompute policy whose every rank fits --gpu-gib, by modelled step time")
    group.add_argument("--gpus", type=int, help="--search: GPUs in the job, e.g. 16384")
    group.add_argument("--tokens-per-batch", help="--search: tokens a step, a whole number of --seq sequences; "
                                                  "K, M, G are powers of two (16M = 2,048 x 8,192)")
    group.add_argument("--hardware", choices=tuple(HARDWARE), default="h100",
                       help="--search: the GPU's datasheet rates (default h100; 8 a node, NVLink inside, one "
                            "InfiniBand port a GPU between nodes)")
    group.add_argument("--top", type=int, default=10, help="--search: layouts printed (default 10; --json: all)")


def parse_tokens(text):
    number, unit = (text[:-1], text[-1].lower()) if text and text[-1].lower() in TOKEN_UNITS else (text, "")
    try:
        value = float(number) * TOKEN_UNITS[unit]
    except ValueError:
        value = 0
    if not value >= 1 or value != int(value) or value == float("inf"):
        raise ValueError(f"--tokens-per-batch={text!r}: give a positive whole number of tokens, e.g. 16M (16 x 2**20) or "
                         f"16777216")
    return int(value)


def check_search_flags(args):
    """--search chooses the layout: a layout flag beside it is refused, naming it; the search's flags need it."""
    if not args.search:
        given = [flag for flag, name in (("--gpus", "gpus"), ("--tokens-per-batch", "tokens_per_batch"))
                 if getattr(args, name) is not None] + (["--top"] if args.top != 10 else [])
        if given:
            raise ValueError(f"{', '.join(given)}: only --search reads {'it' if len(given) == 1 else 'them'}; add "
                             f"--search, or leave {'it' if len(given) == 1 else 'them'} out")
        return
    chosen = [flag for flag, name, default in CHOSEN if getattr(args, name) != default]
    if chosen:
        raise ValueError(f"{', '.join(chosen)} with --search: the search chooses "
                         f"{'it' if len(chosen) == 1 else 'them'} for every layout it ranks; leave "
                         f"{'it' if len(chosen) == 1 else 'them'} out (give --gpus, --tokens-per-batch, --seq, "
                         f"--gpu-gib)")
    for flag, name, default, priced in PRICED:  # not chosen, and not read either: the search prices one way
        value = getattr(args, name)
        if value not in (default if isinstance(default, tuple) else (default,)):
            given = flag if value is True else f"{flag} {value}"
            raise ValueError(f"{given} with --search: the search prices {priced} in every layout; leave {flag} "
                             f"out")
    for flag, name in (("--gpus", "gpus"), ("--tokens-per-batch", "tokens_per_batch")):
        if getattr(args, name) is None:
            raise ValueError(f"--search needs {flag}, e.g. --gpus 16384 --tokens-per-batch 16M")
    if args.top < 1:
        raise ValueError(f"--top={args.top}: print at least one layout, e.g. --top 10")


def run_search(args, cfg):
    tokens, hw = parse_tokens(args.tokens_per_batch), hardware(args.hardware)
    capacity = gpu_bytes(args.gpu_gib)
    start = time.perf_counter()
    rows, considered = search(cfg, args.seq, args.gpus, tokens, capacity, hw)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"model": args.preset, "seq": args.seq, "gpus": args.gpus, "tokens_per_batch": tokens,
                          "gpu_bytes": capacity, "hardware": hw.name, "considered": considered,
                          "search_seconds": seconds, "layouts": rows}, indent=1))
        return
    print(f"{args.preset} at {args.seq:,} tokens a sequence, {tokens:,} tokens a step on {args.gpus:,} {hw.name} "
          f"GPUs of {args.gpu_gib:g} GiB ({hw.source})")
    print(f"{considered:,} layouts considered in {seconds:.1f} s, {len(rows):,} fit; attention priced as a flash "
          f"kernel; times modelled at datasheet rates (a ceiling: MFU measured on real runs sits below)")
    if not rows:
        print("no layout fits: add GPUs, raise --gpu-gib, or shorten --seq")
        return
    print(f"\n{'#':>3} {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>5} {'zero':>6} {'schedule':>14} {'M':>4} {'policy':>6} "
          f"{'peak GiB':>9} {'step s':>7} {'MFU':>6}   " + " ".join(f"{t:>10}" for t in TERMS))
    for i, row in enumerate(rows[:args.top], 1):
        print(f"{i:>3} " + _row_text(row))
    print("\n" + why_best(rows))
    published = published_for(args.preset, args.seq, args.gpus, tokens)
    if published:
        print(published_line(rows, published))


def published_line(rows, published):
    """Where the Llama 3 paper's own layout for this case ranks, and its modelled MFU beside the reported one."""
    (tp, cp, pp, dp), reported = published[2], published[4]
    rank, row = rank_of(rows, (tp, cp, pp, dp))
    head = f"the Llama 3 paper's layout here (Table 4): TP{tp} CP{cp} PP{pp} DP{dp}, {reported:.0%} BF16 MFU reported"
    if rank is None:
        return head + ": it does not fit in this model's memory"
    return (head + f"; #{rank} of {len(rows):,} here, modelled {row['mfu']:.1%} at datasheet rates (its best variant: "
            f"ZeRO {row['zero']}, {row['schedule']}" + (f" V={row['virtual_stages']}" if row["virtual_stages"] > 1
                                                         else "") + f", {row['policy']})")


def _row_text(row):
    schedule = row["schedule"] + (f" V={row['virtual_stages']}" if row["schedule"] == "interleaved" else "")
    return (f"{row['tp']:>3} {row['cp']:>3} {row['pp']:>3} {row['dp']:>5} {row['zero']:>6} {schedule:>14} "
            f"{row['microbatches']:>4} {row['policy']:>6} {row['peak_bytes'] / 2**30:>9.1f} {row['step_seconds']:>7.2f} "
            f"{row['mfu']:>6.1%}   " + " ".join(f"{row['terms_seconds'][t]:>9.2f}s" for t in TERMS))


def why_best(rows):
    """The terms that decide: the best against the best of another tp x cp x pp split."""
    best = rows[0]
    split = (best["tp"], best["cp"], best["pp"])
    other = next((r for r in rows if (r["tp"], r["cp"], r["pp"]) != split), None)
    lines = [f"why the best wins: of its {best['step_seconds']:.2f} s, " + ", ".join(
        f"{t} {best['terms_seconds'][t] / best['step_seconds']:.0%}" for t in TERMS if best["terms_seconds"][t] > 0)]
    if other is not None:
        gaps = sorted(TERMS, key=lambda t: other["terms_seconds"][t] - best["terms_seconds"][t], reverse=True)
        lines.append(f"against the best other split (tp {other['tp']}, cp {other['cp']}, pp {other['pp']}: "
                     f"{other['step_seconds']:.2f} s), it saves " + ", ".join(
                         f"{(other['terms_seconds'][t] - best['terms_seconds'][t]):.2f} s of {t}" for t in gaps[:2]
                         if other["terms_seconds"][t] > best["terms_seconds"][t]))
    return "\n".join(lines)

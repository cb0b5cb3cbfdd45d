"""predict --search: every layout of --gpus GPUs for one model and batch, the ones that fit ranked by modelled step
time.

    python -m picockpt predict --search --model llama3-405b --seq 8192 --gpus 16384 --tokens-per-batch 16M \\
        --gpu-gib 80 --hardware h100

Memory from picockpt's closed forms, time from picockpt/planning/cost.py (picockpt/planning/layout_search.py says which
terms).
"""
import json
import textwrap
import time

from dataclasses import replace

from ..planning.cost import HARDWARE, hardware
from ..planning.kernel_rates import ATTENTION_KERNELS, from_json, published
from ..planning.frameworks import FRAMEWORKS
from ..planning.layout_search import TERMS, distinct_splits, no_split_reason, published_for, rank_of, search, split_of
from ..planning.layout_time import FULL_MODEL
from .predict_parallel import gpu_bytes

TOKEN_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}  # 16M = 2048 sequences of 8,192 (powers of two)
TERM_SHORT = {"compute": "comp", "recompute": "recmp", "tp_comm": "tp", "cp_comm": "cp", "pp_comm": "pp",
              "bubble": "bubbl", "dp_exposed": "dp"}
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
    group.add_argument("--framework", choices=tuple(FRAMEWORKS), default="any",
                       help="--search: only the schedules, ZeRO stages, recompute policies and tensor parallelism "
                            "this framework has (picockpt/planning/frameworks.py names each one's source); default any")
    group.add_argument("--kernels", default="published", metavar="published|peak|FILE",
                       help="--search: how fast each matmul and attention kernel runs: published (the H100's "
                            "measured matmul ceiling and attention benchmarks, picockpt/planning/kernel_rates.py "
                            "names them; the default), peak (every kernel at the datasheet's rate: the roofline), "
                            "or a JSON table lessons/kernel_rates.py measured")
    group.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default="cudnn",
                       help="--search --kernels published: whose attention rates (cudnn, what sdpa picks on "
                            "Hopper; flash2; flash3); default cudnn")
    group.add_argument("--top", type=int, default=10,
                       help="--search: the fastest distinct tp x cp x pp x dp splits printed, each by its best "
                            "variant (default 10; --json too)")


def parse_tokens(text):
    number, unit = (text[:-1], text[-1].lower()) if text and text[-1].lower() in TOKEN_UNITS else (text, "")
    try:
        value = float(number) * TOKEN_UNITS[unit]
    except ValueError:
        value = 0
    if not value >= 1 or value == float("inf") or value != int(value):  # int(inf) would raise
        raise ValueError(f"--tokens-per-batch={text!r}: give a positive whole number of tokens, e.g. 16M (16 x 2**20) "
                         f"or 16777216")
    return int(value)


def check_search_flags(args):
    """--search chooses the layout: a layout flag beside it is refused, naming it; the search's flags need it."""
    if not args.search:
        given = [flag for flag, name in (("--gpus", "gpus"), ("--tokens-per-batch", "tokens_per_batch"))
                 if getattr(args, name) is not None] + (["--top"] if args.top != 10 else []) + \
            (["--framework"] if args.framework != "any" else []) + \
            (["--kernels"] if args.kernels != "published" else []) + \
            (["--attention-kernel"] if args.attention_kernel != "cudnn" else [])
        it = "it" if len(given) == 1 else "them"
        if given:
            raise ValueError(f"{', '.join(given)}: only --search reads {it}; add --search, or leave {it} out")
        return
    chosen = [flag for flag, name, default in CHOSEN if getattr(args, name) != default]
    it = "it" if len(chosen) == 1 else "them"
    if chosen:
        raise ValueError(f"{', '.join(chosen)} with --search: the search chooses {it} for every layout it ranks; leave "
                         f"{it} out (give --gpus, --tokens-per-batch, --seq, --gpu-gib)")
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
    if args.attention_kernel != "cudnn" and args.kernels != "published":
        raise ValueError(f"--attention-kernel {args.attention_kernel} with --kernels {args.kernels}: only the "
                         f"published rates have a choice of attention kernel; leave --attention-kernel out")


def kernel_hardware(args):
    """The --hardware with the kernel rates --kernels names (hw.kernels None: the roofline)."""
    hw = hardware(args.hardware)
    if args.kernels == "peak":
        return replace(hw, kernels=None)
    if args.kernels == "published":
        return replace(hw, kernels=published(hw.name, args.attention_kernel))
    return replace(hw, kernels=from_json(args.kernels))


def overlap_line(framework):
    """What the tensor-parallel collectives hide under, as the framework's model prices them (layout_time.Model)."""
    model = framework.model(FULL_MODEL)
    if not model.overlap:
        return "tensor-parallel collectives: every one exposed (no async or chunked overlap priced)"
    return ("tensor-parallel collectives: the backward's async ones under their GEMMs" + (
        ";\n  with sp the rest chunked under theirs (TransformerEngine's userbuffers, Megatron's --tp-comm-overlap)"
        if model.chunked_tp else ""))


def kernels_line(hw):
    """What the kernels run at, in one line (with its sources)."""
    if hw.kernels is None:
        return "every kernel at the datasheet's rate (the roofline): a ceiling, measured MFU sits below"
    return f"kernels at {hw.kernels.name} rates by shape:\n" + textwrap.fill(
        hw.kernels.source, 100, initial_indent="  (", subsequent_indent="   ") + ")"


def run_search(args, cfg):
    tokens, hw = parse_tokens(args.tokens_per_batch), kernel_hardware(args)
    capacity = gpu_bytes(args.gpu_gib)
    framework = FRAMEWORKS[args.framework]
    start = time.perf_counter()
    rows, considered = search(cfg, args.seq, args.gpus, tokens, capacity, hw, framework=framework)
    if not considered:  # nothing to rank: the count of GPUs, not their memory, is what fails
        raise ValueError(no_split_reason(cfg.replace(attention="fused"), args.seq, args.gpus, tokens, hw.node)
                         or f"--gpus {args.gpus:,}: every split of them leaves a stage without whole layers or "
                            f"chunks for the search's schedules; use fewer --gpus or more --tokens-per-batch")
    seconds = time.perf_counter() - start
    splits = distinct_splits(rows)
    published = published_for(args.preset, args.seq, args.gpus, tokens)
    if args.json:
        out = {"model": args.preset, "seq": args.seq, "gpus": args.gpus, "tokens_per_batch": tokens,
               "gpu_bytes": capacity, "hardware": hw.name, "kernels": kernels_line(hw),
               "tp_overlap": overlap_line(framework),
               "framework": framework.name, "considered": considered,
               "fit": len(rows), "distinct_splits": len(splits), "search_seconds": seconds, "top": args.top,
               "layouts": splits[:args.top]}
        if published:
            out["published"] = published_summary(splits, published)
        print(json.dumps(out, indent=1))
        return
    print(f"{args.preset} at {args.seq:,} tokens a sequence, {tokens:,} tokens a step on {args.gpus:,} {hw.name} "
          f"GPUs of {args.gpu_gib:g} GiB")
    if framework.name != "any":
        print(f"only the layouts {framework.name} can run (picockpt/planning/frameworks.py says which, with sources)")
    print(f"  ({hw.source})")
    print(f"{considered:,} layouts considered in {seconds:.1f} s, {len(rows):,} fit, {len(splits):,} distinct "
          f"tp x cp x pp x dp splits;")
    print(kernels_line(hw))
    print(overlap_line(framework))
    if not rows:
        print("no layout fits: add GPUs, raise --gpu-gib, or shorten --seq")
        return
    print(f"\nthe best variant of each of the {min(args.top, len(splits))} fastest splits:")
    print(HEADER)
    for i, row in enumerate(splits[:args.top], 1):
        print(f"{i:>2} " + _row_text(row))
    print(LEGEND)
    print("\n" + why_best(rows))
    if published:
        print(published_line(splits, published))


HEADER = (f" # {'tp':>2} {'cp':>3} {'pp':>3} {'dp':>4} sp {'Z':>6} {'sched':>5} {'M':>4} {'rc':>5} {'lay':>3} "
          f"{'GiB':>5} {'step':>5} {'MFU':>5}" + "".join(f"{short:>6}" for short in TERM_SHORT.values()))
LEGEND = "\n".join((
    "  sp: sequence parallel (y/n); Z: ZeRO stage (3+keep: FSDP keeping its gather); sched: 1f1b, i2/i4",
    "  interleaved V=2/4, zb ZB-H1; M: micro-batches; rc: recompute (none, cheap: norms and SwiGLU rebuilt,",
    "  full); lay: layers over stages (ev even, le lighter first and last); GiB: the busiest rank with the",
    "  reserve; step in s; then the terms of the step, in s, from its slowest stage:",
    "  " + ", ".join(f"{short} {term}" for term, short in TERM_SHORT.items())))
SCHEDULE_SHORT = {"1f1b": "1f1b", "zb-h1": "zb"}


def published_summary(splits, published):
    """{rank among distinct splits, ratio to the fastest, modelled and reported MFU, the variant} of Table 4's row."""
    rank, row = rank_of(splits, published[2])
    out = {"layout": dict(zip(("tp", "cp", "pp", "dp"), published[2])), "reported_mfu": published[4],
           "distinct_splits": len(splits), "rank": rank}
    if row is not None:
        out.update(ratio_to_fastest=row["step_seconds"] / splits[0]["step_seconds"], modelled_mfu=row["mfu"],
                   variant=row)
    return out


def published_line(splits, published):
    """Where the Llama 3 paper's own layout for this case ranks among the distinct splits, its step against the
    fastest, and its modelled MFU beside the reported one."""
    (tp, cp, pp, dp), reported = published[2], published[4]
    summary = published_summary(splits, published)
    head = f"the Llama 3 paper's layout here (Table 4): TP{tp} CP{cp} PP{pp} DP{dp}, {reported:.0%} BF16 MFU reported"
    if summary["rank"] is None:
        return head + ";\n  it does not fit in this model's memory"
    row = summary["variant"]
    schedule = row["schedule"] + (f" V={row['virtual_stages']}" if row["schedule"] == "interleaved" else "")
    return (head + f";\n  #{summary['rank']} of {len(splits):,} splits, {summary['ratio_to_fastest']:.2f}x the "
            f"fastest's step, modelled {row['mfu']:.1%} MFU;\n  its best variant: {'SP, ' if row['sp'] else ''}ZeRO "
            f"{row['zero']}, {schedule}, {row['microbatches']} micro-batches, {row['policy']}, {row['split']} layers")


def _row_text(row):
    schedule = f"i{row['virtual_stages']}" if row["schedule"] == "interleaved" else SCHEDULE_SHORT[row["schedule"]]
    return (f"{row['tp']:>2} {row['cp']:>3} {row['pp']:>3} {row['dp']:>4} {'y' if row['sp'] else 'n':>2} "
            f"{row['zero']:>6} {schedule:>5} {row['microbatches']:>4} {row['policy']:>5} "
            f"{'le' if row['split'] == 'lighter ends' else 'ev':>3} {row['peak_bytes'] / 2**30:>5.1f} "
            f"{row['step_seconds']:>5.2f} {row['mfu']:>5.1%}"
            + "".join(f"{row['terms_seconds'][t]:>6.2f}" for t in TERM_SHORT))


def why_best(rows):
    """The terms that decide: the best against the best of another tp x cp x pp split."""
    best = rows[0]
    other = next((r for r in rows if split_of(r)[:3] != split_of(best)[:3]), None)
    lines = [f"why the best wins: of its {best['step_seconds']:.2f} s, " + ", ".join(
        f"{t} {best['terms_seconds'][t] / best['step_seconds']:.0%}" for t in TERMS if best["terms_seconds"][t] > 0)]
    if other is not None:
        gaps = sorted(TERMS, key=lambda t: other["terms_seconds"][t] - best["terms_seconds"][t], reverse=True)
        lines.append(f"against the best other split (tp {other['tp']}, cp {other['cp']}, pp {other['pp']}: "
                     f"{other['step_seconds']:.2f} s), it saves " + ", ".join(
                         f"{(other['terms_seconds'][t] - best['terms_seconds'][t]):.2f} s of {t}" for t in gaps[:2]
                         if other["terms_seconds"][t] > best["terms_seconds"][t]))
    return "\n".join(lines)

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

from ..planning.frameworks import FRAMEWORKS
from ..planning.layout_search import TERMS, distinct_splits, no_split_reason, published_for, rank_of, search, split_of
from ..planning.layout_time import FULL_MODEL
from ..planning.published import GIB
from .predict_parallel import gpu_bytes, gpu_gib
from .predict_search_flags import kernel_hardware

TOKEN_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}  # 16M = 2048 sequences of 8,192 (powers of two)
TERM_SHORT = {"compute": "comp", "recompute": "recmp", "tp_comm": "tp", "cp_comm": "cp", "pp_comm": "pp",
              "bubble": "bubbl", "dp_exposed": "dp"}
TIME_UNITS = (("s", 1), ("ms", 1e-3), ("µs", 1e-6))  # the table's times in the largest unit the step is 1 or more of


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


def overlap_line(framework):
    """What the tensor-parallel collectives hide under, as the framework's model prices them (layout_time.Model)."""
    model = framework.model(FULL_MODEL)
    if not model.overlap:
        return "tensor-parallel collectives: every one exposed (no async or chunked overlap priced)"
    return ("tensor-parallel collectives: the backward's async ones under their GEMMs" + (
        ";\n  with sp the rest chunked under theirs (TransformerEngine's userbuffers, Megatron's --tp-comm-overlap)"
        if model.chunked_tp else ""))


def kernels_line(hw, left_out=False):
    """What the kernels run at, in one line (with its sources); left_out: --kernels was not given."""
    if hw.kernels is None:
        return "every kernel at the datasheet's rate (the roofline): a ceiling, measured MFU sits below" + (
            f";\n  no published kernel rates for the {hw.name} (--kernels FILE prices rates measured on one)"
            if left_out else "")
    return f"kernels at {hw.kernels.name} rates by shape:\n" + textwrap.fill(
        hw.kernels.source, 100, initial_indent="  (", subsequent_indent="   ") + ")"


def run_search(args, cfg):
    tokens, hw = parse_tokens(args.tokens_per_batch), kernel_hardware(args)
    capacity = gpu_bytes(gpu_gib(args))
    framework = FRAMEWORKS[args.framework]
    start = time.perf_counter()
    rows, considered = search(cfg, args.seq, args.gpus, tokens, capacity, hw, framework=framework)
    if not considered:  # nothing to rank: the count of GPUs, not their memory, is what fails
        raise ValueError(no_split_reason(cfg.replace(attention="fused"), args.seq, args.gpus, tokens, hw.node)
                         or f"--gpus {args.gpus:,}: every split of them leaves a stage without whole layers or "
                            f"chunks for the search's schedules; use fewer --gpus or more --tokens-per-batch")
    if not rows:  # a step that fits no layout is the user's to change, as any other refusal
        raise ValueError(f"no layout fits: each of the {considered:,} layouts of {args.gpus:,} GPUs needs more than "
                         f"{capacity / GIB:.2f} GiB on its busiest rank; add GPUs, raise --gpu-gib (an {hw.name} "
                         f"holds {hw.capacity / GIB:g}), or shorten --seq")
    seconds = time.perf_counter() - start
    splits = distinct_splits(rows)
    published = published_for(args.preset, args.seq, args.gpus, tokens)
    if args.json:
        out = {"model": args.preset, "seq": args.seq, "gpus": args.gpus, "tokens_per_batch": tokens,
               "gpu_bytes": capacity, "hardware": hw.name, "kernels": kernels_line(hw, args.kernels is None),
               "tp_overlap": overlap_line(framework),
               "framework": framework.name, "considered": considered,
               "fit": len(rows), "distinct_splits": len(splits), "search_seconds": seconds, "top": args.top,
               "layouts": splits[:args.top]}
        if published:
            out["published"] = published_summary(splits, published)
        print(json.dumps(out, indent=1))
        return
    print_header(args, tokens, hw, capacity, framework)
    print(f"{considered:,} layouts considered in {seconds:.1f} s, {len(rows):,} fit, {len(splits):,} distinct "
          f"tp x cp x pp x dp splits;")
    print(kernels_line(hw, args.kernels is None))
    print(overlap_line(framework))
    unit = time_unit(splits[0]["step_seconds"])  # the fastest step printed is 1 or more of it
    print(f"\nthe best variant of each of the {min(args.top, len(splits))} fastest splits:")
    print(HEADER)
    for i, row in enumerate(splits[:args.top], 1):
        print(f"{i:>2} " + _row_text(row, unit[1]))
    print(legend(unit[0]))
    print("\n" + why_best(rows, unit))
    if published:
        print(published_line(splits, published))


def print_header(args, tokens, hw, capacity, framework):
    """The case searched: model, batch, GPUs and their memory (where it comes from when --gpu-gib is left out)."""
    memory = f"{args.gpu_gib:g}" if args.gpu_gib is not None else f"{capacity / GIB:.2f}"
    print(f"{args.preset} at {args.seq:,} tokens a sequence, {tokens:,} tokens a step on {args.gpus:,} {hw.name} "
          f"GPUs of {memory} GiB")
    if args.gpu_gib is None:
        print(f"  (--gpu-gib left out: the memory the {hw.name}'s driver reports, of the {hw.capacity / GIB:g} GiB "
              f"its datasheet gives as GB)")
    if framework.name != "any":
        print(f"only the layouts {framework.name} can run (picockpt/planning/frameworks.py says which, with sources)")
    print(f"  ({hw.source})")


HEADER = (f" # {'tp':>2} {'cp':>3} {'pp':>3} {'dp':>4} sp {'Z':>6} {'sched':>5} {'M':>4} {'rc':>5} {'lay':>3} "
          f"{'GiB':>5} {'step':>5} {'MFU':>5}" + "".join(f"{short:>6}" for short in TERM_SHORT.values()))
SCHEDULE_SHORT = {"1f1b": "1f1b", "zb-h1": "zb"}


def legend(unit):
    """The table's abbreviations, and the unit its times are in."""
    return "\n".join((
        "  sp: sequence parallel (y/n); Z: ZeRO stage (3+keep: FSDP keeping its gather); sched: 1f1b, i2/i4",
        "  interleaved V=2/4, zb ZB-H1; M: micro-batches; rc: recompute (none, cheap: norms and SwiGLU rebuilt,",
        "  full); lay: layers over stages (ev even, le lighter first and last); GiB: the busiest rank with the",
        f"  reserve; step in {unit}; then the terms of the step, in {unit}, from its slowest stage:",
        "  " + ", ".join(f"{short} {term}" for term, short in TERM_SHORT.items())))


def time_unit(seconds):
    """(name, seconds in one) of the largest of s, ms and µs that `seconds` is 1 or more of (µs below that)."""
    return next((unit for unit in TIME_UNITS if seconds >= unit[1]), TIME_UNITS[-1])


def in_unit(seconds, scale):
    """`seconds` in a unit `scale` seconds long, in at most 5 characters: 2 decimals below 100, 1 below 1,000."""
    value = seconds / scale
    return f"{value:.2f}" if round(value, 2) < 100 else f"{value:.1f}" if round(value, 1) < 1000 else f"{value:.0f}"


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


def _row_text(row, scale):
    """One split's best variant, its times in a unit `scale` seconds long."""
    schedule = f"i{row['virtual_stages']}" if row["schedule"] == "interleaved" else SCHEDULE_SHORT[row["schedule"]]
    return (f"{row['tp']:>2} {row['cp']:>3} {row['pp']:>3} {row['dp']:>4} {'y' if row['sp'] else 'n':>2} "
            f"{row['zero']:>6} {schedule:>5} {row['microbatches']:>4} {row['policy']:>5} "
            f"{'le' if row['split'] == 'lighter ends' else 'ev':>3} {row['peak_bytes'] / 2**30:>5.1f} "
            f"{in_unit(row['step_seconds'], scale):>5} {row['mfu']:>5.1%}"
            + "".join(f"{in_unit(row['terms_seconds'][t], scale):>6}" for t in TERM_SHORT))


def why_best(rows, unit):
    """The terms that decide: the best against the best of another tp x cp x pp split (times in `unit`, a (name,
    seconds) of TIME_UNITS)."""
    best, (name, scale) = rows[0], unit
    other = next((r for r in rows if split_of(r)[:3] != split_of(best)[:3]), None)
    lines = [f"why the best wins: of its {in_unit(best['step_seconds'], scale)} {name}, " + ", ".join(
        f"{t} {best['terms_seconds'][t] / best['step_seconds']:.0%}" for t in TERMS if best["terms_seconds"][t] > 0)]
    if other is not None:
        gaps = sorted(TERMS, key=lambda t: other["terms_seconds"][t] - best["terms_seconds"][t], reverse=True)
        lines.append(f"against the best other split (tp {other['tp']}, cp {other['cp']}, pp {other['pp']}: "
                     f"{in_unit(other['step_seconds'], scale)} {name}), it saves " + ", ".join(
                         f"{in_unit(other['terms_seconds'][t] - best['terms_seconds'][t], scale)} {name} of {t}"
                         for t in gaps[:2] if other["terms_seconds"][t] > best["terms_seconds"][t]))
    return "\n".join(textwrap.fill(line, 105, subsequent_indent="  ") for line in lines)

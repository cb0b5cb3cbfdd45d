"""Which layout to train with: every split of G GPUs into tensor (tp), context (cp), pipeline (pp) and data (dp)
parallelism, with or without sequence parallelism, a ZeRO stage, a pipeline schedule, a split of the layers over the
stages and a recompute policy; every stage's memory from picockpt/planning/layout_memory.py, each step's time from the
terms below; the layouts that fit ranked by modelled step time.

A step (layout_time.py prices a micro-batch on one rank of a stage, term by term, each with its source: compute,
recompute, tp, cp and pp communication, and the data-parallel traffic that does not hide):
    bubble       step = M t_max + (p-1) t_mean / V: the slowest stage paces the M micro-batches, the fill and drain
                 pass once through every stage (V chunks a rank interleaved, Narayanan et al. 2021; ZB-H1: a third,
                 its W's fill the bubble, Qi et al. 2023); equal stages give cost.bubble_idle's share; every stage is
                 priced, and the data-parallel traffic left exposed on the worst stage adds to the step

Frameworks: search(framework=...) keeps only the choices one framework has (picockpt/planning/frameworks.py, each with
its source); the default, "any", is every choice above.

Placement: tp innermost, then cp, pp, dp outermost (the Llama 3 paper's order, [TP, CP, PP, DP]); a group's members
in a node (collectives.members_per_node) decide its links. Kernels run at the rates of the hardware's KernelRates
(kernel_rates.py: published H100 rates, or a table measured on the GPU). What the model leaves out, each only slowing
a real step: stragglers, the optimizer step's own time, kernel-launch gaps, overlap that slows what it hides under.
"""
import functools
import itertools

from .collectives import members_per_node
from ..model.config import BYTES
from .cost import layer_ops
from .frameworks import FRAMEWORKS
from ..parallel.layout import Layout
from .layout_memory import ZERO_STAGES, split_layers, splits_for, stage_bytes, stage_params
from .layout_time import FULL_MODEL, dp_exposed_seconds, microbatch_seconds

POLICIES = ("none", "cheap", "full")  # selective drops nothing under flash attention (lesson 13): it would repeat none
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1))
TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "bubble", "dp_exposed")


def check_search(cfg, seq, gpus, tokens, capacity, hw):
    """One-line ValueErrors naming the flag, before any work."""
    for flag, value in (("--gpus", gpus), ("--tokens-per-batch", tokens), ("--seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag}={value!r}: give a whole number, 1 or more")
    if tokens % seq:
        raise ValueError(f"--tokens-per-batch={tokens:,} is not a whole number of --seq={seq:,} sequences: use a "
                         f"multiple of {seq:,}, e.g. {max(1, tokens // seq) * seq:,}")
    if not capacity > 0 or capacity == float("inf"):
        raise ValueError("--gpu-gib: give a positive finite size of one GPU's memory, e.g. --gpu-gib 80")
    if hw.nvlink is None:
        raise ValueError(f"--hardware {hw.name}: one process has no links to price collectives over; use one of "
                         f"h100, h200, a100")
    if cfg.experts:
        raise ValueError(f"--experts {cfg.experts}: the search splits dense layers (expert parallelism is not in "
                         f"its space); use a dense model")
    if cfg.dropout:
        raise ValueError(f"--dropout {cfg.dropout:g} with --search: the search prices attention as a flash kernel "
                         f"(fused), which picockpt runs without dropout; leave --dropout out")


def no_split_reason(cfg, seq, gpus, tokens, node):
    """Why no (tp, cp, pp, dp) of `gpus` passes candidates(), with the largest power of two below that has one:
    a sentence for the error, or None when one does."""
    if next(candidates(cfg, seq, gpus, tokens, node), None) is not None:
        return None
    sequences, fewer = tokens // seq, 2 ** (gpus.bit_length() - 1)
    while fewer > 1 and next(candidates(cfg, seq, fewer, tokens, node), None) is None:
        fewer //= 2
    return (f"--gpus {gpus:,}: no split of them into tp x cp x pp x dp suits this model and batch (tp within a node "
            f"of {node} dividing the heads, K/V heads, ffn and vocab; cp with whole zigzag chunks of the {seq:,} "
            f"tokens; pp at most the {cfg.layers} layers; dp dividing the {sequences:,} sequences of "
            f"--tokens-per-batch); use e.g. --gpus {fewer:,}, or more --tokens-per-batch")


def divisors(n):
    """Every divisor of n, ascending, from its prime factors (trial division up to sqrt(n)): a count of GPUs as
    large as 2**40 takes microseconds, not a loop over 1..n."""
    factors, rest, p = {}, n, 2
    while p * p <= rest:
        while rest % p == 0:
            factors[p], rest = factors.get(p, 0) + 1, rest // p
        p += 1 if p == 2 else 2
    if rest > 1:
        factors[rest] = factors.get(rest, 0) + 1
    out = [1]
    for prime, power in factors.items():
        out = [d * prime ** k for d in out for k in range(power + 1)]
    return sorted(out)


def candidates(cfg, seq, gpus, tokens, node):
    """Every (tp, cp, pp, dp, microbatches) the model's shape allows: tp within a node dividing the heads, K/V heads,
    ffn and vocab; cp giving each rank whole zigzag chunks (seq % 2cp) that tp splits (sequence parallel); at most
    one stage a layer; dp dividing the batch's sequences, one sequence a micro-batch."""
    sequences = tokens // seq
    for tp in divisors(gpus):
        if tp > node or any(getattr(cfg, name) % tp for name in ("heads", "kv_heads", "ffn", "vocab")):
            continue
        for cp in divisors(gpus // tp):
            if seq % (2 * cp) or (seq // cp) % tp or (cp > 1 and cfg.attention == "eager"):
                continue
            for pp in divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if pp <= cfg.layers and sequences % dp == 0:
                    yield tp, cp, pp, dp, sequences // dp


def extreme_stages(counts):
    """Stage 0, the last, and the first and last of every run of stages with as many layers: along a run the stages
    differ only by their micro-batches in flight (fewer) and ZB-H1's waiting W's (more), both linear in s."""
    out = {0, len(counts) - 1}
    for s in range(1, len(counts)):
        if counts[s] != counts[s - 1]:  # a run ends at s - 1, the next begins at s
            out |= {s - 1, s}
    return sorted(out)


def evaluate(cfg, seq, gpus, tokens, capacity, hw, layout, zero, policy, split="even", model=FULL_MODEL):
    """One layout's row: its busiest rank's bytes, its modelled step and the terms that make it. layout: a Layout
    (tp, cp, pp, dp, microbatches, schedule, virtual_stages, sp); zero: its model state's layout, as frameworks
    hold it (layout_memory.ZERO_STAGES)."""
    tp, cp, pp, dp, M = layout.tp, layout.cp, layout.pp, layout.dp, layout.microbatches
    schedule, V, shards, sp = layout.schedule, layout.virtual_stages, dp * cp, layout.sp and tp > 1
    counts = split_layers(cfg.layers, pp, split)
    send_node = members_per_node(((2, tp * cp),), hw.node)
    dp_node = members_per_node(((cp, tp), (dp, tp * cp * pp)), hw.node)  # the dp x cp group's members in a node
    peaks, parts = {}, {}
    stages = range(pp) if model.stages else sorted({0, pp - 1})
    for s in extreme_stages(counts) if model.stages else stages:  # the busiest rank is one of these (linear in s)
        parts[s] = stage_bytes(cfg, seq, layout, counts, s, zero, policy, model.sharding,
                               split if model.stages else None)  # interleaved: the chunks walked in order
        peaks[s] = sum(parts[s].values())
    kinds = [(counts[s], s == 0, s == pp - 1) for s in stages]  # stages of one kind step alike: each computed once
    alike = {}
    for s, kind in zip(stages, kinds):
        if kind not in alike:
            t = dict(microbatch_seconds(cfg, seq, tp, sp, cp, counts[s], s == pp - 1, policy, hw, send_node, model))
            t["pp_comm"] = t["pp_comm"] * V if pp > 1 else 0.0
            alike[kind] = t, sum(v for k, v in t.items() if k != "forward"), dp_exposed_seconds(
                stage_params(cfg, tp, counts, s), zero, shards, M, t["forward"], 2 * t["forward"], hw, dp_node,
                counts[s], BYTES[cfg.dtype], policy, model)
    times, per_mb, dps = zip(*(alike[kind] for kind in kinds))  # each stage's
    slowest = max(range(len(times)), key=per_mb.__getitem__)
    paced = sum(per_mb) / len(per_mb) if model.stages else per_mb[slowest]  # the fill and drain's stage time
    fill = (pp - 1) * paced / (3 if schedule == "zb-h1" else V if schedule == "interleaved" else 1)
    dp_exposed = max(dps)
    step = M * per_mb[slowest] + fill + dp_exposed  # the pipeline, then the data-parallel traffic it leaves exposed
    model_flops = 3 * model_forward_flops(cfg, seq) * (tokens // seq)
    terms = {k: M * v for k, v in times[slowest].items() if k != "forward"}
    terms.update(bubble=fill, dp_exposed=dp_exposed)
    busiest = max(peaks, key=peaks.get)
    peak = peaks[busiest]
    return {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "sp": sp, "zero": zero, "schedule": schedule,
            "virtual_stages": V, "microbatches": M, "policy": policy, "split": split, "stage_layers": list(counts),
            "peak_bytes": peak, "fits": peak <= capacity, "busiest_stage": busiest,
            "peak_parts": parts[busiest], "stage_peak_bytes": {str(s): b for s, b in peaks.items()},
            "slowest_stage": list(stages)[slowest], "step_seconds": step,
            "mfu": model_flops / (gpus * hw.matmul * step),
            "tokens_per_second": tokens / step, "terms_seconds": terms}


@functools.lru_cache(maxsize=None)
def model_forward_flops(cfg, seq):
    """One sequence's forward matmul FLOPs: every layer's projections and the causal half of its attention square
    (what a flash kernel computes), and the LM head. Model FLOPs: no recompute counted (MFU's convention)."""
    ops = layer_ops(cfg.replace(attention="fused"), 1, seq, causal_skip=True)
    return cfg.layers * sum(op.flops for op in ops) + 2 * seq * cfg.hidden * cfg.vocab


def runs(cfg, cp, pp, dp, M, zero, schedule, V, split="even", model=FULL_MODEL):
    """Whether a split can take this ZeRO stage and schedule: ZeRO needs ranks to shard over; interleaving needs
    equal chunks, M a multiple of p and the layers in whole chunks: L % (p V) == 0 for the even split (Megatron's
    virtual stages), (L + 2) % (p V) == 0 for the lighter ends, where the embedding and the head each take a
    layer's place (the Llama 3 paper, sec. 3.3.2: its first chunk holds only the embedding, its last only the output
    projection and the loss); ZB-H1 at least p micro-batches."""
    if zero != "0" and dp * cp == 1 or pp == 1 and schedule != "1f1b":
        return False
    if schedule == "interleaved" and not model.stages:
        return M % pp == 0 and cfg.layers >= pp * V
    if schedule == "interleaved":
        return M % pp == 0 and (cfg.layers + (2 if split == "lighter ends" else 0)) % (pp * V) == 0
    return schedule != "zb-h1" or M >= pp


def search(cfg, seq, gpus, tokens, capacity, hw, policies=POLICIES, zero_stages=ZERO_STAGES, schedules=SCHEDULES,
           model=FULL_MODEL, framework=FRAMEWORKS["any"]):
    """(every layout that fits, best first; how many were considered). Attention is priced as a flash kernel; model:
    which corrections are on (layout_time.Model); framework: the choices it allows (frameworks.py)."""
    check_search(cfg, seq, gpus, tokens, capacity, hw)  # before the fused attention that dropout would refuse
    cfg = cfg.replace(attention="fused", max_seq=max(cfg.max_seq, seq))
    model = framework.model(model)
    rows, considered = [], 0
    for (tp, cp, pp, dp, M), zero, (schedule, V), policy in itertools.product(
            candidates(cfg, seq, gpus, tokens, hw.node), zero_stages, schedules, policies):
        if not framework.allows(schedule, zero, policy):
            continue
        splits = splits_for(cfg.layers, pp) if model.stages else ("even",)
        sps = ((True, False) if model.overlap else (True,)) if tp > 1 else (False,)
        sps = tuple(sp for sp in sps if tp == 1 or framework.allows(sp=sp))
        for split, sp in itertools.product(splits, sps):
            if not runs(cfg, cp, pp, dp, M, zero, schedule, V, split, model):
                continue
            considered += 1
            layout = Layout(dp, pp, tp, cp=cp, microbatches=M, schedule=schedule, virtual_stages=V, sp=sp)
            row = evaluate(cfg, seq, gpus, tokens, capacity, hw, layout, zero, policy, split, model)
            if row["fits"]:
                rows.append(row)
    rows.sort(key=lambda r: (r["step_seconds"], r["peak_bytes"]))
    return rows, considered


def split_of(row):
    return row["tp"], row["cp"], row["pp"], row["dp"]


def distinct_splits(rows):
    """The best variant of each (tp, cp, pp, dp) split, in the order of `rows`."""
    best = {}
    for row in rows:
        best.setdefault(split_of(row), row)
    return list(best.values())


# The Llama 3 paper (Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 4): 405B on H100 80 GB, 16M tokens
# a step. (GPUs, seq, (tp, cp, pp, dp), reported TFLOPs a GPU, reported BF16 MFU).
LLAMA3_405B_TABLE_4 = ((8192, 8192, (8, 1, 16, 64), 430, 0.43), (16384, 8192, (8, 1, 16, 128), 400, 0.41),
                       (16384, 131072, (8, 16, 16, 8), 380, 0.38))


def published_for(model, seq, gpus, tokens):
    """The Table 4 row of this case, or None."""
    if model != "llama3-405b" or tokens != 2**24:
        return None
    return next((row for row in LLAMA3_405B_TABLE_4 if row[:2] == (gpus, seq)), None)


def rank_of(rows, layout):
    """(rank from 1, row) of the best-ranked variant of a (tp, cp, pp, dp) split among `rows`, or (None, None):
    among distinct splits when `rows` is distinct_splits()."""
    return next(((i, row) for i, row in enumerate(rows, 1) if split_of(row) == layout), (None, None))

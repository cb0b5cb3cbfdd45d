"""Which layout to train with: every split of G GPUs into tensor (tp), context (cp), pipeline (pp) and data (dp)
parallelism, with or without sequence parallelism, a ZeRO stage, a pipeline schedule, a split of the layers over the
stages and a recompute policy; every stage's memory from picockpt/layout_memory.py, each step's time from the terms
below; the layouts that fit ranked by modelled step time.

A micro-batch on one rank of a stage (every stage is priced; the pipeline is paced by the slowest):
    compute      the stage's layers (and the head on the last), forward F by the roofline (cost.py), backward 2F, and
                 every micro-batch each weight gradient accumulated into its fp32 buffer: the weight-gradient GEMM
                 reads and writes 8 bytes a parameter (Megatron's gradient_accumulation_fusion,
                 fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 into main_grad; FSDP2 accumulates unsharded
                 gradients in its fp32 reduce dtype too), memory-bound when a micro-batch's rows are few
    recompute    none; cheap: the norms' outputs and SwiGLU's product rebuilt, by their bytes; full: the whole forward
                 again, with its tensor- and context-parallel collectives (Megatron's and torch's full recompute rerun
                 the layer from its input)
    tp           two blocks a layer, each a column-parallel then a row-parallel linear (Megatron-LM's
                 megatron/core/tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication):
                   with sequence parallelism: forward an all-gather before and a reduce-scatter after (exposed);
                   backward the output gradient's all-gather (exposed), the input's all-gather again for the weight
                   gradient, launched async under the input-gradient GEMM, and the input gradient's reduce-scatter
                   launched async under the weight-gradient GEMM (each exposed only by what it outlasts them)
                   without: forward one all-reduce after (exposed); backward the column-parallel input gradient's
                   all-reduce, launched async under the weight-gradient GEMM
    cp           an all-gather of the layer's K/V over the cp ranks (the Llama 3 paper's choice) in the forward,
                 again in the backward and in a full recompute, and a reduce-scatter of their gradients (exposed)
    pp           per micro-batch, the two blocking exchanges of 1F1B's steady state (Megatron's p2p_communication.py:
                 send_forward_recv_backward, send_backward_recv_forward), each one activation's send with its NCCL
                 latency; V times under interleaving: the per-micro-batch overhead a pipeline pays
    bubble       step = M t_max + (p-1) t_mean / V: the slowest stage paces the M micro-batches, the fill and drain
                 pass once through every stage (V chunks a rank interleaved, Narayanan et al. 2021; ZB-H1: a third,
                 its W's fill the bubble, Qi et al. 2023); equal stages give cost.bubble_idle's share
    dp           over the dp x cp ranks that hold the same weights (torchtitan's dp_shard_cp), one collective a layer
                 (collectives.per_layer_seconds), gradients reduced in fp32, weights gathered in bf16 (torchtitan's
                 mixed-precision defaults): ZeRO 0 an all-reduce, 1 and 3+keep a reduce-scatter, hidden behind the
                 last micro-batch's backward, and a gather behind the first forward; ZeRO 2 a reduce-scatter every
                 micro-batch behind its backward; ZeRO 3 every micro-batch two gathers (forward, backward: a
                 recompute nested inside FSDP's unit shares the backward's, torchtitan's fully_shard(checkpoint(block)))
                 and a reduce-scatter. Each collective is exposed by what it outlasts the compute it hides behind.

Placement: tp innermost, then cp, pp, dp outermost (the Llama 3 paper's order, [TP, CP, PP, DP]); a group's members
in a node (collectives.members_per_node) decide its links. What the model leaves out: kernel efficiency below the
datasheet (its MFU is a ceiling), stragglers, the optimizer step's own time, kernel-launch gaps.
"""
import functools
import itertools
from dataclasses import dataclass

from .collectives import algorithm_seconds, collective_seconds, members_per_node, per_layer_seconds
from .config import BYTES
from .cost import head_ops, layer_ops, rebuild_seconds, roofline_seconds
from .closed_forms import layer_inventory
from .layout_memory import ZERO_STAGES, split_layers, splits_for, stage_bytes, stage_params
from .schedule import OP_LEVEL

POLICIES = ("none", "cheap", "full")  # selective drops nothing under flash attention (lesson 13): it would repeat none
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1))
REDUCE_BYTES = 4  # gradients reduced in fp32 and weights gathered in the compute dtype: torchtitan's defaults
#                   (mixed_precision_reduce = "float32", mixed_precision_param = "bfloat16")
TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "bubble", "dp_exposed")


@dataclass(frozen=True)
class Model:
    """Which of the model's corrections are on (all, by default); each off gives back the simpler model it replaced,
    so a lesson can show what each one moves:
        topology   collectives by topology, NCCL's choice of ring, tree or PAT, FSDP's one collective a layer;
                   off: every group that leaves a node a ring at one NIC a member, one collective a stage
        sharding   each ZeRO stage's bytes and traffic as frameworks hold and move them (layout_memory.py), and the
                   reserve; off: 16 bytes of fp32 state a parameter sharded by stage, 16-bit copies beside them (fp32
                   under 3+keep), ZeRO 2's gradients reduced once, ZeRO 3 gathering again for a full recompute
        recompute  full recomputation reruns the whole forward; off: the forward less the down projection
        stages     every stage priced, the lighter-ends split, interleaving over whole chunks only; off: the even
                   split, stage 0 and the last alone, interleaving wherever p V <= L
        overlap    Megatron's async backward tensor-parallel collectives, and layouts without sequence parallelism;
                   off: every tensor-parallel collective exposed, sequence parallelism always
        accumulation  every micro-batch's weight gradients accumulated into fp32 (8 bytes a parameter read and
                   written); off: the weight-gradient GEMM writes its 16-bit output once"""
    topology: bool = True
    sharding: bool = True
    recompute: bool = True
    stages: bool = True
    overlap: bool = True
    accumulation: bool = True


FULL_MODEL = Model()
ACCUMULATOR_BYTES = 4  # the fp32 gradient buffer a weight-gradient GEMM adds into (Megatron's main_grad)


def accumulation_seconds(ops, weights, e, hw):
    """What accumulating the weight gradients into fp32 adds to the backward of `ops`: each weight-gradient GEMM
    reads and writes its accumulator (2 x 4 bytes a weight) where a plain one writes e bytes, by the roofline.
    weights: {op name: (weights of each of its kernels, ...)}."""
    extra = 0.0
    for op in ops:
        for (flops, nbytes), count in zip(op.kernels, weights.get(op.name, ())):
            accumulating = nbytes + (2 * ACCUMULATOR_BYTES - e) * count
            extra += max(flops / hw.matmul, accumulating / hw.memory) - max(flops / hw.matmul, nbytes / hw.memory)
    return extra


def weight_counts(cfg, tp):
    """{op name: weights of each matmul kernel} of a layer and the head, on one of tp ranks (as layer_ops splits)."""
    h, q, kv, f = cfg.hidden, cfg.heads * cfg.head_dim // tp, cfg.kv_heads * cfg.head_dim // tp, cfg.ffn // tp
    return {"qkv": (h * q, h * kv, h * kv), "o_proj": (q * h,), "gate_up": (h * f, h * f), "down": (f * h,),
            "logits": (h * cfg.vocab // tp,)}


def group_seconds(kind, nbytes, ranks, hw, per_node, model=FULL_MODEL, layers=1):
    """`layers` collectives of nbytes / layers over `ranks` GPUs (per_node of them in a node), by the model's rules."""
    if ranks <= 1 and kind != "p2p":
        return 0.0
    if kind == "p2p":
        return collective_seconds(kind, nbytes, ranks, hw, per_node)
    if model.topology:
        return per_layer_seconds(kind, nbytes, layers, ranks, hw, per_node)
    return algorithm_seconds(kind, nbytes, ranks, hw, 1 if per_node < ranks else ranks)["ring"]


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


@functools.lru_cache(maxsize=None)
def microbatch_seconds(cfg, seq, tp, sp, cp, layers, last, policy, hw, send_node, model=FULL_MODEL):
    """{term: seconds} of one micro-batch's forward, backward and recompute on one rank of a stage of `layers` layers
    (the head if last); "forward" its forward alone. send_node: 2 when the next stage is in the same node, else 1."""
    e, n, h = BYTES[cfg.dtype], seq // cp, cfg.hidden
    sp = sp and tp > 1
    layer_kernels = layer_ops(cfg, 1, seq, tp, sp, cp, causal_skip=True)
    head_kernels = head_ops(cfg, 1, n, tp, sp) if last else ()
    ops = {op.name: roofline_seconds(op, hw) for op in layer_kernels}
    layer = sum(v for name, v in ops.items() if name != "probs")
    head = sum(roofline_seconds(op, hw) for op in head_kernels)
    weights = weight_counts(cfg, tp)
    accumulate = (layers * accumulation_seconds(layer_kernels, weights, e, hw)
                  + accumulation_seconds(head_kernels, weights, e, hw)) if model.accumulation else 0.0
    block = n * h * e  # one block's input or output, the rank's n tokens
    tp_forward = tp_backward = 0.0
    if tp > 1:
        for column in ("qkv", "gate_up"):  # a block: its column-parallel GEMM's backward hides what it can
            hide = ops[column] if model.overlap else 0.0  # the input- and weight-gradient GEMMs: as long as F's
            if sp:
                gather = group_seconds("all_gather", block, tp, hw, tp, model)
                scatter = group_seconds("reduce_scatter", block, tp, hw, tp, model)
                tp_forward += gather + scatter
                tp_backward += gather + max(0.0, gather - hide) + max(0.0, scatter - hide)
            else:
                reduce = group_seconds("all_reduce", block, tp, hw, tp, model)
                tp_forward += reduce
                tp_backward += max(0.0, reduce - hide)
    kv = 2 * seq * cfg.kv_heads // tp * cfg.head_dim * e  # K and V of the whole sequence, this rank's heads
    cp_node = members_per_node(((cp, tp),), hw.node)
    cp_ag = group_seconds("all_gather", kv, cp, hw, cp_node, model)
    cp_rs = group_seconds("reduce_scatter", kv, cp, hw, cp_node, model)
    cheap = rebuild_seconds(ops, set(layer_inventory(cfg, 1, n)) & OP_LEVEL["cheap"])  # norms, SwiGLU again
    rebuild = {"none": 0.0, "cheap": cheap, "full": layer if model.recompute else layer - ops["down"]}[policy]
    reruns = 1 if policy == "full" else 0  # a full recompute runs the forward's collectives again
    send = group_seconds("p2p", block // (tp if sp else 1), 2, hw, send_node, model)
    forward = layers * layer + head
    return {"compute": 3 * forward + accumulate, "recompute": layers * rebuild,
            "tp_comm": layers * (tp_forward * (1 + reruns) + tp_backward),
            "cp_comm": layers * (cp_ag * (2 + reruns) + cp_rs), "pp_comm": 2 * send, "forward": forward}


def extreme_stages(counts):
    """Stage 0, the last, and the first and last of every run of stages with as many layers: along a run the stages
    differ only by their micro-batches in flight (fewer) and ZB-H1's waiting W's (more), both linear in s."""
    out = {0, len(counts) - 1}
    for s in range(len(counts)):
        if s == 0 or counts[s] != counts[s - 1]:
            out.add(s)
        if s == len(counts) - 1 or counts[s] != counts[s + 1]:
            out.add(s)
    return sorted(out)


@functools.lru_cache(maxsize=2**16)
def dp_exposed_seconds(params, zero, shards, microbatches, forward, backward, hw, per_node, layers=1, e=2,
                       policy="none", model=FULL_MODEL):
    """Gradient and weight traffic over the `shards` ranks that hold the same weights (per_node of them in a node),
    one collective a layer, less what hides (the module's docstring)."""
    if shards == 1:
        return 0.0
    grads = params * REDUCE_BYTES
    ar, rs, ag = (group_seconds(kind, nbytes, shards, hw, per_node, model, layers if model.topology else 1)
                  for kind, nbytes in (("all_reduce", grads), ("reduce_scatter", grads), ("all_gather", params * e)))
    if zero == "0":
        return max(0.0, ar - backward)
    if zero in ("1", "3+keep") or zero == "2" and not model.sharding:
        return max(0.0, rs - backward) + max(0.0, ag - forward)
    if zero == "2":
        return microbatches * max(0.0, rs - backward) + max(0.0, ag - forward)
    gathers = 3 if policy == "full" and not model.sharding else 2
    return microbatches * (max(0.0, ag - forward) + (gathers - 1) * max(0.0, ag - backward) + max(0.0, rs - backward))


def evaluate(cfg, seq, gpus, tokens, capacity, hw, tp, cp, pp, dp, M, zero, schedule, V, policy, sp=True,
             split="even", model=FULL_MODEL):
    """One layout's row: its busiest rank's bytes, its modelled step and the terms that make it."""
    shards, sp = dp * cp, sp and tp > 1
    counts = split_layers(cfg.layers, pp, split)
    send_node = members_per_node(((2, tp * cp),), hw.node)
    dp_node = members_per_node(((cp, tp), (dp, tp * cp * pp)), hw.node)  # the dp x cp group's members in a node
    peaks, parts, times, dps = {}, {}, [], []
    stages = range(pp) if model.stages else sorted({0, pp - 1})
    for s in extreme_stages(counts) if model.stages else stages:  # the busiest rank is one of these (linear in s)
        parts[s] = stage_bytes(cfg, seq, tp, sp, cp, counts, s, M, zero, shards, schedule, V, policy, model.sharding)
        peaks[s] = sum(parts[s].values())
    for s in stages:
        t = dict(microbatch_seconds(cfg, seq, tp, sp, cp, counts[s], s == pp - 1, policy, hw, send_node, model))
        t["pp_comm"] = t["pp_comm"] * V if pp > 1 else 0.0
        times.append(t)
        dps.append(dp_exposed_seconds(stage_params(cfg, tp, counts, s), zero, shards, M, t["forward"],
                                      2 * t["forward"], hw, dp_node, counts[s], BYTES[cfg.dtype], policy, model))
    per_mb = [sum(v for k, v in t.items() if k != "forward") for t in times]
    slowest = max(range(len(times)), key=per_mb.__getitem__)
    paced = sum(per_mb) / len(per_mb) if model.stages else per_mb[slowest]  # the fill and drain's stage time
    fill = (pp - 1) * paced / (3 if schedule == "zb-h1" else V if schedule == "interleaved" else 1)
    pipeline = M * per_mb[slowest] + fill
    dp_exposed = max(dps)
    step = pipeline + dp_exposed
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
           model=FULL_MODEL):
    """(every layout that fits, best first; how many were considered). Attention is priced as a flash kernel; model:
    which corrections are on (Model)."""
    cfg = cfg.replace(attention="fused", max_seq=max(cfg.max_seq, seq))
    check_search(cfg, seq, gpus, tokens, capacity, hw)
    rows, considered = [], 0
    for (tp, cp, pp, dp, M), zero, (schedule, V), policy in itertools.product(
            candidates(cfg, seq, gpus, tokens, hw.node), zero_stages, schedules, policies):
        splits = splits_for(cfg.layers, pp) if model.stages else ("even",)
        sps = ((True, False) if model.overlap else (True,)) if tp > 1 else (False,)
        for split, sp in itertools.product(splits, sps):
            if not runs(cfg, cp, pp, dp, M, zero, schedule, V, split, model):
                continue
            considered += 1
            row = evaluate(cfg, seq, gpus, tokens, capacity, hw, tp, cp, pp, dp, M, zero, schedule, V, policy, sp,
                           split, model)
            if row["fits"]:
                rows.append(row)
    rows.sort(key=lambda r: (r["step_seconds"], r["peak_bytes"]))
    return rows, considered


def split_of(row):
    return row["tp"], row["cp"], row["pp"], row["dp"]


def distinct_splits(rows):
    """The best variant of each (tp, cp, pp, dp) split, in the order of `rows`."""
    seen, out = set(), []
    for row in rows:
        if split_of(row) not in seen:
            seen.add(split_of(row))
            out.append(row)
    return out


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

"""Which layout to train with: every split of G GPUs into tensor (tp), context (cp), pipeline (pp) and data (dp)
parallelism, with a ZeRO stage, a pipeline schedule and a recompute policy, each rank's memory from picockpt's closed
forms and each step's time from picockpt/cost.py, the layouts that fit ranked by modelled step time.

A step of one rank, per micro-batch, in the equal-time pipeline model:
    compute      the stage's layers (and the head on the last stage), forward F by the roofline, backward 2F
                 (each matmul's backward is two of its size), recompute under the policy (full: F less the down
                 projection each layer; cheap: the norms' outputs and SwiGLU's product rebuilt, by their bytes)
    tp           sequence parallel: an all-gather before and a reduce-scatter after each block, the reverse pair in
                 the backward and the block's input gathered again for its weight gradients (Korthikanti et al.
                 2022, sec. 4.2.2; picockpt's Crossings.regather), the forward's pair again in a full recompute,
                 over NVLink inside a node (exposed: not overlapped)
    cp           an all-gather of the layer's K/V over the cp ranks (the Llama 3 paper's choice) in the forward,
                 again in the backward (picockpt's default: the gathered K/V are not kept) and in a full recompute,
                 and a reduce-scatter of their gradients (exposed)
    pp           a send of the stage's output and one of its input's gradient, V times under interleaving (exposed)
    bubble       the pipeline is paced by its slowest stage: step = t_mb (M + (p-1)/V) (cost.bubble_idle); ZB-H1
                 (B and W apart, W as long as F and B) t_mb (M + (p-1)/3), holding s waiting W's on stage s
    dp           gradients reduce-scattered (fp32) and parameters all-gathered (16-bit) over the dp x cp ranks that
                 hold the same weights (torchtitan's dp_shard_cp and mixed-precision defaults), hidden behind the last micro-batch's backward and the first's
                 forward; ZeRO-3 gathers every micro-batch again unless the stage keeps them ("3+keep")
and the memory of the busiest ranks (stage 0: most layers, embedding, the most micro-batches in flight; the last
stage: the head and its logits): model state (16 bytes a parameter, ZeRO-sharded), the 16-bit weights the step
computes with, the store's peak (pipeline_parallel/pp_inventory.py's StageForms on the rank's seq/cp tokens; an
interleaved stage 0 holds 1 + (p-1)/(p V) times 1F1B's: Korthikanti et al. 2022, sec. 4.2.3).

Placement: tp innermost, then cp, pp, dp outermost (the Llama 3 paper's order, [TP, CP, PP, DP]): a group of n
ranks s apart leaves its node when n s exceeds the node, and its ring then runs at the network's rate. What the model leaves out: kernel efficiency below the datasheet
(its MFU is a ceiling), overlap of tp/cp communication, stragglers, the optimizer step's own time.
"""
import functools
import itertools

from .closed_forms import layer_inventory
from .config import BYTES
from .collectives import collective_seconds, members_per_node, per_layer_seconds
from .cost import bubble_idle, head_ops, layer_ops, rebuild_seconds, roofline_seconds
from .schedule import OP_LEVEL
from .parallel.pipeline_parallel.pp_inventory import StageForms
from .parallel.pipeline_parallel.pp_orders import w_pending_bytes
from .parallel.pipeline_parallel.pp_schedules import stage_layers

POLICIES = ("none", "cheap", "full")  # selective drops nothing under flash attention (lesson 13): it would repeat none
ZERO_STAGES = ("0", "1", "2", "3", "3+keep")
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1))
STATE_BYTES = {"param": 4, "grad": 4, "optimizer": 8}  # fp32 master weights and gradients, AdamW's two moments
REDUCE_BYTES = 4  # gradients reduced in fp32 and weights gathered in the compute dtype: torchtitan's defaults
#                   (mixed_precision_reduce = "float32", mixed_precision_param = "bfloat16")


def check_search(cfg, seq, gpus, tokens, capacity, hw):
    """One-line ValueErrors naming the flag, before any work."""
    for flag, value in (("--gpus", gpus), ("--tokens-per-batch", tokens), ("--seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag}={value!r}: give a whole number, 1 or more")
    if tokens % seq:
        raise ValueError(f"--tokens-per-batch={tokens:,} is not a whole number of --seq={seq:,} sequences: use a "
                         f"multiple of {seq:,}, e.g. {max(1, tokens // seq) * seq:,}")
    if not capacity > 0 or capacity == float("inf"):
        raise ValueError(f"--gpu-gib: give a positive finite size of one GPU's memory, e.g. --gpu-gib 80")
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


def stage_params(cfg, tp, stage, pp):
    """Parameters one rank of `stage` holds: its layers' matrices split tp ways (norms whole), the embedding on
    stage 0, the final norm and LM head on the last (vocab-parallel)."""
    h, hd = cfg.hidden, cfg.head_dim
    matrices = h * cfg.heads * hd * 2 + 2 * h * cfg.kv_heads * hd + 3 * h * cfg.ffn
    layers = len(stage_layers(cfg.layers, pp)[stage])
    vocab = cfg.vocab * h // tp
    return (layers * (matrices // tp + 2 * h) + (vocab if stage == 0 else 0)
            + (vocab * (1 if cfg.tie_embeddings and pp == 1 else 0 if cfg.tie_embeddings else 1) + h
               if stage == pp - 1 else 0))


def model_state_bytes(params, zero, shards):
    """Bytes of fp32 weights, gradients and AdamW's moments: ZeRO 1 shards the moments over `shards` ranks, 2 the
    gradients too, 3 the weights too (Rajbhandari et al. 2020)."""
    p, g, o = STATE_BYTES["param"], STATE_BYTES["grad"], STATE_BYTES["optimizer"]
    stage = int(zero[0])
    return params * (p / (shards if stage >= 3 else 1) + g / (shards if stage >= 2 else 1)
                     + o / (shards if stage >= 1 else 1))


@functools.lru_cache(maxsize=None)
def stage_activation_bytes(cfg, seq, tp, cp, pp, microbatches, policy, stage):
    """The store's peak of one rank of `stage` under 1F1B (StageForms, on seq/cp tokens, sequence parallel)."""
    return StageForms(cfg, microbatches, seq // cp, policy, pp, microbatches, "1f1b", stage, 1, tp, tp > 1).peak_bytes


@functools.lru_cache(maxsize=None)
def microbatch_seconds(cfg, seq, tp, cp, pp, stage, policy, hw):
    """{term: seconds} of one micro-batch's forward, backward and recompute on one rank of `stage`."""
    e, n, h = BYTES[cfg.dtype], seq // cp, cfg.hidden
    ops = {op.name: roofline_seconds(op, hw) for op in layer_ops(cfg, 1, seq, tp, tp > 1, cp, causal_skip=True)}
    layer = sum(v for name, v in ops.items() if name != "probs")
    layers = len(stage_layers(cfg.layers, pp)[stage])
    head = sum(roofline_seconds(op, hw) for op in head_ops(cfg, 1, n, tp, tp > 1)) if stage == pp - 1 else 0.0
    cheap = rebuild_seconds(ops, set(layer_inventory(cfg, 1, n)) & OP_LEVEL["cheap"])  # norms, SwiGLU again
    rebuild = {"none": 0.0, "cheap": cheap, "full": layer - ops["down"]}[policy]
    reruns = 1 if policy == "full" else 0  # a full recompute runs the forward's collectives again
    block = n * h * e  # one block's input or output, the whole sequence's n tokens
    gather = collective_seconds("all_gather", block, tp, hw, tp)  # tp stays inside a node (candidates)
    tp_pair = gather + collective_seconds("reduce_scatter", block, tp, hw, tp)
    kv = 2 * seq * cfg.kv_heads // tp * cfg.head_dim * e  # K and V of the whole sequence, this rank's heads
    cp_node = members_per_node(((cp, tp),), hw.node)
    cp_ag = collective_seconds("all_gather", kv, cp, hw, cp_node)
    cp_rs = collective_seconds("reduce_scatter", kv, cp, hw, cp_node)
    send = collective_seconds("p2p", block // tp, 2, hw, members_per_node(((2, tp * cp),), hw.node)) if pp > 1 else 0.0
    forward = layers * layer + head
    return {"compute": 3 * forward, "recompute": layers * rebuild,
            "tp_comm": layers * 2 * (tp_pair * (2 + reruns) + gather) if tp > 1 else 0.0,  # + the input regathered
            "cp_comm": layers * (cp_ag * (2 + reruns) + cp_rs) if cp > 1 else 0.0,
            "pp_comm": 2 * send, "forward": forward}


def dp_exposed_seconds(params, zero, shards, microbatches, policy, forward, backward, hw, per_node, e=2, layers=1):
    """Gradient and weight traffic over the `shards` ranks that hold the same weights (per_node of them in a node),
    less what hides: gradients reduced in fp32, weights gathered in the compute dtype (e bytes), one collective a
    layer (collectives.per_layer_seconds)."""
    if shards == 1:
        return 0.0
    nbytes = params * REDUCE_BYTES
    ar = per_layer_seconds("all_reduce", nbytes, layers, shards, hw, per_node)
    rs = per_layer_seconds("reduce_scatter", nbytes, layers, shards, hw, per_node)
    ag = per_layer_seconds("all_gather", params * e, layers, shards, hw, per_node)
    if zero == "0":
        return max(0.0, ar - backward)  # all-reduced behind the last micro-batch's backward
    if zero != "3":  # 1, 2, 3+keep: one reduce-scatter behind the last backward, one gather before the first forward
        return max(0.0, rs - backward) + max(0.0, ag - forward)
    gathers = 3 if policy == "full" else 2  # forward, backward (and the recompute) of every micro-batch
    return microbatches * (max(0.0, ag - forward) + (gathers - 1) * max(0.0, ag - backward) + max(0.0, rs - backward))


def evaluate(cfg, seq, gpus, tokens, capacity, hw, tp, cp, pp, dp, M, zero, schedule, V, policy):
    """One layout's row: its busiest rank's bytes, its modelled step and the terms that make it."""
    shards = dp * cp
    stages = sorted({0, pp - 1})  # the busiest: stage 0 (layers, embedding, in flight) and the last (the head)
    peaks, times = {}, {}
    for s in stages:
        params = stage_params(cfg, tp, s, pp)
        layers = len(stage_layers(cfg.layers, pp)[s])
        weights = 2 * (params if zero != "3" else min(2, layers) * params // max(1, layers))  # 16-bit copies
        if zero == "3+keep":
            weights += STATE_BYTES["param"] * params  # the stage's gathered fp32 weights, kept
        act = stage_activation_bytes(cfg, seq, tp, cp, pp, M, policy, s)
        if schedule == "interleaved" and s == 0:
            act = int(act * (1 + (pp - 1) / (pp * V)))
        if schedule == "zb-h1":  # stage s also holds what its s waiting W's read (pp_orders.py)
            act += s * layers * w_pending_bytes(cfg, 1, seq // cp, tp)
        kv = 2 * seq * cfg.kv_heads // tp * cfg.head_dim * BYTES[cfg.dtype] if cp > 1 else 0  # one layer's gather
        peaks[s] = int(model_state_bytes(params, zero, shards)) + weights + act + kv
        times[s] = microbatch_seconds(cfg, seq, tp, cp, pp, s, policy, hw)
    for s in stages:  # interleaved: a micro-batch crosses V times as many stage boundaries (V chunks a rank)
        times[s] = {**times[s], "pp_comm": times[s]["pp_comm"] * V}
    slowest = max(stages, key=lambda s: sum(v for k, v in times[s].items() if k != "forward"))
    t = times[slowest]
    per_mb = sum(v for k, v in t.items() if k != "forward")
    idle = bubble_idle(pp, M, schedule, V)
    pipeline = M * per_mb / (1 - idle)
    per_node = members_per_node(((cp, tp), (dp, tp * cp * pp)), hw.node)  # the dp x cp group's members in a node
    dp_exposed = dp_exposed_seconds(stage_params(cfg, tp, slowest, pp), zero, shards, M, policy, t["forward"],
                                    2 * t["forward"], hw, per_node, BYTES[cfg.dtype],
                                    len(stage_layers(cfg.layers, pp)[slowest]))
    step = pipeline + dp_exposed
    model_flops = 3 * model_forward_flops(cfg, seq) * (tokens // seq)
    terms = {k: M * v for k, v in t.items() if k != "forward"}
    terms.update(bubble=pipeline - M * per_mb, dp_exposed=dp_exposed)
    peak = max(peaks.values())
    return {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "zero": zero, "schedule": schedule, "virtual_stages": V,
            "microbatches": M, "policy": policy, "peak_bytes": peak, "fits": peak <= capacity,
            "stage_peak_bytes": {str(s): b for s, b in peaks.items()}, "step_seconds": step,
            "mfu": model_flops / (gpus * hw.matmul * step), "tokens_per_second": tokens / step,
            "bubble_idle": idle, "terms_seconds": terms}


def model_forward_flops(cfg, seq):
    """One sequence's forward matmul FLOPs: every layer's projections and the causal half of its attention square
    (what a flash kernel computes), and the LM head. Model FLOPs: no recompute counted (MFU's convention)."""
    ops = layer_ops(cfg.replace(attention="fused"), 1, seq, causal_skip=True)
    return cfg.layers * sum(op.flops for op in ops) + 2 * seq * cfg.hidden * cfg.vocab


def runs(cfg, cp, pp, dp, M, zero, schedule, V):
    """Whether a split can take this ZeRO stage and schedule: ZeRO needs ranks to shard over; interleaving and
    ZB-H1 need stages, interleaving M a multiple of p and V layers a stage, ZB-H1 at least p micro-batches."""
    if zero != "0" and dp * cp == 1 or pp == 1 and schedule != "1f1b":
        return False
    if schedule == "interleaved":
        return M % pp == 0 and cfg.layers >= pp * V
    return schedule != "zb-h1" or M >= pp


def search(cfg, seq, gpus, tokens, capacity, hw, policies=POLICIES, zero_stages=ZERO_STAGES, schedules=SCHEDULES):
    """(every layout that fits, best first; how many were considered). Attention is priced as a flash kernel."""
    cfg = cfg.replace(attention="fused", max_seq=max(cfg.max_seq, seq))
    check_search(cfg, seq, gpus, tokens, capacity, hw)
    rows, considered = [], 0
    for (tp, cp, pp, dp, M), zero, (schedule, V), policy in itertools.product(
            candidates(cfg, seq, gpus, tokens, hw.node), zero_stages, schedules, policies):
        if not runs(cfg, cp, pp, dp, M, zero, schedule, V):
            continue
        considered += 1
        row = evaluate(cfg, seq, gpus, tokens, capacity, hw, tp, cp, pp, dp, M, zero, schedule, V, policy)
        if row["fits"]:
            rows.append(row)
    rows.sort(key=lambda r: (r["step_seconds"], r["peak_bytes"]))
    return rows, considered


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
    """(rank from 1, row) of the best-ranked variant of a (tp, cp, pp, dp) split among `rows`, or (None, None)."""
    return next(((i, row) for i, row in enumerate(rows, 1) if (row["tp"], row["cp"], row["pp"], row["dp"]) == layout),
                (None, None))

# %% [markdown]
# # Lesson 29: time as the currency: from one op's roofline to a 16,384-GPU layout
#
# Lessons 14 to 19 counted bytes: what each rank of a tensor-, context-, pipeline- or data-parallel layout
# stores, and what it sends. Bytes decide whether a layout *fits*; among the layouts that fit, time decides
# which to train with. This lesson prices one training step of Llama 3 405B in seconds, from the bottom up,
# with the three formulas of `picockpt/cost.py`, and then lets `picockpt/layout_search.py` try every layout
# of 8,192 and 16,384 GPUs:
#
# 1. **an op** takes the longer of its matmul FLOPs over the matmul rate and its bytes moved over the memory
#    bandwidth (the roofline, Williams et al. 2009, "Roofline: an insightful visual performance model");
# 2. **a collective** takes $\alpha + \text{wire bytes} / \text{link bandwidth}$: the bus factors of a ring
#    ($2(n-1)/n$ of an all-reduce's size on each rank's link, $(n-1)/n$ of an all-gather's or a
#    reduce-scatter's), and for $\alpha$ NCCL's own tuning model of its ring (`src/graph/tuning.cc`: a base
#    latency a call, then a latency a step, higher between nodes than inside one);
# 3. **the pipeline** idles while it fills and drains: the bubble (Narayanan et al. 2021, sec. 2.2).
#
# Everything below is **modelled**: no GPU runs, and the whole lesson takes seconds on a CPU. The rates are
# datasheet ceilings from `picockpt/hardware.py`, which cites each (H100 SXM: dense BF16 tensor cores, HBM3
# bandwidth; one direction of NVLink 4 inside a node of 8; one NDR InfiniBand port a GPU between nodes). A
# ceiling is never reached, so every modelled time is a lower bound and every modelled MFU an upper one; the
# last section says what else the model leaves out. The published numbers it is set against are the Llama 3
# paper's (Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 4): three layouts, each with the
# TFLOPs a GPU and the BF16 MFU the paper reports.
#
# **Run it** as a script, `python lessons/29_choosing_a_layout.py` (seconds; `--fast` is the same
# model with a coarser size sweep in the figure), or step through this notebook, where the same flags come from
# the environment variable `PICOCKPT_LESSON_ARGS` (unset: the CPU run).

# %%
import matplotlib.pyplot as plt
import numpy as np

from _check import check
from _lesson import choose, lesson_args, wrote
from picockpt import Config
from picockpt.cost import (HARDWARE, NCCL_BASE_LATENCY, NCCL_NVLINK_STEP, WIRE, bubble_idle, collective_seconds,
                           head_ops, layer_ops, roofline_seconds)
from picockpt.layout_search import (LLAMA3_405B_TABLE_4, POLICIES, SCHEDULES, STATE_BYTES, ZERO_STAGES, evaluate,
                                    rank_of, runs, search, stage_params)
from picockpt.plotting import save_figure

HW = HARDWARE["h100"]  # datasheet ceilings (picockpt/hardware.py), 8 GPUs a node
CAPACITY = 80 * 2**30  # bytes of one H100's memory, as `--gpu-gib 80` gives it
TOKENS = 2**24  # 16M tokens a step, the Llama 3 paper's batch: 2,048 sequences of 8,192
SEQ, TP = 8192, 8
H200_GIB = 140  # nvidia-smi: 143,771 MiB on an H200, rounded down (lesson 01's explorer uses the same)
TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "bubble", "dp_exposed")
TERM_COLORS = {"compute": "#4C72B0", "recompute": "#DD8452", "tp_comm": "#55A868", "cp_comm": "#64B5CD",
               "pp_comm": "#8172B3", "bubble": "#C44E52", "dp_exposed": "#937860"}

# %% [markdown]
# ## 1. One op's roofline
#
# An op is a few kernels, each of which reads its inputs from HBM and writes its output there (`layer_ops`
# lists them the way `picockpt/layer.py` runs them). On a roofline a kernel is **compute-bound** when its
# arithmetic intensity, FLOPs per byte moved, is above the machine's **ridge point**, the matmul rate over the
# memory bandwidth, and **memory-bound** below it. For an $r \times k$ by $k \times n$ matmul in $e$-byte
# elements, reading both operands and writing the product once,
#
# $$I = \frac{2rkn}{e\,(rk + kn + rn)}, \qquad \frac{1}{I} = \frac{e}{2}\left(\frac{1}{r} + \frac{1}{k} +
# \frac{1}{n}\right):$$
#
# the harmonic mean of the three dimensions, so the *smallest* one decides. An elementwise op (a norm, the
# SwiGLU product, a residual add, RoPE) does no matmul at all: `layer_ops` counts its FLOPs as 0, since they are
# not tensor-core FLOPs; its real arithmetic is a few operations an element, about one FLOP a byte, still two
# orders of magnitude under the ridge. Its time is its bytes over the bandwidth.
#
# The shape: one layer of Llama 3 405B ($h$ = 16,384, 128 heads, 8 K/V heads, $f$ = 53,248) at 8,192 tokens,
# batch 1, on one of $t = 8$ tensor-parallel ranks with sequence parallelism (norms and residuals on
# $8192/8$ tokens), flash attention skipping the blocks above the causal diagonal.

# %%
def bound(flops, nbytes, hw):
    """'compute' when the kernel's math takes longer than its memory traffic at hw's rates, else 'memory'."""
    return "compute" if flops / hw.matmul >= nbytes / hw.memory else "memory"


def op_bound(op, hw):
    """One op's bound: every kernel's the same, or 'mixed' with each kernel's."""
    kinds = [bound(f, b, hw) for f, b in op.kernels]
    return kinds[0] if len(set(kinds)) == 1 else "mixed: " + ", ".join(kinds)


def layer_table(cfg, seq, t, hw):
    """[(op, FLOPs, bytes, FLOP/byte, bound, modelled seconds)] of one layer's forward and the head, one rank."""
    ops = layer_ops(cfg, 1, seq, t, t > 1, 1, causal_skip=True) + head_ops(cfg, 1, seq, t, t > 1)
    return [(op, op.flops, op.bytes, op.flops / op.bytes, op_bound(op, hw), roofline_seconds(op, hw)) for op in ops]


args = lesson_args()
cfg = Config.from_preset("llama3-405b", dtype="bf16").replace(attention="fused")
ridge = HW.matmul / HW.memory
table = layer_table(cfg, SEQ, TP, HW)
print(f"lesson 29 (all modelled, at datasheet ceilings): {HW.source}")
print(f"ridge point: {HW.matmul / 1e12:.1f} TFLOP/s / {HW.memory / 1e12:.2f} TB/s = {ridge:.0f} FLOP/byte")
print(f"Llama 3 405B, one layer's forward (and the head), {SEQ:,} tokens, tp {TP} with sequence parallelism, one rank:")
print(f"  {'op':<14}{'GFLOP':>9}{'MB moved':>10}{'FLOP/byte':>11}  {'bound':<34}{'modelled us':>12}")
for op, flops, nbytes, intensity, kind, seconds in table:
    print(f"  {op.name:<14}{flops / 1e9:>9.1f}{nbytes / 1e6:>10.1f}{intensity:>11.1f}  {kind:<34}"
          f"{seconds * 1e6:>12.1f}")
layer = [row for row in table if row[0].name not in ("final_norm", "logits", "loss")]
memory_share = sum(max(0.0, b / HW.memory) if f == 0 else 0.0 for op, *_ in layer for f, b in op.kernels) \
    / sum(row[5] for row in layer)
kv_kernel = [op for op, *_ in layer if op.name == "qkv"][0].kernels[1]
print(f"  the layer: {sum(row[5] for row in layer) * 1e3:.2f} ms modelled, {memory_share:.1%} of it in the "
      f"elementwise kernels (no matmul); the k and v projections at {kv_kernel[0] / kv_kernel[1]:.0f} FLOP/byte "
      f"are matmuls under the ridge: {cfg.kv_heads // TP} K/V head of {cfg.head_dim} a rank makes n = "
      f"{cfg.kv_heads // TP * cfg.head_dim}")

# %% [markdown]
# The ridge is 295 FLOP per byte. The MLP's matmuls are far above it: `gate_up` is two
# $8192 \times 16384$ by $16384 \times 6656$ products ($f / t$ = 6,656 columns a rank), whose intensity is
# the harmonic mean above, 3,000 FLOP per byte, ten times the ridge: compute-bound, and so is every projection
# whose smallest dimension is in the thousands. Flash attention is further still, since its $T \times T$
# tiles never leave on-chip memory. SwiGLU's product reads two $8192 \times 6656$ tensors and writes one, and
# multiplies nothing on the tensor cores: memory-bound, and so are both norms and both residual adds. The
# `qkv` row is the surprise: the query projection is compute-bound, but at $t = 8$ each rank holds one of the
# 8 K/V heads, so the k and v projections have $n = 128$ and an intensity of 125 FLOP per byte, under the
# ridge, *as this model prices them*: `layer_ops` runs q, k and v as three separate matmuls, as
# `picockpt/layer.py` does. Megatron-LM does not: its attention has one fused `linear_qkv` projection
# (megatron/core/transformer/attention.py, `SelfAttention`), a single column-parallel matmul whose output is
# each rank's query heads and its K/V heads side by side, $n = (128 + 2 \cdot 8) \cdot 128 / 8$ = 2,304 columns
# a rank, well above the ridge. So the grouped-query split makes k and v memory-bound only in an unfused layer;
# a framework that fuses them pays nothing for it. The elementwise kernels are a few percent of the layer's
# modelled time; the matmuls' FLOPs are the step.
#
# ## 2. One collective: latency against bandwidth
#
# `collective_seconds(kind, nbytes, ranks, hw, across_nodes)` is $\alpha + \text{wire bytes} / \beta$, with
# $\alpha$ = NCCL's base latency plus a latency for each of the ring's steps ($n - 1$ for an all-gather or a
# reduce-scatter), a step over NVLink inside a node or over the network between nodes. Two of the step's
# collectives, at Llama 3 405B's shapes: the all-gather of one block's input over the 8 tensor-parallel ranks
# of a node (sequence parallelism: $s \cdot h$ bf16 elements gathered), and the reduce-scatter of a pipeline
# stage's fp32 gradients over the 128 data-parallel ranks that hold the same weights at 16,384 GPUs, one per
# node. The message size at which the two terms are equal is $\alpha \cdot \beta$ / (the bus factor).

# %%
def split(kind, nbytes, ranks, hw, across):
    """(alpha seconds, bandwidth seconds) of one collective: the time of an empty one, and the rest."""
    alpha = collective_seconds(kind, 0, ranks, hw, across)
    return alpha, collective_seconds(kind, nbytes, ranks, hw, across) - alpha


def crossover_bytes(kind, ranks, hw, across):
    """The size at which the bandwidth term equals alpha: below it, latency dominates."""
    alpha, _ = split(kind, 0, ranks, hw, across)
    return alpha * (hw.network if across else hw.nvlink) / WIRE[kind](ranks)


stage_grad = stage_params(cfg, TP, 0, 16) * STATE_BYTES["grad"]  # stage 0 of pp = 16: its fp32 gradients
messages = (("tp all-gather, 8 ranks, NVLink", "all_gather", SEQ * cfg.hidden * 2, 8, False),
            ("pp send of one activation", "p2p", SEQ * cfg.hidden * 2 // TP, 2, True),
            ("dp reduce-scatter, 128 ranks, IB", "reduce_scatter", stage_grad, 128, True))
print(f"  {'collective':<34}{'bytes':>16}{'alpha us':>10}{'bandwidth us':>14}{'alpha share':>13}{'crossover MB':>14}")
for name, kind, nbytes, ranks, across in messages:
    alpha, band = split(kind, nbytes, ranks, HW, across)
    print(f"  {name:<34}{nbytes:>16,}{alpha * 1e6:>10.1f}{band * 1e6:>14.1f}{alpha / (alpha + band):>13.1%}"
          f"{crossover_bytes(kind, ranks, HW, across) / 1e6:>14.1f}")
tp_crossover = crossover_bytes("all_gather", 8, HW, False)
dp_crossover = crossover_bytes("reduce_scatter", 128, HW, True)

# %% [markdown]
# (modelled) The tensor-parallel all-gather of 268 MB spends 32 µs on latency and half a millisecond
# on bandwidth; the data-parallel reduce-scatter of a stage's 13.8 GB of gradients spends 1.8 ms on latency (127
# ring steps between nodes, 14.0 µs each) and a quarter of a second on bandwidth. Both are bandwidth-bound: at these
# shapes $\alpha$ is a rounding error. Latency dominates below the crossover, 16.6 MB for the all-gather inside a
# node and 90.0 MB for the reduce-scatter over 128 nodes: a ring's $\alpha$ grows with its ranks, so the larger the
# group, the larger a message must be before the link's bandwidth is what it waits for. That is why frameworks
# bucket gradients into large messages, and why NCCL's tuning model also prices a tree for an all-reduce over many
# nodes, whose latency grows with the logarithm of the ranks rather than with their number (this model prices every
# collective as a ring). A pipeline's send of one activation, 33.6 MB over one network hop, is bandwidth-bound too:
# its $\alpha$ is one step's, 22 µs, and its crossover about a megabyte.
#
# The latencies are NCCL's own constants (NVIDIA/nccl, `src/graph/tuning.cc`): a base latency of 8.4 µs a
# call for the ring's Simple protocol, and a step latency of 3.4 µs over NVLink and 14.0 µs over the network,
# the value since NCCL 2.18.1 (9.6 µs before). Two refinements are not modelled. Since NCCL 2.23 a group with
# one GPU a node takes the network step latency of the tree (also 14 µs for Simple), and for such groups
# NCCL may run an all-gather or a reduce-scatter with PAT (its parallel aggregated trees, latency logarithmic
# in the nodes) rather than a ring; a group with several GPUs a node runs its ring over NVLink inside the
# node and uses all of the node's NICs between nodes.
#
# ## 3. The bubble
#
# With $p$ stages and $m$ micro-batches of equal time, 1F1B leaves each stage idle for $p - 1$ micro-batch
# times of the $m + p - 1$ its step lasts: an idle share of $(p-1)/(m+p-1)$. The interleaved schedule gives
# each rank $V$ chunks of its layers, and the fill and drain shrink $V$-fold: $(p-1)/(Vm + p - 1)$ (Narayanan
# et al. 2021, sec. 2.2.2). The paper itself quotes the *bubble fraction* instead, bubble time over ideal
# compute time, $(p-1)/m$ and $(p-1)/(Vm)$: the same bubble, divided by the work rather than by the step.
# At the Llama 3 paper's 16,384-GPU layout, $p = 16$ and $d = 128$, the 2,048 sequences of a step give each
# pipeline $m = 16$ micro-batches (one sequence each, as this model counts them).

# %%
P, M_PIPE = 16, 16
bubbles = {"1F1B": bubble_idle(P, M_PIPE, "1f1b")} | {f"interleaved V={v}": bubble_idle(P, M_PIPE, "interleaved", v)
                                                      for v in (2, 4)}
print(f"p = {P}, m = {M_PIPE} (modelled, equal stage times):")
for name, idle in bubbles.items():
    v = int(name.rsplit("=", 1)[1]) if "=" in name else 1
    print(f"  {name:<16} idle share of the step {idle:.1%}; Narayanan's bubble fraction (p-1)/(V m) = "
          f"{(P - 1) / (v * M_PIPE):.1%}")

# %% [markdown]
# 1F1B at $p = m = 16$ idles 48.4% of the step: almost half of 16,384 GPUs waiting. Interleaving with $V = 4$
# brings it to 19.0%, at the price of $V$ times the pipeline's sends (each chunk boundary is one) and, on the
# first stage, $1 + (p-1)/(pV)$ times 1F1B's stored activations (Korthikanti et al. 2022, sec. 4.2.3). A
# larger $m$ would do the same without either price, but $m$ is the batch's sequences over the data-parallel
# ranks: the batch is fixed by the optimisation, and more data parallelism leaves fewer micro-batches for each
# pipeline. This is the tension the search resolves.
#
# ## 4. The search, and the Llama 3 paper's three layouts
#
# `search(cfg, seq, gpus, tokens, capacity_bytes, hw)` tries every split of the GPUs into $t \times c \times p
# \times d$ (tensor, context, pipeline, data) that the model's shape allows, with every ZeRO stage, 1F1B,
# interleaved with $V$ = 2 or 4, or ZB-H1 (each backward split into the input's gradient and the weights', the
# weights' waiting to fill the bubble: idle $(p-1)/(3m+p-1)$ with equal times, stage $s$ holding what $s$ waiting
# weight passes read; `pipeline_parallel/pp_orders.py` runs both orders on one clock), and each recompute policy in `layout_search.POLICIES` (`none`; `cheap`, the
# norms and SwiGLU's product rebuilt; `full`, the whole forward again), in the Llama 3 paper's placement order
# [TP, CP, PP, DP] (tensor parallelism innermost, inside a node). It keeps the layouts whose busiest rank fits
# in 80 GiB (stage 0: the most layers, the embedding and the most micro-batches in flight; or the last: the
# head), and ranks them by modelled step time. A row's `terms_seconds` say where its step goes:
# compute (forward and backward at the roofline), recompute, exposed tensor-, context- and pipeline-parallel
# communication, the bubble, and the data-parallel traffic that does not hide behind the first forward and
# the last backward. (`layout_search.py`'s docstring lists every term and what it leaves out.)

# %%
def split_of(row):
    return row["tp"], row["cp"], row["pp"], row["dp"]


def layout_text(row):
    schedule = row["schedule"] + (f" V={row['virtual_stages']}" if row["schedule"] == "interleaved" else "")
    return (f"TP{row['tp']} CP{row['cp']} PP{row['pp']} DP{row['dp']}, ZeRO {row['zero']}, {schedule}, "
            f"M={row['microbatches']}, {row['policy']}")


def split_rank(rows, layout):
    """The rank of a (tp, cp, pp, dp) split among the distinct splits, each at its best variant."""
    order = list(dict.fromkeys(split_of(row) for row in rows))
    return order.index(layout) + 1 if layout in order else None, len(order)


cases = []
for gpus, seq, layout, tflops, reported in LLAMA3_405B_TABLE_4:
    rows, considered = search(cfg, seq, gpus, TOKENS, CAPACITY, HW)
    assert all(row["fits"] and row["peak_bytes"] <= CAPACITY for row in rows)  # every row kept fits
    assert all(a["step_seconds"] <= b["step_seconds"] for a, b in zip(rows, rows[1:]))  # best first
    rank, published = rank_of(rows, layout)
    assert published is not None  # the published split fits in this memory model
    cases.append(dict(gpus=gpus, seq=seq, layout=layout, tflops=tflops, reported=reported, rows=rows,
                      considered=considered, rank=rank, published=published, best=rows[0],
                      split_rank=split_rank(rows, layout)))
    best = rows[0]
    print(f"\n{gpus:,} GPUs, {seq:,} tokens a sequence: {considered:,} layouts considered, {len(rows):,} fit "
          f"(every one within {CAPACITY / 2**30:.0f} GiB: True; sorted by step time: True)")
    print(f"  model's best: {layout_text(best)}: peak {best['peak_bytes'] / 2**30:.1f} GiB, step "
          f"{best['step_seconds']:.2f} s, MFU {best['mfu']:.1%} (modelled)")
    split_place, splits = split_rank(rows, layout)
    print(f"  published   : {layout_text(published)}: rank #{rank} of {len(rows):,} (split #{split_place} "
          f"of {splits:,}), peak {published['peak_bytes'] / 2**30:.1f} GiB, step "
          f"{published['step_seconds']:.2f} s, MFU {published['mfu']:.1%} modelled against {reported:.0%} reported "
          f"({published['mfu'] * HW.matmul / 1e12:.0f} against {tflops} TFLOPs a GPU)")
    print("  terms, s      " + "".join(f"{t:>11}" for t in TERMS))
    for name, row in (("best", best), ("published", published)):
        print(f"  {name:<14}" + "".join(f"{row['terms_seconds'][t]:>11.3f}" for t in TERMS))
    gaps = {t: published["terms_seconds"][t] - best["terms_seconds"][t] for t in TERMS}
    print("  the published layout's extra seconds, largest first: " + (", ".join(
        f"{t} {gaps[t]:+.2f}" for t in sorted(TERMS, key=lambda t: -gaps[t]) if abs(gaps[t]) >= 0.005)
        if published is not best else "none: it is the model's best"))

# %% [markdown]
# (modelled) The rows above are the model's verdict, and they move whenever one of its terms changes: that
# is why every term is printed. Read each case for three things: where the published split ranks (`rank_of`
# gives its best variant), which recompute policy lets it fit, and which terms separate it from the model's
# best (the last line of each case). The summary below says it in one line a case, from the same rows. Two
# things hold in all of them. The reported MFU is below the modelled one, since the model runs every kernel at
# the datasheet's ceiling. And at 8K tokens the model's best layout has context parallelism where the paper's
# has none: the model prices its K/V all-gathers as a small share of the step, and the activations it splits
# $c$ ways buy micro-batches that store everything or rebuild only the elementwise outputs (`none` or `cheap`).

# %%
print("summary (modelled, H100 datasheet ceilings; reported: Llama 3 paper, Table 4):")
for c in cases:
    best, pub = c["best"], c["published"]
    where = ("the model's best split" if c["split_rank"][0] == 1 else
             f"#{c['rank']} of {len(c['rows']):,} ({c['split_rank'][0]} of {c['split_rank'][1]} splits)")
    print(f"  {c['gpus']:,} GPUs, {c['seq'] // 1024}K: TP{c['layout'][0]} CP{c['layout'][1]} PP{c['layout'][2]} "
          f"DP{c['layout'][3]} is {where}, policy {pub['policy']}, {pub['mfu']:.1%} MFU modelled against "
          f"{c['reported']:.0%} reported; the model's best, {layout_text(best)}, {best['mfu']:.1%}")
above = all(c["published"]["mfu"] > c["reported"] for c in cases)
print(f"  modelled MFU above the reported one in every case: {above}")

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.2), gridspec_kw={"width_ratios": [2.2, 1]})
x, labels = 0, []
for case in cases:
    for name, row in (("best", case["best"]), ("published", case["published"])):
        bottom = 0.0
        for term in TERMS:
            value = row["terms_seconds"][term]
            left.bar(x, value, 0.7, bottom=bottom, color=TERM_COLORS[term], label=term if x == 0 else None)
            bottom += value
        left.text(x, bottom, f"{row['mfu']:.0%}", ha="center", va="bottom", fontsize=8)
        labels.append(f"{name}\nT{row['tp']} C{row['cp']} P{row['pp']} D{row['dp']}\n{row['policy']}"
                      + (f", #{case['rank']}" if name == "published" else ""))
        x += 1
    x += 0.5
positions = [i + (i // 2) * 0.5 for i in range(len(labels))]
left.set_xticks(positions, labels, fontsize=7)
for i, case in enumerate(cases):
    left.annotate(f"{case['gpus']:,} GPUs, {case['seq'] // 1024}K tokens", (positions[2 * i] + 0.5, 0),
                  xytext=(0, -62), textcoords="offset points", ha="center", fontsize=8, annotation_clip=False)
left.set_ylabel("seconds a step (modelled, datasheet rates)")
left.set_title("where a step goes: the model's best layout vs the Llama 3 paper's (Table 4); MFU above each bar",
               fontsize=9)
left.set_ylim(0, left.get_ylim()[1] * 1.15)
left.legend(fontsize=7, ncol=7, loc="upper center")
left.grid(alpha=0.3, axis="y")
width = 0.27
for j, (what, values, color) in enumerate((
        ("reported (Llama 3 paper, Table 4)", [c["reported"] for c in cases], "#333333"),
        ("published layout, modelled", [c["published"]["mfu"] for c in cases], "#C44E52"),
        ("model's best layout, modelled", [c["best"]["mfu"] for c in cases], "#4C72B0"))):
    right.bar(np.arange(3) + (j - 1) * width, [v * 100 for v in values], width, color=color, label=what)
right.set_xticks(range(3), [f"{c['gpus']:,} GPUs\n{c['seq'] // 1024}K" for c in cases], fontsize=8)
right.set_ylabel("BF16 MFU, %")
right.set_ylim(0, 85)
right.legend(fontsize=7, loc="upper left")
right.grid(alpha=0.3, axis="y")
right.set_title("MFU: reported vs modelled (a ceiling)", fontsize=9)
fig.suptitle("Llama 3 405B on H100 80 GB, 16M tokens a step: every number modelled at datasheet ceilings, "
             "except the reported MFU", fontsize=10)
fig.tight_layout()
paths = [save_figure(fig, "29_choosing_a_layout")]
wrote(paths[-1])

# %% [markdown]
# The roofline and the collectives, drawn: each of the layer's kernels at its intensity on the H100's roofline
# (modelled: attainable FLOP/s = min(matmul rate, intensity x bandwidth); the elementwise kernels, 0 matmul
# FLOPs, are drawn at their bandwidth-limited time instead), and the two collectives of section 2 against
# their message size, with $\alpha$ alone as a dashed line.

# %%
sizes = np.logspace(4, 11, choose(args.mode, fast=15, cpu=57, large=57))
fig, (roof, wire) = plt.subplots(1, 2, figsize=(13, 4.8))
grid = np.logspace(0, 4.5, 200)
roof.loglog(grid, np.minimum(HW.matmul, grid * HW.memory) / 1e12, "-", color="0.3", label="roofline (datasheet)")
roof.axvline(ridge, color="0.6", ls=":", lw=1)
roof.annotate(f"ridge {ridge:.0f} FLOP/byte", (ridge, 1.4), xytext=(4, 0), textcoords="offset points", fontsize=8)
KERNEL_NAMES = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate", "up")}  # an op's matmul kernels
points = sorted(((f / b, KERNEL_NAMES.get(op.name, (op.name,))[i], bound(f, b, HW))
                 for op, *_ in layer for i, (f, b) in enumerate(op.kernels) if f))
for k, (intensity, name, kind) in enumerate(points, 1):
    y = min(HW.matmul, intensity * HW.memory) / 1e12
    roof.loglog(intensity, y, "o", ms=6, color="#4C72B0" if kind == "compute" else "#C44E52")
    roof.annotate(str(k), (intensity, y), xytext=(-3 if k % 2 else 3, 6 if k % 2 else -12), textcoords="offset points",
                  fontsize=7)
roof.text(3e4, 3, "matmul kernels, FLOP/byte:\n" + "\n".join(f"{k} {name}: {i:,.0f} ({kind})" for k, (i, name, kind)
                                                             in enumerate(points, 1)),
          fontsize=7, ha="right", va="bottom", bbox=dict(facecolor="white", edgecolor="0.8"))
elementwise = [op.name for op, *_ in layer if op.flops == 0]
roof.text(1.2, HW.matmul / 1e12 / 4, "elementwise, 0 matmul FLOPs (memory-bound,\ntime = bytes / "
          f"{HW.memory / 1e12:.2f} TB/s):\n" + ", ".join(elementwise[:3]) + ",\n" + ", ".join(elementwise[3:]),
          fontsize=7, color="#C44E52", va="top")
roof.set_ylim(1, HW.matmul / 1e12 * 3)
roof.set_xlabel("arithmetic intensity, FLOP per byte moved")
roof.set_ylabel("attainable TFLOP/s (modelled)")
roof.set_title(f"one Llama 3 405B layer, {SEQ:,} tokens, tp {TP} + sp, on H100 (blue: compute-bound, "
               "red: memory-bound)", fontsize=8)
roof.legend(fontsize=7, loc="upper right")
roof.grid(alpha=0.3, which="both")
for (name, kind, _, ranks, across), color in zip(messages[::2], ("#55A868", "#937860")):
    wire.loglog(sizes, [collective_seconds(kind, s, ranks, HW, across) * 1e6 for s in sizes], "-", color=color,
                label=name)
    wire.axhline(split(kind, 0, ranks, HW, across)[0] * 1e6, color=color, ls="--", lw=1)
    wire.axvline(crossover_bytes(kind, ranks, HW, across), color=color, ls=":", lw=1)
wire.set_xlabel("message size, bytes (an all-gather's output, a reduce-scatter's input)")
wire.set_ylabel("µs (modelled: NCCL ring α + bus bytes / link)")
wire.set_title("one collective: α (dashed) dominates left of the crossover (dotted)", fontsize=9)
wire.legend(fontsize=7)
wire.grid(alpha=0.3, which="both")
fig.tight_layout()
paths.append(save_figure(fig, "29_roofline_and_collectives"))
wrote(paths[-1])

# %% [markdown]
# ## 5. What the model misses, and why it ranks the published layout low
#
# First, what the published split must do to fit, at 16,384 GPUs and 8K tokens. The search keeps each split's
# best variant. Below, every variant of TP8 CP1 PP16 DP128 the search considers, by recompute policy: how many
# fit, the lowest peak of the busiest rank, and the `none` variants that fit; then the best variant's costs:

# %%
def split_variants(cfg, seq, gpus, layout):
    """Every row evaluate() gives the split under the search's own ZeRO stages, schedules and policies."""
    tp, cp, pp, dp = layout
    M = TOKENS // seq // dp
    search_cfg = cfg.replace(attention="fused", max_seq=max(cfg.max_seq, seq))
    return [evaluate(search_cfg, seq, gpus, TOKENS, CAPACITY, HW, tp, cp, pp, dp, M, zero, schedule, V, policy)
            for zero in ZERO_STAGES for schedule, V in SCHEDULES for policy in POLICIES
            if runs(search_cfg, cp, pp, dp, M, zero, schedule, V)]


case = cases[1]  # 16,384 GPUs at 8K tokens
variants = split_variants(cfg, case["seq"], case["gpus"], case["layout"])
print(f"TP8 CP1 PP16 DP128 at 16,384 GPUs (modelled peak of the busiest rank, {CAPACITY / 2**30:.0f} GiB a GPU):")
for policy in POLICIES:
    group = [r for r in variants if r["policy"] == policy]
    fitting = [r for r in group if r["fits"]]
    lowest = min(group, key=lambda r: r["peak_bytes"])
    print(f"  {policy:<5} {len(fitting)} of {len(group)} variants fit; lowest peak {lowest['peak_bytes'] / 2**30:.1f} "
          f"GiB (ZeRO {lowest['zero']}, {lowest['schedule']})" + (
              "; the fitting ones: " + "; ".join(f"ZeRO {r['zero']} {r['schedule']} V={r['virtual_stages']}: "
                                                 f"{r['peak_bytes'] / 2**30:.1f} GiB, step {r['step_seconds']:.2f} s "
                                                 f"(dp_exposed {r['terms_seconds']['dp_exposed']:.2f} s)"
                                                 for r in fitting) if policy == "none" else ""))
pub = case["published"]
none_zero2 = next(r for r in variants if (r["policy"], r["zero"], r["schedule"], r["virtual_stages"])
                  == ("none", "2", "1f1b", 1))
print(f"  without recomputation, ZeRO 2, 1F1B, stage 0 would hold {none_zero2['peak_bytes'] / 2**30:.1f} GiB: "
      f"{TOKENS // case['seq'] // case['layout'][3]} micro-batches in flight, each with every one of its 8 layers' "
      f"activations")
print(f"  the best variant, {layout_text(pub)}: {pub['peak_bytes'] / 2**30:.1f} GiB; it spends "
      f"{pub['terms_seconds']['recompute']:.2f} s recomputing and {pub['terms_seconds']['bubble']:.2f} s in the bubble")
best = case["best"]
stores = "without recomputation" if best["policy"] == "none" else f"with {best['policy']} recomputation"
print(f"  the model's best, {layout_text(best)}: each of its cp = {best['cp']} ranks holds "
      f"{case['seq'] // best['cp']:,} tokens" + (f" (zigzag halves of {case['seq'] // (2 * best['cp']):,})"
                                                 if best["cp"] > 1 else "")
      + f", and {best['microbatches']} micro-batches fit {stores} in {best['peak_bytes'] / 2**30:.1f} GiB; its "
      f"cp_comm: {best['terms_seconds']['cp_comm']:.2f} s of {best['step_seconds']:.2f} s")
efficiency = {f"{c['gpus']:,} GPUs, {c['seq'] // 1024}K": c["reported"] / c["published"]["mfu"] for c in cases}
print("  reported MFU / modelled MFU of the published layout: "
      + ", ".join(f"{k}: {v:.2f}" for k, v in efficiency.items()))

# %% [markdown]
# In this memory model the split's stage 0 holds 16 micro-batches in flight, each with 8 layers' activations:
# without any recomputation that is more than 80 GiB (the `none` line), and the one `none` variant that fits
# shards its weights with ZeRO 3, whose every micro-batch gathers the stage's weights again over the network
# (its `dp_exposed`). So the variants that fit recompute something. `cheap` rebuilds the norms' outputs and
# SwiGLU's product, the memory-bound ops of section 1: their rebuild costs bytes, not FLOPs, hundredths of a
# second, and drops enough to fit. `full` repeats the whole forward and its tensor-parallel collectives. The
# model's best layouts instead add context parallelism where they can, which splits every activation $c$ ways
# at a modelled cost of a few percent of the step. That is the model's opinion, and it rests on the things the
# model does not see. Table 4 gives the layouts and their throughput, not the ZeRO stage or the schedule
# behind them. It does say what the 8K runs recomputed: nothing. Section 3.3.2 of the paper (Grattafiori et al.
# 2024, "Pipeline parallelism improvements") says the pipeline changes let it pre-train on 8K-token sequences
# *without activation checkpointing*. So at 8K the model above is wrong where it says the published split must
# recompute to fit: its memory model of that layout (stage 0's in-flight micro-batches at 8 layers each, the
# paper's lighter first and last stages and its FSDP not modelled) overstates what the run stored, and a
# measurement of the real layout, not the model's verdict, is the reference.
#
# What the model leaves out, each of which moves the ranking:
#
# - **Datasheet ceilings.** Every op runs at the H100's peak matmul rate or peak bandwidth. Real GEMMs reach a
#   fraction of the peak, different for each shape; the reported MFU of the published layout is a fraction of
#   the modelled one (the ratios printed above), and that fraction is not the same for every layout.
# - **Short chunks.** Context parallelism at 8K tokens gives each of $c$ ranks $8192/c$ tokens in two zigzag
#   halves (2,048 at $c = 2$, 1,024 at $c = 4$): flash attention on short query blocks and matmuls with fewer
#   rows run further below the peak than at 8,192, and each layer waits on K/V all-gathers that the model
#   prices at the ring's ideal bandwidth. The model treats that as nearly free; a measurement might not.
# - **Overlap, both ways.** Tensor- and context-parallel collectives are priced as exposed, which frameworks
#   partly hide behind matmuls (pessimistic); the data-parallel reduce-scatter and gather are priced as hidden
#   behind one backward and one forward whenever they are shorter (optimistic: they share the network and the
#   GPU's memory bandwidth with the compute they overlap).
# - **Stragglers and the optimizer step.** At 16,384 GPUs the slowest rank paces every collective; the
#   optimizer's own step and the embedding's lookup are outside the terms.
# - **Interleaving's sends.** The pipeline term counts two sends a micro-batch whatever $V$, where interleaving
#   sends $V$ times as often (Narayanan et al. 2021); at these shapes `pp_comm` is under a tenth of a second,
#   a few percent of the step even multiplied by $V$.
# - **What MFU counts.** The modelled MFU divides the model's FLOPs, the causal half of each attention square
#   and no recomputation (`layout_search.model_forward_flops`), by the datasheet rate and the modelled step.
# - **One ring for every collective.** NCCL picks among rings and trees by size and rank count; the model
#   prices every collective as a ring.
# - **The layer split.** picockpt's `stage_layers` gives the first 14 of 16 stages 8 layers and the last two 7;
#   the paper's split holds one layer fewer on the first and last stages. Stage 0 is the busiest rank here,
#   in memory and in time.
# - **Memory beyond the closed forms.** The allocator's fragmentation, NCCL's buffers and the CUDA context are
#   not in the peak; a layout that fits with 2 GiB to spare may not fit on the machine.
#
# So: a rank is what this model says of the layouts under its assumptions, a way to ask which terms matter,
# not a measurement, and not a verdict on a layout that trained a model. To decide between the model's best
# and the published layout one would profile a few steps of each (lesson 23's measured side; lesson 28's
# profiling to place checkpoints).
#
# ## Exercises
#
# **1.** Predict the best layout (tp, cp, pp, dp) for Llama 3 70B at 8,192 tokens a sequence on 1,024 H100s
# (80 GiB) with 4M tokens a step, then run the search: `python -m picockpt predict --search --model llama3-70b
# --seq 8192 --gpus 1024 --tokens-per-batch 4M --gpu-gib 80 --hardware h100`.

# %%
answer = (4, 1, 4, 64)  # (tp, cp, pp, dp)

# %%
small_rows, _ = search(Config.from_preset("llama3-70b", dtype="bf16"), 8192, 1024, 2**22, CAPACITY, HW)
check("the modelled best (tp, cp, pp, dp) of Llama 3 70B, 8K tokens, 1,024 H100s, 4M tokens a step", answer,
      split_of(small_rows[0]),
      why=f"search()'s first row: {layout_text(small_rows[0])}, {small_rows[0]['mfu']:.1%} MFU modelled, "
          f"{small_rows[0]['peak_bytes'] / 2**30:.1f} GiB at its busiest rank; the next other split: "
          f"{layout_text(next(r for r in small_rows if split_of(r) != split_of(small_rows[0])))}")

# %% [markdown]
# **2.** On H200s (141 GB on the datasheet; nvidia-smi reports 143,771 MiB, about 140 GiB, the capacity lesson
# 01's explorer uses: `--hardware h200 --gpu-gib 140`; the same matmul rate, more memory and
# bandwidth), which recompute policy does the Llama 3 paper's 16,384-GPU split at 8K, TP8 CP1 PP16 DP128, use
# in its best variant, and why does it change from the H100's?

# %%
answer = "none"

# %%
h200 = HARDWARE["h200"]
h200_rows, _ = search(cfg, SEQ, 16384, TOKENS, H200_GIB * 2**30, h200)
_, h200_published = rank_of(h200_rows, (8, 1, 16, 128))
check(f"the recompute policy of TP8 CP1 PP16 DP128's best variant on H200 ({H200_GIB} GiB)", answer,
      h200_published["policy"],
      why=f"its best variant stores everything: ZeRO {h200_published['zero']}, {h200_published['schedule']} "
          f"V={h200_published['virtual_stages']}, {h200_published['peak_bytes'] / 2**30:.1f} GiB, which 80 GiB "
          f"cannot hold and {H200_GIB} GiB can; recomputing nothing, it models "
          f"{h200_published['mfu']:.1%} MFU, rank #{rank_of(h200_rows, (8, 1, 16, 128))[0]} of {len(h200_rows):,}")

# %% [markdown]
# **3.** Above what message size, in MB, does an all-gather over the 8 GPUs of a node (NVLink 4) spend more
# time on bandwidth than on latency, in this model?

# %%
answer = 16.6  # MB

# %%
check("the all-gather size, 8 ranks over NVLink, at which alpha equals the bandwidth term (MB)", answer,
      tp_crossover / 1e6,
      why=f"alpha = {NCCL_BASE_LATENCY * 1e6:.1f} us + 7 x {NCCL_NVLINK_STEP * 1e6:.1f} us (NCCL's ring, Simple "
          f"protocol) = {split('all_gather', 0, 8, HW, False)[0] * 1e6:.1f} us; the bandwidth term is 7/8 x S / "
          f"{HW.nvlink / 1e9:.0f} GB/s; equal at S = alpha x link / (7/8)")

# %%
RESULT = {"figures": [str(p) for p in paths],
          "summary": {"ridge FLOP/byte (H100)": round(ridge),
                      "bubble 1F1B / interleaved V=4, p=m=16":
                          f"{bubbles['1F1B']:.1%} / {bubbles['interleaved V=4']:.1%}",
                      **{f"published rank, {c['gpus']} GPUs {c['seq'] // 1024}K": c["rank"] for c in cases},
                      **{f"MFU modelled/reported, {c['gpus']} GPUs {c['seq'] // 1024}K":
                         f"{c['published']['mfu']:.1%}/{c['reported']:.0%}" for c in cases},
                      "every printed row fits = True": all(r["fits"] for c in cases for r in c["rows"])}}

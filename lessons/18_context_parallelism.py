# %% [markdown]
# # Lesson 18: context parallelism, and what recomputation costs in communication
#
# Context parallelism splits every activation of a layer along the sequence: rank $r$ of $cp$ holds
# $n = T/cp$ tokens of every sequence, every weight whole. All of the layer but attention works token by
# token, so the rank runs picockpt's very layer on its $n$ tokens and stores exactly the single process's
# tensors at $T/cp$ tokens: $1/cp$ of the layer. Attention needs every earlier token's keys and values:
#
# * **ring** (ring attention, Liu et al. 2023; Megatron-LM's `--cp-comm-type p2p`, its default): $cp - 1$
#   steps, each passing the K/V block on to the next rank while every rank's queries merge what they have
#   seen with the block's partial output by their log-sum-exp, FlashAttention's online softmax
#   (`picockpt/parallel/context_parallel/cp_attention.py`). The backward runs the ring again, and the
#   gradients of each block ride along with it until they are home. This is the variant Megatron-LM's
#   context-parallel guide describes (`docs/user-guide/features/context_parallel.md`): a K/V all-gather in the
#   forward and a reduce-scatter of its gradients in the backward, both carried out as point-to-point steps
#   round a ring, each rank storing only its own chunk's K/V and gathering the rest again in the backward.
#   `cp_comm="ring"` does one thing at a time, to be read; `"ring_overlap"` posts each step's send before the
#   attention of the block it holds, as the ring attention paper does, and waits for it after: the same bytes,
#   the same sums, the same numbers.
# * **all-gather** (the Llama 3 paper's choice; Megatron-LM's `--cp-comm-type allgather`, which its
#   `megatron/core/transformer/transformer_config.py` describes under `cp_comm_type` as gathering the whole
#   sequence's K/V before attention, synchronously, so without overlap): one all-gather of K/V per layer,
#   attention on the local queries, and a reduce-scatter of their gradients in the backward, which gathers
#   K/V once more, unless `keep_kv` keeps the other ranks' rows: $(cp-1)/cp$ of the layer's K/V, stored
#   whatever the policy.
#
# (Megatron-LM's other two, `a2a`, DeepSpeed-Ulysses' all-to-all that scatters the heads over the ranks and
# gathers the whole sequence, and `a2a+p2p`, all-to-all inside a node and the ring between nodes
# (`megatron/training/arguments.py`, `--cp-comm-type`), are not built here.)
#
# Causal attention makes later tokens dearer: with the contiguous layout (rank $r$ holds chunk $r$ of $cp$)
# the last rank attends to the whole sequence and the first to its own chunk. The zigzag layout cuts the
# sequence into $2cp$ chunks and gives rank $r$ chunks $r$ and $2cp-1-r$, as Megatron-LM's
# `get_batch_on_this_cp_rank` does (and PyTorch's `context_parallel`, torchtitan's, with its head-tail load
# balancer): every rank then reads $(2cp - 1)$ chunks of earlier keys, the same work.
#
# Per rank and layer, with $KV = 2 B\,KV\,n\,hd\,e$ the bytes of its K/V block and $G$ the same in the
# statistics dtype (the gradients are summed over up to $cp$ ranks):
#
# | | forward | backward | recompute (each recomputed layer) | stored besides |
# |---|---|---|---|---|
# | ring | $(cp-1)\,KV$ | $(cp-1)\,KV + cp\,G$ | $(cp-1)\,KV$ | nothing |
# | all-gather | $(cp-1)\,KV$ | $(cp-1)\,KV + (cp-1)\,G$ | $(cp-1)\,KV$ | nothing |
# | all-gather, `keep_kv` | $(cp-1)\,KV$ | $(cp-1)\,G$ | $0$ | $(cp-1)\,KV$ |
#
# (both ways counted alike, as the bytes that reach a rank from the others: the ring's blocks received, the
# all-gather's other $cp - 1$ blocks, not its whole buffer, which holds the rank's own block too, and the
# reduce-scatter's $cp - 1$ partial gradients of the rank's block: `picockpt/parallel/comm.py`). `full` and `every:C` recompute a layer's forward, and so
# its ring or gather again; `selective` and `cheap` rebuild inside a layer and move nothing. `budget:SIZE`
# plans each rank with a recomputed layer's ring priced as compute time (its bytes over a 400 Gb/s link,
# at an H200's 989 TFLOP/s); with tiled or fused attention no rebuild inside a dense layer costs FLOPs, so the
# plan of least recomputation already recomputes the fewest layers and the price never changes it.
#
# What to look at (measured on gloo ranks; every number held to the closed forms of
# `picockpt/parallel/context_parallel/cp_forms.py`, to the byte):
#
# * **memory**: each rank's store peak against $cp$, for `none` and `full`: the measured points on the
#   closed form's curve ($cp = 1$ is the single process).
# * **communication**: under `full`, the bytes per phase of the ring, the all-gather and the kept all-gather.
# * **balance**: per-rank attention FLOPs, zigzag against contiguous, and Llama 3 8B at 128K tokens.
# * **beside tensor parallelism**: Llama 3 405B at 128K tokens with $tp = 8$, where $cp$ goes on after $tp$
#   runs out of K/V heads, and a rank's model state with FSDP's sharding over $dp$ or over $dp \times cp$.
#
# Context parallelism runs through the same rank step as every other layout (`picockpt/parallel/rank.py`):
# beside tensor parallelism a rank runs the tensor-parallel layer on its $T/cp$ tokens and passes the K/V of
# its $KV/t$ heads round its ring; beside data parallelism every replicated weight's gradient is summed over
# the $dp \times cp$ ranks (the data-parallel buckets' group; picotron's `cp_dp_group` is the same group);
# beside pipeline parallelism each stage splits its micro-batches' sequences the same way and passes on a
# $(b, T/cp, h)$ activation: `parallel.loss_and_grads(..., Layout(cp=2, tp=2))`, `(..., Layout(cp=2, dp=2))` or
# `(..., Layout(cp=2, pp=2, microbatches=2))`, every rank held to the same closed forms (`tests/test_parallel_cp.py`).
#
# **Run it** as a script, `python lessons/18_context_parallelism.py` (the CPU run: 2 and 4 gloo ranks, about
# a minute; `--fast` for seconds, what the tests run; `--large --device cuda` for NCCL, one GPU per rank),
# or step through this notebook, where the same flags come from the environment variable
# `PICOCKPT_LESSON_ARGS` (unset: the CPU run).

# %%
import math
import multiprocessing

import matplotlib.pyplot as plt
import numpy as np
import torch

from _check import check
from _lesson import (FAST_TIMING, Spread, choose, dtype_for_device, large, lesson_args, paired_ratios, ranks_device,
                     shape_line, small, spawning_ranks, timed_claim, wrote)
from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.published import GIB
from picockpt.planning.step_forms import predicted_peak_bytes
from picockpt.measurement.measure import make_batch
from picockpt.parallel import Layout, ParallelJob, run_jobs
from picockpt.parallel.context_parallel.cp_forms import cp_comm_bytes, cp_peak_bytes, kept_kv_bytes
from picockpt.parallel.context_parallel.cp_forms import rank_attention_flops
from picockpt.parallel.data_parallel.zero_shards import stage_units
from picockpt.parallel.pipeline_parallel.pp_forms import ChunkForms, stage_plan
from picockpt.parallel.pipeline_parallel.pp_schedules import in_flight, stage_layers
from picockpt.parallel.report_forms import rank_param_shapes, zero_stage_forms
from picockpt.parallel.tensor_parallel.tp_forms import rank_comm_bytes, rank_peak_bytes
from picockpt.parallel.tensor_parallel.tp_shard import check_tensor_parallel
from picockpt.teaching.plotting import PHASE_COLORS, mib, save_figure
from picockpt.measurement.tracker import Tracker

PHASES = ("forward", "recompute", "backward")
VARIANTS = (("ring", "ring", False), ("all-gather", "allgather", False), ("all-gather, keep_kv", "allgather", True))
LLAMA_SEQ = 131072

# %% [markdown]
# ## The shapes, and one launch per $cp$
#
# Each launch runs, on every rank: `none` and `full` on the ring, `full` on the all-gather with and without
# the kept K/V (zigzag layout), and `none` with the contiguous layout, for the FLOPs. $cp = 1$ is the
# single-process engine, measured in this process.

# %%
def shape(mode):
    """(Config, batch, seq, the cp sizes run) of each run mode: fused attention (tiled on a GPU in fp32; fused
    on CUDA computes in bf16: dtype_for_device)."""
    return choose(mode, fast=(small(layers=2, hidden=64, ffn=128, attention="fused"), 1, 64, (2,)),
                  cpu=(small(layers=4, attention="fused"), 1, 512, (2, 4)),
                  large=(large(layers=4, attention="tiled"), 1, 4096, (2, 4)))


def measure(cfg, batch, seq, sizes, device):
    """{cp: {step label: [rank reports]}}: one launch per cp, and cp = 1 from the single process."""
    params = init_params(cfg, seed=0)  # on the CPU: what the ranks are sent
    ids, targets = make_batch(cfg, batch, seq, "cpu", seed=0)
    here = {name: tensor.to(device) for name, tensor in params.items()}
    out = {1: {}}
    for policy in ("none", "full"):
        with Tracker(device) as tracker:
            loss_and_grads(here, cfg, ids.to(device), targets.to(device), policy, tracker=tracker)
        out[1][policy] = [{"peak_activation_bytes": tracker.peak_logical,
                           "predicted_activation_bytes": predicted_peak_bytes(cfg, batch, seq, policy)}]
    start = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    for cp in sizes:
        steps = {("none", "zigzag", "ring"): ParallelJob(params, cfg, ids, targets, "none", Layout(cp=cp)),
                 ("none", "contiguous", "ring"): ParallelJob(params, cfg, ids, targets, "none",
                                                             Layout(cp=cp, cp_layout="contiguous"))}
        for label, comm, keep in VARIANTS:
            steps["full", "zigzag", label] = ParallelJob(params, cfg, ids, targets, "full",
                                                         Layout(cp=cp, cp_comm=comm, cp_keep_kv=keep))
        with spawning_ranks():  # the ranks need picockpt, not this lesson's cells
            results = run_jobs(list(steps.values()), cp, device=ranks_device(device, cp).type, start_method=start,
                               timeout_s=300)
        out[cp] = {key: reports for key, (_, _, reports) in zip(steps, results)}
        out[cp]["none"], out[cp]["full"] = out[cp]["none", "zigzag", "ring"], out[cp]["full", "zigzag", "ring"]
    return out


# %%
args = lesson_args()
cfg, batch, seq, sizes = shape(args.mode)
cfg = dtype_for_device(cfg, args.device)  # CUDA: the flash kernel takes 16 bits
print(f"lesson 18, context parallel on {', '.join(map(str, sizes))} ranks: {shape_line(cfg, batch, seq, args.device)}")
runs = measure(cfg, batch, seq, sizes, torch.device(args.device))
exact = {"peak": all(r["peak_activation_bytes"] == r["predicted_activation_bytes"]
                     for steps in runs.values() for ranks in steps.values() for r in ranks),
         "comm": all(r["comm_bytes"] == r["predicted_comm_bytes"] for cp in sizes for ranks in runs[cp].values()
                     for r in ranks),
         "flops": all(r["flops"] == r["predicted_flops"] for cp in sizes for ranks in runs[cp].values() for r in ranks)}
print("\nper rank store peak, measured | closed form (zigzag, ring):")
for cp, steps in runs.items():
    for policy in ("none", "full"):
        ranks = steps[policy]
        print(f"  cp={cp}  {policy:<5}" + "".join(f"  rank {i}: {r['peak_activation_bytes']:>10,} | "
                                                  f"{r['predicted_activation_bytes']:,} B"
                                                  for i, r in enumerate(ranks)))
print(f"every measured byte equals its closed form: store peaks {exact['peak']}, communication per phase "
      f"{exact['comm']}, FLOPs per phase {exact['flops']}")

# %% [markdown]
# ## Memory against $cp$
#
# The measured peaks sit on the closed form, $1/cp$ of the single process's at every policy: the rank's
# layer is the single process's layer at $T/cp$ tokens, and so is its head.

# %%
def plot_memory(cfg, batch, seq, runs):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    grid = [cp for cp in range(1, 17) if seq % (2 * cp) == 0]
    for policy, color in (("none", "#333333"), ("full", "#C44E52")):
        ax.plot(grid, [mib(cp_peak_bytes(cfg, batch, seq, policy, cp)) for cp in grid], "-", color=color,
                label=f"{policy}: closed form, per rank")
        points = [(cp, r["peak_activation_bytes"]) for cp, steps in runs.items() for r in steps[policy]]
        ax.plot([p[0] for p in points], mib([p[1] for p in points]), "o", color=color, mfc="none", ms=9,
                label=f"{policy}: measured, every rank")
    keep = [mib(cp_peak_bytes(cfg, batch, seq, "full", cp, "allgather", True)) for cp in grid]
    ax.plot(grid, keep, "--", color="#DD8452", label="full, all-gather with keep_kv: closed form")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(grid, [str(cp) for cp in grid])
    ax.set_xlabel("cp (ranks along the sequence)")
    ax.set_ylabel("store peak per rank, MiB")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(f"context parallel: L={cfg.layers}, h={cfg.hidden}, batch {batch} x {seq}, {cfg.dtype}, "
                 f"{cfg.attention} attention, zigzag ring", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, "18_context_parallel_memory")


paths = [plot_memory(cfg, batch, seq, runs)]
wrote(paths[-1])

# %% [markdown]
# ## Ring against all-gather under `full`
#
# The recompute phase repeats the forward's bytes, ring or all-gather; with the gathered K/V kept it moves
# nothing, and the kept rows show in the store's peak instead: $(cp-1)/cp$ of every layer's K/V.
#
# Counted as what reaches a rank, the all-gather's forward moves the ring's bytes exactly, $(cp-1)\,KV$ (its
# buffer, $cp$ blocks, holds the rank's own block too: nccl-tests' bus-bandwidth factor $(cp-1)/cp$,
# `picockpt/parallel/comm.py`), and its reduce-scatter $(cp-1)\,G$ against the ring's $cp\,G$ (the ring's
# gradients take one hop more to get home). What differs is when the bytes move: a ring can overlap each step with the attention of the block it has (`ring` runs them one after the
# other, `ring_overlap` overlaps them: timed below), an all-gather moves everything before the layer's attention
# starts.

# %%
big = max(sizes)
print(f"under full at cp={big}, rank 0, bytes per phase (measured | closed form) and store peak:")
for label, comm, keep in VARIANTS:
    r = runs[big]["full", "zigzag", label][0]
    print(f"  {label:<21}" + "".join(f"{phase} {r['comm_bytes'][phase]:>9,} | {r['predicted_comm_bytes'][phase]:>9,}  "
                                     for phase in PHASES) + f"peak {r['peak_activation_bytes']:,} B")
ring, plain, kept = (runs[big]["full", "zigzag", label][0] for label, _, _ in VARIANTS)
repeats = {label: runs[big]["full", "zigzag", label][0]["comm_bytes"]["recompute"]
           == runs[big]["full", "zigzag", label][0]["comm_bytes"]["forward"] for label, _, _ in VARIANTS[:2]}
extra = kept["peak_activation_bytes"] - plain["peak_activation_bytes"]
print(f"the recompute phase repeats the forward's bytes: {repeats}; kept K/V: recompute "
      f"{kept['comm_bytes']['recompute']} B, and {extra:,} B more at the peak = L x {extra // cfg.layers:,} B "
      f"(closed form {kept_kv_bytes(cfg, batch, seq, big, 'allgather', True):,} B a layer)")


def plot_comm(runs, big):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [label for label, _, _ in VARIANTS]
    x = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    for phase in PHASES:
        values = np.array([mib(runs[big]["full", "zigzag", label][0]["comm_bytes"][phase]) for label in labels])
        ax.bar(x, values, 0.6, bottom=bottom, color=PHASE_COLORS[phase], label=phase)
        bottom += values
    closed = [mib(sum(runs[big]["full", "zigzag", label][0]["predicted_comm_bytes"].values())) for label in labels]
    ax.plot(x, closed, "_", color="black", markersize=40, mew=2, label="closed form (total)")
    ax.set_xticks(x, labels)
    ax.set_ylabel("MiB received by rank 0 in one step")
    ax.grid(alpha=0.3, axis="y")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    ax.set_title(f"full recomputation at cp={big}: K/V bytes per phase (the gradients' all-reduce after the "
                 f"step left out)", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, "18_context_parallel_comm")


paths.append(plot_comm(runs, big))
wrote(paths[-1])

# %% [markdown]
# ## The overlapped ring, timed
#
# `cp_comm="ring_overlap"` posts each hop's paired send and receive (one `batch_isend_irecv`, the same order on
# every rank) before the attention of the block the rank holds, and waits for it before the next block is
# used; in the backward the next K/V travels during the block's attention, and its gradient after it (that
# attention is what sums it). Same bytes on the wire, the same sums in the same order: the same loss and
# gradients, bitwise. Below: `full` steps of both, interleaved pair by pair in one launch of $cp = 2$ ranks,
# and the ratio of each pair's step times. What it can hide is the ring's time on the wire; on gloo over
# loopback on a few CPU cores the "wire" is the same cores that compute, so there is little to hide.

# %%
def time_rings(cfg, batch, seq, device, repeats, cp=2):
    """(Spread of overlapped / simple step seconds, pair by pair; bitwise equal loss and gradients): `repeats`
    pairs of full steps, ring then ring_overlap, in one launch of cp ranks (measure=False: times and bytes)."""
    params = init_params(cfg, seed=0)
    ids, targets = make_batch(cfg, batch, seq, "cpu", seed=0)
    jobs = [ParallelJob(params, cfg, ids, targets, "full", Layout(cp=cp, cp_comm=comm), measure=False)
            for _ in range(repeats + 1) for comm in ("ring", "ring_overlap")]  # the first pair: a warm-up
    start = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    with spawning_ranks():
        results = run_jobs(jobs, cp, device=ranks_device(device, cp).type, start_method=start, timeout_s=300)
    seconds = [reports[0]["step_seconds"] for _, _, reports in results[2:]]
    (loss, grads, _), (loss_o, grads_o, _) = results[0], results[1]
    same = torch.equal(loss, loss_o) and all(torch.equal(grads[k], grads_o[k]) for k in grads)
    return paired_ratios(Spread(tuple(seconds[1::2])), Spread(tuple(seconds[0::2]))), same


def overlap_claim(ratio, mode):
    """The timing guard on the ratio (lessons/_lesson.py): the same bytes and FLOPs, so the claim that overlapping
    is faster stands only if every pair says so; otherwise the line says the timing was inconclusive."""
    return timed_claim(mode, ratio, "ring_overlap / ring step time", "<1", work=1.0)


overlap_ratio, overlap_same = time_rings(cfg, batch, seq, torch.device(args.device), choose(args.mode, 2, 9, 9))
print(f"cp=2, full: ring_overlap's loss and gradients equal ring's bitwise: {overlap_same}")
print(overlap_claim(overlap_ratio, args.mode).text)

# %% [markdown]
# ## Zigzag against contiguous
#
# Each rank's forward FLOPs, measured (FlopCounterMode's formulas, applied by the tracker), and its attention
# core's share. FlopCounterMode counts the fused kernel's whole square, causal or not (`torch/utils/flop_counter.py`,
# `sdpa_flop`: causal attention is not accounted for), so in these counts the diagonal block of $c$ tokens
# costs as much as an earlier chunk, and the busiest contiguous rank computes $cp$ blocks against the mean's
# $(cp+1)/2$. The flash kernel itself skips the key blocks above the causal diagonal (torch's copy of
# FlashAttention, `aten/src/ATen/native/transformers/cuda/flash_attn/flash_fwd_kernel.h`: `n_block_max` is
# cut at the diagonal when `Is_causal`), so it computes about half of each diagonal block: rank $r$ does
# $r + 1/2$ blocks, the busiest $cp - 1/2$ against a mean of $cp/2$, an imbalance of $(2cp-1)/cp$ as the
# kernel sees it (1.75 at $cp = 4$, where the counter says 1.6). picockpt's `tiled` attention skips the
# same way, tile by tile, and the last line below counts with it (tiles of 128, the kernel's query block).
# Zigzag balances either count.

# %%
balance = {}
for cp in sizes:
    for layout in ("zigzag", "contiguous"):
        ranks = runs[cp]["none", layout, "ring"]
        flops = [r["flops"]["forward"] for r in ranks]
        balance[cp, layout] = max(flops) / (sum(flops) / cp)
        print(f"cp={cp} {layout:<11} forward GFLOP per rank: {', '.join(f'{f / 1e9:.3f}' for f in flops)}; "
              f"busiest / mean = {balance[cp, layout]:.3f}; attention (one matmul, one layer) "
              + ", ".join(f"{r['predicted_attention_flops'] / 1e6:.1f}" for r in ranks) + " MFLOP")
llama = Config.from_preset("llama3-8b", dtype="bfloat16", attention="fused")
llama_sizes = (2, 4, 8, 16)
llama_balance = {}
for layout in ("zigzag", "contiguous"):
    for cp in llama_sizes:
        counts = [rank_attention_flops(llama, 1, LLAMA_SEQ, cp, layout, r) for r in range(cp)]
        llama_balance[cp, layout] = counts
print(f"Llama 3 8B, one {LLAMA_SEQ}-token sequence: attention busiest / mean per rank, zigzag | contiguous: "
      + ", ".join(f"cp={cp} {max(llama_balance[cp, 'zigzag']) / np.mean(llama_balance[cp, 'zigzag']):.3f} | "
                  f"{max(llama_balance[cp, 'contiguous']) / np.mean(llama_balance[cp, 'contiguous']):.3f}"
                  for cp in llama_sizes))


def kernel_imbalance(cfg, cp, layout="contiguous", seq=LLAMA_SEQ):
    """Busiest / mean attention FLOPs per rank, counting only the tiles a causal kernel computes: picockpt's
    tiled attention, which skips the key tiles above the diagonal, at tiles of 128."""
    skipping = cfg.replace(attention="tiled", attention_tile=128)
    counts = [rank_attention_flops(skipping, 1, seq, cp, layout, r) for r in range(cp)]
    return max(counts) / np.mean(counts)


print("the same, counting the tiles a causal kernel computes (tiled, 128): contiguous "
      + ", ".join(f"cp={cp} {kernel_imbalance(llama, cp):.3f} ((2cp-1)/cp = {(2 * cp - 1) / cp:.3f})"
                  for cp in llama_sizes)
      + f"; zigzag {max(kernel_imbalance(llama, cp, 'zigzag') for cp in llama_sizes):.3f} at most")


def plot_balance(llama_balance):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, cp in zip(axes, (8, 16)):
        x = np.arange(cp)
        for offset, layout, color in ((-0.2, "zigzag", "#4C72B0"), (0.2, "contiguous", "#C44E52")):
            ax.bar(x + offset, [f / 1e15 for f in llama_balance[cp, layout]], 0.4, color=color, label=layout)
        ax.set_xticks(x, [str(r) for r in x], fontsize=7)
        ax.set_xlabel("rank")
        ax.set_title(f"cp={cp}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("PFLOP of one attention matmul, one layer")
    fig.suptitle(f"Llama 3 8B, one {LLAMA_SEQ}-token sequence, fused attention: each rank's attention FLOPs "
                 f"(cp_forms.rank_attention_flops)", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, "18_context_parallel_balance")


paths.append(plot_balance(llama_balance))
wrote(paths[-1])

# %% [markdown]
# ## At Llama 3 8B's size
#
# One 131072-token sequence, bf16, fused attention, predicted per rank: the store's peak under `none` and
# `full` (GiB) and the K/V bytes one layer's ring moves in the forward.

# %%
L8 = llama.layers
for cp in (1, 2, 4, 8, 16):
    ring_bytes = cp_comm_bytes(llama, 1, LLAMA_SEQ, "none", cp)["forward"] // L8
    print(f"  cp={cp:>2}: none {cp_peak_bytes(llama, 1, LLAMA_SEQ, 'none', cp) / GIB:7.1f} GiB, full "
          f"{cp_peak_bytes(llama, 1, LLAMA_SEQ, 'full', cp) / GIB:6.2f} GiB per rank; the ring moves "
          f"{mib(ring_bytes):6.0f} MiB a layer in the forward")
logits = LLAMA_SEQ * llama.vocab * 2  # bytes of the (T, V) bf16 logits the unchunked head keeps
inputs = L8 * LLAMA_SEQ * llama.hidden * 2  # bytes of the 32 layer inputs full keeps
full_peak = cp_peak_bytes(llama, 1, LLAMA_SEQ, "full", 1)
logits_share = logits / full_peak
print(f"(full's peak: the head's logits are {logits / GIB:.1f} GiB / cp, {logits_share:.1%} of it, less than half; "
      f"the {L8} layer inputs it keeps {inputs / GIB:.1f} GiB / cp, {inputs / full_peak:.1%}. Lesson 13's chunked "
      f"loss keeps one log-sum-exp per token instead of the logits)")

# %% [markdown]
# ## Llama 3 405B at 128K tokens: context parallelism beside $tp = 8$
#
# The Llama 3 paper trained its 131072-token stage with $tp = 8$, $cp = 16$ and $pp = 16$ on 16,384 GPUs
# (its table of parallelism configurations). Why not raise $tp$ instead? Past its 8 key/value heads, tensor
# parallelism stops dividing K/V: picockpt's tensor-parallel rank computes whole K/V heads and refuses
# $tp > 8$, naming the heads (a choice of this codebase, not a law). Megatron-LM goes on past the head count by
# replicating K/V heads: with fewer K/V heads than tensor-parallel ranks, each K/V head is computed on
# $tp/KV$ ranks, which all-gather the QKV projection's output to get it and keep their own share of the query
# heads (`megatron/core/transformer/attention.py`, the `num_query_groups < world_size` branches;
# `transformer_config.py` requires the K/V heads to divide $tp$ or be a multiple of it). At $tp = 16$ each
# K/V head's activations would sit on two ranks and every layer would gather the QKV output once more; and 8
# is also one server's NVLink domain. Context parallelism keeps splitting past that without
# replicating anything, and beside $tp$ each rank is a tensor-parallel rank on $T/cp$ tokens, passing the K/V
# of its $KV/t = 1$ head round its ring: that is the form the composed step's $tp \times cp$ ranks equal to
# the byte (`tests/test_parallel_cp.py`), and what `predict --cp 16 --tp 8 --sp` prints. Per rank, bf16,
# fused attention, sequence parallel, one sequence, activations only. With $pp = 16$, 126 layers do not
# split evenly: picockpt's `stage_layers` (`picockpt/parallel/pipeline_parallel/pp_schedules.py`) gives the
# first 14 stages 8 layers and the last two 7, and the stage numbers below use that split; the Llama 3 paper
# (Dubey et al. 2024, sec. 3.3.2) instead removes one transformer layer from the first stage and one from the
# last, 7 there and 8 on the 14 between, to even out the embedding's and the head's extra memory and work.

# %%
llama405 = Config.from_preset("llama3-405b", dtype="bf16", attention="fused")
try:
    check_tensor_parallel(llama405, 16, True, LLAMA_SEQ)
except ValueError as error:
    print(f"tp = 16: {error}")
print(f"{'cp':>4} {'tokens':>7} {'full GiB':>9} {'best every:C':>13} {'tp forward GiB':>15} {'ring forward GiB':>17}")
for cp in (1, 2, 4, 8, 16):
    n = LLAMA_SEQ // cp
    full = rank_peak_bytes(llama405, 1, n, "full", 8, True)
    best_C = min(range(1, 15), key=lambda C: rank_peak_bytes(llama405, 1, n, f"every:{C}", 8, True))
    best = rank_peak_bytes(llama405, 1, n, f"every:{best_C}", 8, True)
    tp_forward = rank_comm_bytes(llama405, 1, n, "full", 8, True)["forward"]
    ring_forward = cp_comm_bytes(llama405, 1, LLAMA_SEQ, "full", cp, t=8)["forward"]
    print(f"{cp:>4} {n:>7,} {full / GIB:>9.2f} {best / GIB:>7.2f} (C={best_C}) {tp_forward / GIB:>15.1f} "
          f"{ring_forward / GIB:>17.1f}")
stages = [ChunkForms(llama405, 16, LLAMA_SEQ // 16, "full", Layout(pp=16, tp=8, microbatches=16), s).peak_bytes
          for s in range(16)]
split = [len(layers) for layers in stage_layers(llama405.layers, 16)]  # picockpt's: 8 x 14, then 7, 7
paper_split = [split[0] - 1] + [split[0]] * 14 + [split[0] - 1]  # the paper's: one layer fewer on each end
paper_stage0 = stage_plan("full", llama405, 1, LLAMA_SEQ // 16, paper_split[0], False, in_flight("1f1b", 16, 16, 0),
                          Layout(tp=8))[1]  # stage 0 with the paper's 7 layers, the same 16 micro-batches in flight
print(f"the paper's layout, cp = 16 beside tp = 8 and pp = 16 (1F1B over 16 sequences), full: stage 0 of "
      f"picockpt's split ({split[0]} layers) holds {stages[0] / GIB:.2f} GiB per rank (its 16 micro-batches' "
      f"checkpoints), the last stage ({split[-1]} layers) {stages[-1] / GIB:.2f} GiB; with the paper's split "
      f"({paper_split[0]} layers on the first stage, {paper_split[1]} on each of the 14 between, {paper_split[-1]} "
      f"on the last: {sum(paper_split)}), stage 0 holds {paper_stage0 / GIB:.2f} GiB")

# %% [markdown]
# ### Its fourth dimension, FSDP
#
# The paper's 4D parallelism has data parallelism as its fourth dimension, run as FSDP (sec. 3.3.2), and for
# this 131072-token stage its table of configurations (Table 4 of the arXiv v3 text) puts $dp = 8$ beside the
# other three: $tp \times cp \times pp \times dp = 8 \times 16 \times 16 \times 8 = 16{,}384$, the GPU count.
# FSDP shards what ZeRO (lesson 19) calls the model state, in ZeRO's stages: ZeRO-1 the optimizer state,
# ZeRO-2 the gradients as well, ZeRO-3 the parameters too, a layer's all-gathered around each of its uses.
# The paper's FSDP shards the optimizer state and the gradients, and of the parameters it says: "for model
# shards we do not reshard after forward computation to avoid an extra all-gather communication during
# backward passes". Over which ranks? A layer's $cp$ ranks hold the same weights and sum the same gradients
# (the $dp \times cp$ group above), so the shards can spread over all $dp \times cp = 128$ of them: torchtitan
# shards FSDP that way (its `dp_shard_cp` mesh, `dp_shard` flattened with `cp`).
#
# Below, one rank of pipeline stage 0 (the embedding and 8 layers, its $tp = 8$ slices, its 16 micro-batches'
# checkpoints from above), in picockpt's dtypes: fp32 master weights, fp32 gradients, AdamW's two fp32
# moments and a 4-byte step count per unit, and under ZeRO-3 the gathered weights in bf16, the compute dtype
# (`zero_stage_forms`, `picockpt/parallel/report_forms.py`: the closed forms lesson 19 measures to the byte, in
# fp32: picockpt runs ZeRO in fp32 and fp64 only, so these bf16 rows are closed forms, not measurements).
# ZeRO-0, nothing sharded, is `zero_stage_forms` at `zero=1` over a group of one rank: each unit is then its
# own single shard, unpadded, and no collective moves anything, so every byte is held whole. "gathered" is the
# most bf16 weights gathered at once: under ZeRO-3 the unit in use and the next one, prefetched; with the
# parameters kept after the forward (the paper's choice) every unit of the stage. "activations" is the stage's
# store peak above. The totals count only these closed forms: no allocator slack, no communication buffers,
# no kernel workspaces.

# %%
def zero_state(zero, dp, cp, forms):
    """ZeRO's closed forms on a rank of pipeline stage `forms` beside tp = 8 and pp = 16 (1F1B, 16 micro-batches),
    every weight sharded over dp x cp ranks (parallel/report_forms.py)."""
    return zero_stage_forms(llama405, forms, Layout(dp=dp, pp=16, tp=8, cp=cp, zero=zero, microbatches=16))


def whole_stage_bytes(forms, ranks):
    """Bytes of every unit of the stage's rank gathered at once, in the compute dtype (bf16), each unit padded to
    a multiple of `ranks` as its shards are."""
    units = stage_units(rank_param_shapes(llama405, forms, 8), forms.layers, forms.first, forms.last,
                        {False: ranks, True: ranks})
    return sum(unit.padded for parts in units.values() for unit in parts) * llama405.torch_dtype.itemsize


first_stage = ChunkForms(llama405, 16, LLAMA_SEQ // 16, "full", Layout(pp=16, tp=8, microbatches=16), 0)
assert first_stage.peak_bytes == stages[0]  # the stage above
master = llama405.param_dtype.itemsize  # 4 bytes: fp32 master weights under bf16 compute
stage_params = sum(math.prod(shape) for shape in rank_param_shapes(llama405, first_stage, 8).values())
stage_units_count = len(first_stage.layers) + 1  # the embedding and 8 layers, one flat unit each
unsharded = zero_state(1, 1, 1, first_stage)  # one rank: nothing padded, nothing moved
assert unsharded["param_bytes"] == unsharded["grad_bytes"] == master * stage_params
assert unsharded["optimizer_bytes"] == 2 * master * stage_params + 4 * stage_units_count  # two moments, step counts
assert not any(unsharded["zero_bytes_by_kind"].values())
rows = {"ZeRO-0, nothing sharded": (unsharded["param_bytes"], unsharded["grad_bytes"], unsharded["optimizer_bytes"],
                                     0)}
sharded = {}
for ranks, (group_dp, group_cp), group in ((8, (8, 1), "dp = 8"), (128, (8, 16), "dp x cp = 128")):
    for zero in (1, 2, 3):
        forms = sharded[zero, ranks] = zero_state(zero, group_dp, group_cp, first_stage)
        rows[f"ZeRO-{zero} over {group}"] = (forms["param_bytes"], forms["grad_bytes"], forms["optimizer_bytes"],
                                             max(forms["gathered_peak_bytes"].values()))
    three = sharded[3, ranks]
    rows[f"kept after forward, over {group}"] = (three["param_bytes"], three["grad_bytes"],
                                                 three["optimizer_bytes"], whole_stage_bytes(first_stage, ranks))
print(f"one rank of pipeline stage 0 ({stage_params:,} parameters: its tp = 8 slices), GiB:")
print(f"{'':<40}{'params':>7}{'grads':>7}{'AdamW':>7}{'gathered':>9}{'activations':>12}{'total':>7}"
      f"{'of 80 GiB':>10}")
totals = {}
for label, parts in rows.items():
    totals[label] = sum(parts) + first_stage.peak_bytes
    print(f"{label:<40}" + "".join(f"{part / GIB:>7.2f}" for part in parts[:3]) + f"{parts[3] / GIB:>9.2f}"
          f"{first_stage.peak_bytes / GIB:>12.2f}{totals[label] / GIB:>7.2f}{totals[label] / (80 * GIB):>10.0%}")
state_of = {key: sum(forms[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
            for key, forms in sharded.items()}
assert state_of[3, 128] < state_of[3, 8] < state_of[2, 8] < state_of[1, 8] < sum(rows["ZeRO-0, nothing sharded"])
assert sharded[2, 128]["param_bytes"] == unsharded["param_bytes"]  # ZeRO-1 and 2 keep the parameters whole
step_counts = 4 * stage_units_count  # each unit's AdamW step count, whole on every rank
padding = 128 * sharded[1, 128]["optimizer_bytes"] - unsharded["optimizer_bytes"] - 127 * step_counts
assert 0 <= padding <= 2 * master * 127 * stage_units_count  # 1/128 of the moments, up to each unit's padding
gathers = {phase: kinds.get("all_gather", 0) for phase, kinds in sharded[3, 128]["zero_bytes_by_kind"].items()}
assert gathers["forward"] == 16 * whole_stage_bytes(first_stage, 128)  # every micro-batch gathers every unit
no_reshard = rows["kept after forward, over dp x cp = 128"]
print(f"parameters not resharded after the forward (Llama 3's FSDP), over 128 ranks: at rest the rank stores "
      f"ZeRO-3's fp32 shards ({no_reshard[0] / GIB:.2f} GiB), but each layer stays whole from its forward to its "
      f"backward, so during the step it holds its stage's whole parameters ({no_reshard[3] / GIB:.2f} GiB in bf16; "
      f"ZeRO-2 holds them whole in fp32, {unsharded['param_bytes'] / GIB:.2f} GiB) while gradients "
      f"({no_reshard[1] / GIB:.2f}) and AdamW state ({no_reshard[2] / GIB:.2f}) stay sharded: "
      f"{sum(no_reshard) / GIB:.2f} GiB of model state, {totals['kept after forward, over dp x cp = 128'] / GIB:.2f} "
      f"GiB with the activations")
print(f"what it saves: ZeRO-3 as picockpt runs it gathers {gathers['forward'] / GIB:.2f} GiB a step in the forwards "
      f"(16 micro-batches x {whole_stage_bytes(first_stage, 128) / GIB:.2f}), {gathers['recompute'] / GIB:.2f} GiB "
      f"in the recomputes and {gathers['backward'] / GIB:.2f} GiB in the backwards (every layer; the embedding's "
      f"backward needs its shape only); with each layer kept from its forward to its backward the last two are "
      f"not gathered")
fits = all(total < 80 * GIB for total in totals.values())
assert fits  # what the line below says
print(f"every row fits in 80 GiB: {fits}, ZeRO-0's too ({totals['ZeRO-0, nothing sharded'] / GIB:.2f} GiB): by these "
      f"counts sharding frees room at this stage rather than making it fit")

# %% [markdown]
# Every doubling of $cp$ halves a rank's stored activations and its tensor-parallel traffic (both are linear
# in its tokens), while the ring's bytes per rank grow towards one K/V of the whole sequence. Per layer and
# rank the ring moves $(cp-1) \cdot 2\,n\,(KV/t)\,hd$ elements against sequence parallelism's four collectives
# of $n\,h$ each, a ratio of $(cp-1) \cdot 2\,(KV/t)\,hd / (4h) = (cp-1)/256$ here: 6% at $cp = 16$. (The ring
# attention paper hides each step's send behind the block it computes, as `cp_comm="ring_overlap"` does.)

# %% [markdown]
# ## Exercises
#
# Llama 3 8B ($KV = 8$ key/value heads of $hd = 128$, bf16), one 131072-token sequence over $cp = 8$ ranks.
#
# **1.** How many MiB does one layer's ring move per rank in the forward?

# %%
answer = 448  # MiB

# %%
n = LLAMA_SEQ // 8
block = 2 * 1 * llama.kv_heads * n * llama.head_dim * 2  # bytes of one rank's K/V block
check("MiB one Llama 3 8B layer's ring moves per rank in the forward, cp = 8", answer,
      cp_comm_bytes(llama, 1, LLAMA_SEQ, "none", 8)["forward"] / L8 / 2**20,
      why=f"(cp-1) blocks of 2 B KV n hd e = 2·8·{n:,}·128·2 = {block:,} bytes: 7·{block:,} bytes")

# %% [markdown]
# **2.** With the all-gather and `keep_kv`, how many MiB more does each layer store per rank?

# %%
answer = 448  # MiB

# %%
check("MiB keep_kv adds per Llama 3 8B layer and rank at cp = 8", answer,
      kept_kv_bytes(llama, 1, LLAMA_SEQ, 8, "allgather", True) / 2**20,
      why="the other 7 ranks' rows, (cp-1)/cp of the layer's K/V: as many bytes as the ring moves in a "
          "forward, kept instead of moved again when the layer is recomputed")

# %% [markdown]
# **3.** With the contiguous layout at $cp = 4$ and fused attention (the diagonal block counted whole), how
# many times the mean does the busiest rank's attention compute?

# %%
answer = 1.6

# %%
counts = [rank_attention_flops(llama, 1, LLAMA_SEQ, 4, "contiguous", r) for r in range(4)]
check("busiest / mean attention FLOPs, contiguous, cp = 4", answer, max(counts) / np.mean(counts),
      why="rank r computes its diagonal block and r earlier ones, all the same size: 1, 2, 3, 4 blocks, "
          "so 4 against a mean of 2.5 (FlopCounterMode's count; a kernel that skips the tiles above the diagonal "
          f"does about half of each diagonal block: {kernel_imbalance(llama, 4):.2f}, (2cp-1)/cp)")

# %%
RESULT = {"figures": [str(p) for p in paths],
          "summary": {"store peak per rank = closed form": bool(exact["peak"]),
                      "communication per phase = closed form": bool(exact["comm"]),
                      "FLOPs per phase = closed form": bool(exact["flops"]),
                      "full repeats the forward's bytes (ring, all-gather)": all(repeats.values()),
                      "ring_overlap = ring, loss and gradients bitwise (cp=2)": overlap_same,
                      "ring_overlap / ring step time (cp=2)":
                          FAST_TIMING if args.mode == "fast" else overlap_ratio.text("{:.3f}"),
                      f"zigzag busiest / mean forward FLOPs (cp={big})": round(balance[big, "zigzag"], 4),
                      f"contiguous busiest / mean forward FLOPs (cp={big})": round(balance[big, "contiguous"], 4),
                      "Llama 3 8B cp=8 full GiB per rank":
                          round(cp_peak_bytes(llama, 1, LLAMA_SEQ, "full", 8) / GIB, 2)}}

# %% [markdown]
# # Lesson 17: expert parallelism, and what recomputation costs in communication
#
# Expert parallelism (GShard, Lepikhin et al. 2020; DeepSpeed-MoE, Rajbhandari et al. 2022; Megatron-LM)
# splits the $E$ experts of every layer over $W$ ranks, and the batch too: rank $r$ computes its own
# $B/W$ sequences with every other weight whole (data parallel), and holds experts $rE/W$ to
# $(r+1)E/W - 1$. In each layer the router of a rank picks $k$ experts per token; the (token, expert)
# pairs go to their experts' ranks in one all-to-all (the dispatch, with each pair's weight), the experts
# run, and the weighted outputs come back in the inverse all-to-all (the combine). The backward runs the
# adjoint of each, the inverse all-to-all (`picockpt/parallel/expert_parallel/ep_moe.py`). With $P = (B/W)\,T k$ pairs
# sent and $M$ rows received by a rank's experts per layer ($M = P$ on average, more on the rank that
# holds popular experts), and $e$, $s$ the bytes of an activation and of a statistic, one layer's
# all-to-alls move on a rank:
#
# | phase | bytes | what moves |
# |---|---|---|
# | forward | $8E + P h e + P s + M h e$ | the counts, the dispatch (tokens and their weights), the combine |
# | backward | $P h e + M s + M h e$ | the combine's, the weights' and the dispatch's backward |
#
# Recomputing a layer (`full`, `every:C`) runs its forward again, all-to-alls included. Its routing
# decision is kept by the first forward (`moe.expert_index`, $8 N k$ bytes a layer), so it neither runs the
# router nor exchanges counts again. Megatron-LM's routing replay (`moe_enable_routing_replay`,
# `megatron/core/transformer/moe/router_replay.py`) fixes less: under `REPLAY_BACKWARD` the router still
# computes its logits and scores and only takes its top-k from indices given through `set_target_indices`
# (the `REPLAY_FORWARD` path; `RECORD` only stores `recorded_topk_idx`), and the recomputed dispatch still
# exchanges the token counts (`megatron/core/transformer/moe/token_dispatcher.py`:
# `MoEAlltoAllTokenDispatcher.preprocess` all-gathers every rank's per-expert counts over the tensor- and
# expert-parallel group each time it runs). Nor is it what the single-process `full` of lesson 15 does,
# which runs the router again with the random generator replayed (the same experts as long as the router's
# kernels give the same bits). The rows
# come back only by being sent again: a dispatch of $P(h e + s)$ and a combine of $M h e$ per layer, the
# forward's traffic once more. Keeping the rows its experts received (`keep_dispatched`) saves the
# dispatch for $M(h e + s)$ stored bytes per layer: $P/M$ bytes not moved per byte kept, 1 for balanced
# routing; below 1 on the rank whose experts are popular, which also stores the most. At the store's
# peak the kept rows of every layer below the one being recomputed add up. The `moe` op level, which
# drops the experts' tensors and keeps the rest of the layer, drops their input rows too, and its
# backward dispatches them again: $P(h e + s)$ per layer, or nothing with the rows kept. It is not
# Megatron-LM's `--recompute-modules moe`, which checkpoints the whole MoE layer
# (`megatron/core/transformer/moe/moe_layer.py`): the router, the dispatch, the experts, the combine and
# the shared experts all run again, the forward's all-to-all bytes once more.
#
# What to look at (measured on 2 gloo ranks, every number held to the closed forms of
# `picockpt/parallel/expert_parallel/ep_forms.py`, to the byte):
#
# * **measured**: per rank and choice, for balanced and skewed routing (routers set by the weights, as
#   in lesson 15): all-to-all bytes per phase (left) and the store's peak (right). The gradient
#   all-reduce at the end (the data-parallel weights: the same for every choice) is left out of the bars.
# * **Mixtral**: one Mixtral 8x7B layer ($h = 4096$, $f = 14336$, $E = 8$, $k = 2$, bf16, fused
#   attention) at $W = 8$, one 4096-token sequence per rank, predicted: what recomputing it moves and
#   stores per rank under each choice, with balanced routing and with expert 0 taking twice its share.
#
# **Run it** as a script, `python lessons/17_expert_parallel.py` (the CPU run: 2 gloo ranks, under a
# minute; `--fast` for seconds, what the tests run; `--large --device cuda` for NCCL, one GPU per rank,
# 2 GPUs), or step through this notebook, where the same flags come from the environment variable
# `PICOCKPT_LESSON_ARGS` (unset: the CPU run).

# %%
import multiprocessing

import matplotlib.pyplot as plt
import numpy as np
import torch

from _check import check
from _lesson import choose, large, lesson_args, ranks_device, shape_line, small, spawning_ranks, wrote
from picockpt import Config, init_params
from picockpt.planning.published import GIB
from picockpt.measurement.measure import make_batch
from picockpt.model.routing import route_by_token
from picockpt.parallel import Layout, ParallelJob, run_jobs
from picockpt.parallel.expert_parallel.ep_forms import (ep_layer_comm_bytes, ep_layer_stored_bytes, ep_sent_bytes,
                                                           received_rows, replicated_grad_bytes)
from picockpt.teaching.plotting import PHASE_COLORS, mib, save_figure

EP = 2
ROUTINGS = ("balanced", "skewed")
CHOICES = (  # (label, policy, keep_dispatched)
    ("none", "none", False),
    ("full, repeat", "full", False),
    ("full, keep", "full", True),
    ("moe, repeat", "moe", False),
    ("moe, keep", "moe", True),
)
PHASES = ("forward", "recompute", "backward")
MIXTRAL_EP, MIXTRAL_SEQ = 8, 4096

# %% [markdown]
# ## The shapes and the routings
#
# $E$ experts over 2 ranks, top-2, $B/2$ sequences per rank. As in lesson 15, `route_by_token` sets the
# routers so that a token's class (its id mod $E$) decides its experts, and `token_ids` makes batches
# whose classes are every expert alike (balanced) or class 0 for the first half (skewed: half the
# tokens go to experts 0 and 1, both on rank 0).

# %%
def shape(mode):
    """(Config, batch, seq) of each run mode: E experts over 2 ranks, top-2, B/2 sequences per rank."""
    moe = dict(experts_per_token=2)
    return choose(mode, fast=(small(layers=2, hidden=64, ffn=128, experts=4, **moe), 2, 32),
                  cpu=(small(layers=4, experts=8, **moe), 4, 128),
                  large=(large(layers=4, ffn=1408, experts=8, **moe), 2, 1024))


def token_ids(routing, cfg, batch, seq, device):
    """Token ids whose class (id mod E) is every expert alike, or class 0 for the first half: under
    route_by_token a token of class c goes to experts c .. c+k-1, so skewed routing sends half the
    tokens to experts 0 and 1, both on rank 0."""
    N, E = batch * seq, cfg.experts
    classes = torch.arange(N) % E if routing == "balanced" else torch.where(torch.arange(N) < N // 2, 0,
                                                                              torch.arange(N) % E)
    spread = torch.randint(0, cfg.vocab // E, (N,), generator=torch.Generator().manual_seed(0))
    return (classes + E * spread).view(batch, seq).to(device)


# %% [markdown]
# ## Measuring every choice on 2 ranks
#
# One launch of 2 gloo ranks runs every (routing, choice) job: `none`, `full` and `moe`, the last two
# with the dispatched rows sent again ("repeat") or kept (`keep_dispatched`, "keep"). Each rank reports
# its store's peak, layer 0's stored bytes after the forward and its communication per phase, beside
# the closed forms. `all_to_all` takes the gradient all-reduce out of the backward's bytes.

# %%
def measure(cfg, batch, seq, device):
    """{(routing, choice label): [rank reports]}, every job in one launch of EP ranks."""
    params = route_by_token(init_params(cfg, seed=0, device=device), cfg)
    _, targets = make_batch(cfg, batch, seq, device, seed=0)
    torch.manual_seed(0)
    state = torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)
    keys, jobs = [], []
    for routing in ROUTINGS:
        ids = token_ids(routing, cfg, batch, seq, device)
        for label, policy, keep in CHOICES:
            keys.append((routing, label))
            jobs.append(ParallelJob(params, cfg, ids, targets, policy, Layout(ep=EP, keep_dispatched=keep),
                                    rng_state=state))
    start = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    with spawning_ranks():  # the ranks need picockpt, not this lesson's cells
        results = run_jobs(jobs, EP, device.type, start_method=start)
    return {key: reports for key, (_, _, reports) in zip(keys, results)}


def all_to_all(report, phase, predicted=False):
    """The all-to-all bytes of one phase (the layers' collectives; the gradients' all-reduce is the
    data-parallel buckets', counted apart as dp_bytes)."""
    return report["predicted_comm_bytes" if predicted else "comm_bytes"][phase]


# %% [markdown]
# ## Mixtral 8x7B at $W = 8$, predicted
#
# One layer, one 4096-token sequence per rank: $P = 4096 \cdot 2$ pairs sent by every rank. Each rank
# holds one expert; with balanced routing it receives $M = P$ rows, and with expert 0 taking twice its
# share, rank 0 receives $2P$ and the others the rest.

# %%
def mixtral_counts(skewed):
    """Per-expert rows of one Mixtral layer at ep=8, one sequence per rank: balanced, or expert 0 with
    twice its share and the others the rest, evenly."""
    pairs = MIXTRAL_EP * MIXTRAL_SEQ * 2
    share = pairs // 8
    if not skewed:
        return [share] * 8
    rest = pairs - 2 * share
    return [2 * share] + [rest // 7 + (1 if e < rest % 7 else 0) for e in range(7)]


def mixtral_rows():
    """(label, routing, rank, choice) -> (recompute all-to-all bytes, stored bytes after the forward) of one
    Mixtral 8x7B layer per rank, predicted."""
    cfg = Config.from_preset("mixtral-8x7b", dtype="bfloat16", attention="fused", layers=1)
    B = MIXTRAL_EP  # one sequence per rank
    rows = {}
    for routing, counts in (("balanced", mixtral_counts(False)), ("skewed", mixtral_counts(True))):
        for rank in ((0,) if routing == "balanced" else (0, 1)):
            for label, policy, keep in CHOICES:
                comm = ep_layer_comm_bytes(cfg, B, MIXTRAL_SEQ, policy, MIXTRAL_EP, rank, counts, keep)
                stored = ep_layer_stored_bytes(cfg, B, MIXTRAL_SEQ, policy, MIXTRAL_EP, rank, [counts], keep)
                rows[routing, rank, label] = (comm, stored, received_rows(cfg, counts, MIXTRAL_EP, rank))
    return cfg, rows


# %%
args = lesson_args()
cfg, batch, seq = shape(args.mode)
print(f"lesson 17, expert parallel on {EP} ranks, E={cfg.experts} k={cfg.experts_per_token}: "
      f"{shape_line(cfg, batch, seq, args.device)}")
reports = measure(cfg, batch, seq, ranks_device(args.device, EP))
grad_bytes = replicated_grad_bytes(cfg)
assert all(r["dp_bytes"] == r["predicted_dp_bytes"] == grad_bytes for ranks in reports.values() for r in ranks)

print(f"\nper rank: rows its experts received (every layer), store peak (measured | closed form), all-to-all "
      f"bytes per phase (the gradients' all-reduce, {grad_bytes:,} B, is the data-parallel buckets', apart):")
print(f"{'routing':<10}{'choice':<14}{'rank':>5}{'rows in':>16}{'peak':>13}{'closed form':>13}"
      f"{'forward':>11}{'recompute':>11}{'backward':>11}")
exact = {"peak": True, "comm": True, "layer": True}
for (routing, label), ranks in reports.items():
    for r in ranks:
        exact["peak"] &= r["peak_activation_bytes"] == r["predicted_activation_bytes"]
        exact["comm"] &= r["comm_bytes"] == r["predicted_comm_bytes"]
        exact["layer"] &= r["layer_stored_bytes"] == r["predicted_layer_stored_bytes"]
        print(f"{routing:<10}{label:<14}{r['rank']:>5}{' '.join(map(str, r['received_rows'])):>16}"
              f"{r['peak_activation_bytes']:>13,}{r['predicted_activation_bytes']:>13,}"
              + "".join(f"{all_to_all(r, phase):>11,}" for phase in PHASES))
print(f"every measured byte equals its closed form: store peaks {exact['peak']}, communication per phase "
      f"{exact['comm']}, layer 0 after the forward {exact['layer']}")

# %% [markdown]
# The all-to-all bytes above are each call's whole send buffer, the size nccl-tests calls S, this rank's own
# rows included: the rows a rank sends to its own experts never leave it. What does leave it is the buffer
# less those rows: for $S$ pairs of a rank's tokens routed to its own experts, the same forms with
# $P = M = S$ and $E/W$ counts taken away (`ep_sent_bytes`). At $W = 2$ with balanced routing that is
# about half the buffer.

# %%
print("what leaves each rank (all-to-all bytes sent to other ranks: measured | closed form), against the buffer:")
for (routing, label), ranks in reports.items():
    for r in ranks:
        sent, predicted = r["all_to_all_sent_bytes"], r["predicted_all_to_all_sent_bytes"]
        exact["sent"] = exact.get("sent", True) and sent == predicted
        print(f"  {routing:<10}{label:<14} rank {r['rank']}: " + ", ".join(
            f"{phase} {sent[phase]:,} | {predicted[phase]:,} of {all_to_all(r, phase):,} B" for phase in PHASES))
print(f"sent bytes equal their closed form: {exact['sent']}")

# %% [markdown]
# ## Repeat the dispatch, or keep its rows
#
# Under `full`, the difference between "repeat" and "keep" is one dispatch per layer not sent again,
# against the rows (and their weights) kept in layer 0 after the forward: $P/M$ bytes not moved per byte
# kept.

# %%
trade = {}
P = batch // EP * seq * cfg.experts_per_token  # pairs a rank sends per layer
for routing in ROUTINGS:
    for rank in range(EP):
        repeat, keep = reports[routing, "full, repeat"][rank], reports[routing, "full, keep"][rank]
        saved = (all_to_all(repeat, "recompute") - all_to_all(keep, "recompute")) // cfg.layers  # per layer
        kept = keep["layer_stored_bytes"] - repeat["layer_stored_bytes"]  # layer 0's rows and their weights
        trade[routing, rank] = saved / kept
        M = keep["received_rows"][0]
        print(f"{routing}, rank {rank}: under full, keeping the dispatched rows saves {saved:,} B of recompute "
              f"traffic per layer for {kept:,} B stored per layer: {saved / kept:.2f} B not moved per B kept "
              f"(P/M = {P}/{M}); at the store's peak "
              f"{keep['peak_activation_bytes'] - repeat['peak_activation_bytes']:,} B more (the rows of the "
              f"layers below the one recomputed at that moment)")
full = reports["balanced", "full, repeat"][0]
print(f"balanced: full recomputation moves {all_to_all(full, 'recompute') / all_to_all(full, 'forward'):.0%} of "
      f"the forward's all-to-all bytes again (all but the counts exchange, 8E bytes a layer)")
print("(what a checkpointed layer's recompute runs whole, as Megatron-LM's does; not a lower bound: under full "
      "a recomputed layer's output is the next layer's stored input, so its combine all-to-all need not run "
      "again, as a non-reentrant torch.utils.checkpoint stops early; picockpt's uniform schedules run it)")

# %% [markdown]
# With balanced routing a byte kept saves a byte sent; on the rank whose experts are popular it saves
# less, and that rank already stores the most.
#
# ## At Mixtral's size

# %%
mixtral, rows = mixtral_rows()
print(f"\none Mixtral 8x7B layer at ep={MIXTRAL_EP}, one {MIXTRAL_SEQ}-token sequence per rank, bf16 (predicted, "
      f"per rank): rows in, all-to-all bytes recomputation adds, stored after the forward")
L = Config.from_preset("mixtral-8x7b").layers
for (routing, rank, label), (comm, stored, M) in rows.items():
    print(f"  {routing:<9} rank {rank}  {label:<14}{M:>7} rows  recompute {mib(comm['recompute']):7.1f} MiB  "
          f"stored {mib(stored):7.1f} MiB   x {L} layers: {L * comm['recompute'] / GIB:5.2f} GiB moved, "
          f"{L * stored / GIB:5.2f} GiB stored")
balanced = mixtral_counts(False)
by_rank = [[count // MIXTRAL_EP for count in balanced]] * MIXTRAL_EP  # each rank's tokens spread as the batch's
for label, policy, keep in CHOICES[1:3]:
    buffer = ep_layer_comm_bytes(mixtral, MIXTRAL_EP, MIXTRAL_SEQ, policy, MIXTRAL_EP, 0, balanced, keep)
    sent = ep_sent_bytes(mixtral, MIXTRAL_EP, MIXTRAL_SEQ, policy, MIXTRAL_EP, 0, [by_rank], keep)
    print(f"  balanced, {label}: the buffers hold {mib(sum(buffer.values())):.1f} MiB a layer, "
          f"{mib(sum(sent.values())):.1f} MiB of it leaves the rank (7/8: one expert in 8 is its own)")

# %% [markdown]
# ## The figures
#
# The measured run: for each routing (rows), the all-to-all bytes per rank stacked by phase (left; rank
# 1 hatched, the black marks the closed form's total) and the store's peak per rank (right).

# %%
def plot_measured(cfg, batch, seq, reports):
    fig, axes = plt.subplots(2, 2, figsize=(15, 8.5))
    labels = [label for label, _, _ in CHOICES]
    x = np.arange(len(labels))
    width = 0.38
    for row, routing in enumerate(ROUTINGS):
        comm_ax, memory_ax = axes[row]
        for rank in range(EP):
            offset = (rank - 0.5) * width
            bottom = np.zeros(len(labels))
            for phase in PHASES:
                values = np.array([mib(all_to_all(reports[routing, label][rank], phase)) for label in labels])
                comm_ax.bar(x + offset, values, width * 0.95, bottom=bottom, color=PHASE_COLORS[phase],
                            hatch="//" if rank else None, edgecolor="white", label=phase if rank == 0 else None)
                bottom += values
            predicted = [mib(sum(all_to_all(reports[routing, label][rank], p, True) for p in PHASES))
                         for label in labels]
            comm_ax.plot(x + offset, predicted, "_", color="black", markersize=16, mew=2,
                         label="closed form (total)" if rank == 0 else None)
            peaks = [mib(reports[routing, label][rank]["peak_activation_bytes"]) for label in labels]
            closed = [mib(reports[routing, label][rank]["predicted_activation_bytes"]) for label in labels]
            first = reports[routing, labels[0]][rank]
            memory_ax.bar(x + offset, peaks, width * 0.95, color="#8172B3" if rank == 0 else "#CCB974",
                          label=f"rank {rank}: experts {first['experts']}, rows in per layer {first['received_rows']}")
            memory_ax.plot(x + offset, closed, "_", color="black", markersize=16, mew=2,
                           label="closed form" if rank == 0 else None)
        comm_ax.set_title(f"{routing} routing: all-to-all bytes per rank and phase (rank 1 hatched)", fontsize=10)
        comm_ax.set_ylabel("MiB moved by one rank")
        memory_ax.set_title(f"{routing} routing: the store's peak per rank", fontsize=10)
        memory_ax.set_ylabel("MiB")
        for ax in (comm_ax, memory_ax):
            ax.set_xticks(x, labels, fontsize=8)
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=7, loc="upper right")
            ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
    fig.suptitle(f"expert parallel on {EP} gloo ranks: L={cfg.layers}, h={cfg.hidden}, E={cfg.experts}, "
                 f"k={cfg.experts_per_token}, f={cfg.ffn}, batch {batch} x {seq} ({batch // EP} per rank), "
                 f"{cfg.dtype}; 'repeat': dispatch again to recompute, 'keep': keep the dispatched rows",
                 fontsize=10)
    fig.tight_layout()
    return save_figure(fig, "17_expert_parallel_measured")


paths = [plot_measured(cfg, batch, seq, reports)]
wrote(paths[-1])

# %% [markdown]
# One Mixtral 8x7B layer, predicted: the all-to-all bytes recomputation adds (left) and what the layer
# keeps after the forward (right), per rank and choice, balanced and skewed.

# %%
def plot_mixtral(cfg, rows):
    fig, (comm_ax, memory_ax) = plt.subplots(1, 2, figsize=(15, 5))
    labels = [label for label, _, _ in CHOICES]
    cases = [("balanced", 0, "balanced, any rank", "#4C72B0"), ("skewed", 0, "skewed, rank 0 (expert 0: 2x)",
                                                                 "#C44E52"),
             ("skewed", 1, "skewed, rank 1", "#55A868")]
    x = np.arange(len(labels))
    width = 0.27
    for index, (routing, rank, name, color) in enumerate(cases):
        offset = (index - 1) * width
        recompute = [mib(rows[routing, rank, label][0]["recompute"]) for label in labels]
        stored = [mib(rows[routing, rank, label][1]) for label in labels]
        M = rows[routing, rank, labels[0]][2]
        for ax, values in ((comm_ax, recompute), (memory_ax, stored)):
            bars = ax.bar(x + offset, values, width * 0.95, color=color, label=f"{name}: {M:,} rows in")
            for bar, value in zip(bars, values):
                ax.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=6, xytext=(0, 2), textcoords="offset points")
    comm_ax.set_title("all-to-all bytes recomputation adds, per layer and rank", fontsize=10)
    memory_ax.set_title("stored after the forward, per layer and rank (checkpoint, routing, kept rows)", fontsize=10)
    for ax in (comm_ax, memory_ax):
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, loc="upper right")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.35)
    fig.suptitle(f"one Mixtral 8x7B layer at ep={MIXTRAL_EP} (h={cfg.hidden}, f={cfg.ffn}, E={cfg.experts}, "
                 f"k={cfg.experts_per_token}, bf16, fused attention), one {MIXTRAL_SEQ}-token sequence per rank: "
                 f"predicted by picockpt/parallel/expert_parallel/ep_forms.py", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, "17_mixtral_8x7b_ep8")


paths.append(plot_mixtral(mixtral, rows))
wrote(paths[-1])

# %% [markdown]
# ## Exercises
#
# All three for the Mixtral 8x7B layer above ($h = 4096$, $E = 8$, $k = 2$, bf16 activations, fp32
# routing weights) at $W = 8$, one 4096-token sequence per rank, with skewed routing: expert 0, on rank 0,
# receives twice its balanced share.
#
# **1.** How many MiB do rank 0's all-to-alls move in the layer's forward (the counts, the dispatch and
# the combine)?

# %%
answer = 192  # MiB

# %%
skewed = mixtral_counts(True)
pairs = MIXTRAL_SEQ * mixtral.experts_per_token  # P: the pairs one rank sends
rows_in = received_rows(mixtral, skewed, MIXTRAL_EP, 0)  # M: the rows rank 0's expert receives
forward = ep_layer_comm_bytes(mixtral, MIXTRAL_EP, MIXTRAL_SEQ, "none", MIXTRAL_EP, 0, skewed)["forward"]
check("MiB rank 0's all-to-alls move in one skewed Mixtral layer's forward", answer, forward / 2**20,
      why=f"8E + P(h·2 + 4) + M·h·2 with P = {pairs:,} pairs sent and M = {rows_in:,} rows received: "
          f"{8 * mixtral.experts} + {pairs * (2 * mixtral.hidden + 4):,} + {rows_in * 2 * mixtral.hidden:,} = "
          f"{forward:,} bytes; the popular expert makes the combine twice the dispatch")

# %% [markdown]
# **2.** Under `full`, keeping the dispatched rows (`keep_dispatched`) spares the dispatch when the layer
# is recomputed. How many MiB more does the layer keep on rank 0 after the forward?

# %%
answer = 128  # MiB

# %%
kept_bytes = rows["skewed", 0, "full, keep"][1] - rows["skewed", 0, "full, repeat"][1]
spared = rows["skewed", 0, "full, repeat"][0]["recompute"] - rows["skewed", 0, "full, keep"][0]["recompute"]
check("MiB keep_dispatched adds to a skewed Mixtral layer on rank 0 (full)", answer, kept_bytes / 2**20,
      why=f"M(h·2 + 4) = {rows_in:,}·{2 * mixtral.hidden + 4:,} = {kept_bytes:,} bytes, to spare a dispatch of "
          f"P(h·2 + 4) = {spared:,}: {spared / kept_bytes:.2f} bytes not moved per byte kept (P/M)")

# %% [markdown]
# **3.** Which adds fewer all-to-all bytes to rank 0's recomputation of that layer: `full` with the rows
# kept ("full, keep") or `moe` with the rows sent again ("moe, repeat")?

# %%
answer = "moe, repeat"

# %%
rivals = ("full, keep", "moe, repeat")
fewer = {rank: min(rivals, key=lambda label: rows["skewed", rank, label][0]["recompute"]) for rank in (0, 1)}
check("the choice that moves fewer bytes to recompute on skewed rank 0", answer, fewer[0],
      why="full reruns the layer's forward, so even with the rows kept it sends the combine again, M·h·2 = "
          f"{mib(rows['skewed', 0, 'full, keep'][0]['recompute']):.0f} MiB on rank 0; moe recomputes only inside "
          f"the experts, from the rows dispatched again, P(h·2 + 4) = "
          f"{mib(rows['skewed', 0, 'moe, repeat'][0]['recompute']):.0f} MiB on every rank, and no combine. On "
          f"rank 1 (M = {rows['skewed', 1, 'none'][2]:,} rows) it is the other way: {fewer[1]!r}")

# %%
repeat, keep = rows["balanced", 0, "full, repeat"], rows["balanced", 0, "full, keep"]
RESULT = {"figures": [str(p) for p in paths],
          "summary": {"store peak per rank = closed form": bool(exact["peak"]),
                      "communication per phase = closed form": bool(exact["comm"]),
                      "layer stored after forward = closed form": bool(exact["layer"]),
                      "balanced: bytes not moved per byte kept (rank 0)": round(trade["balanced", 0], 3),
                      "skewed: bytes not moved per byte kept (rank 0)": round(trade["skewed", 0], 3),
                      "Mixtral ep=8 full recompute MiB per layer (repeat | keep)":
                          f"{mib(repeat[0]['recompute']):.0f} | {mib(keep[0]['recompute']):.0f}",
                      "Mixtral ep=8 full stored MiB per layer (repeat | keep)":
                          f"{mib(repeat[1]):.0f} | {mib(keep[1]):.0f}"}}

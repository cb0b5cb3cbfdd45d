# %% [markdown]
# # Lesson 30: pipeline schedules beyond 1F1B: interleaving, zero bubble, and what they store
#
# Lesson 16 ran AFAB and 1F1B on ranks: stage 0 holds $P$ micro-batches, and the pipeline idles
# $(P-1)/(M+P-1)$ of the step while it fills and drains. Two schedules shrink that bubble, and this lesson
# runs both on gloo ranks, each rank the engine's own loop, beside the single process:
#
# - **interleaved 1F1B** (Narayanan et al. 2021, sec. 2.2; Megatron-LM's
#   `forward_backward_pipelining_with_interleaving`): each rank holds $V$ chunks of layers, chunk $c$ of rank $s$
#   being virtual stage $cP + s$, so a micro-batch goes round the ring of ranks $V$ times. A chunk's forward is
#   $1/V$ of a stage's, and the idle share falls to $(P-1)/(VM+P-1)$; the price is more micro-batch-chunks in
#   flight and $V$ times the messages. The ranks exchange them step by step as Megatron-LM does (one group per
#   step: a warm-up forward, a steady forward and backward, a cool-down backward), the order NCCL needs.
# - **ZB-H1** (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3): each backward split into **B**, the
#   input's gradient that the previous stage waits for, and **W**, the weights' gradients that nobody waits for.
#   Stage $s$ lets $s$ of its W's wait and runs them where 1F1B would idle. Its bubble *time* is a third of
#   1F1B's, $(P-1)(T_F+T_B-T_W)$ against $(P-1)(T_F+T_B+T_W)$ (sec. 3, $T_B$ the input-gradient pass
#   alone), but not its idle *share*: with equal F, B, W times that is $(P-1)/(3M+P-1)$ against
#   $(P-1)/(M+P-1)$, at $P = 4$, $M = 8$ 0.111 against 0.273, 0.41 of it (exercise 2 below computes it).
#   picockpt's backward already computes the two as separate matmuls (`ops/linear.py`): inside
#   `deferred_weight_grads()` each `linear_backward` returns what its $dW$ reads, $dy$ and $x$, and the stage
#   keeps them in a store of their own until its W.
#
# Then the question recomputation asks of a schedule: **what does deferring W cost in bytes, and does
# recomputation still save them?** Every number below is measured on the ranks and checked, to the byte,
# against the closed form the tests hold each rank to (`pipeline_parallel/pp_forms.py`: the micro-batches'
# stores walked along the rank's order, `pp_plan.in_flight_peak`).
#
# **Run it** as a script, `python lessons/30_pipeline_schedules.py` (about a minute on 2 cores; `--fast` is
# seconds), or step through this notebook (flags from `PICOCKPT_LESSON_ARGS`).

# %%
import multiprocessing

import matplotlib.pyplot as plt
import numpy as np
import torch

from _check import check
from _lesson import Spread, choose, large, lesson_args, spawning_ranks, wrote
from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.cost import bubble_idle
from picockpt.measurement.measure import make_batch
from picockpt.parallel import Layout, ParallelJob, run_jobs
from picockpt.parallel.job import layer_forms
from picockpt.parallel.launch import run_ranks
from picockpt.parallel.pipeline_parallel.pipelining_peer import pipelining_rank_steps
from picockpt.parallel.pipeline_parallel.pp_orders import run_orders
from picockpt.parallel.pipeline_parallel.pp_schedules import actions, in_flight
from picockpt.teaching.plotting import save_figure

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))  # (schedule, virtual stages)
POLICIES = ("none", "every:2", "full")
P = 2


def shapes(mode):
    """(cfg, batch, seq, M) of the memory runs, and repeats of the timing runs."""
    tiny = Config(vocab=64, hidden=32, layers=8, heads=4, kv_heads=2, ffn=64, max_seq=64, dropout=0.1)
    cpu = Config(vocab=256, hidden=128, layers=8, heads=4, kv_heads=2, ffn=384, max_seq=128, dropout=0.1)
    return choose(mode, fast=dict(run=(tiny, 4, 16, 4), repeats=1), cpu=dict(run=(cpu, 8, 64, 8), repeats=3),
                  large=dict(run=(large(layers=8, dropout=0.1), 8, 512, 8), repeats=3))


def label(schedule, V):
    return schedule + (f" V={V}" if V > 1 else "")


# %% [markdown]
# ## The orders
#
# Each rank's actions, F a forward, B a backward (under ZB-H1 its input gradient only), W the weight gradients;
# interleaved, `F1.0` is micro-batch 1 of chunk 0. These are the orders the ranks run
# (`pipeline_parallel/pp_schedules.py`), and the clock of lesson 16 (`pp_orders.run_orders`) runs them too.

# %%
def written(action, V):
    return f"{action.kind}{action.microbatch}" + (f".{action.chunk}" if V > 1 else "")


for schedule, V in SCHEDULES:
    for stage in range(P):
        print(f"{label(schedule, V):<15} stage {stage}: "
              + " ".join(written(a, V) for a in actions(schedule, P, 4, stage, V)))

# %% [markdown]
# ## Stored bytes, per schedule and policy, measured
#
# One launch of 2 gloo ranks runs every schedule under `none`, `every:2`, `full` and a stage-aware budget:
# SIZE is, per schedule, what `every:2` stores on its busiest rank, and the planner (`pp_plan.py`) picks for each
# stage (interleaved: for all of a rank's chunks at once, `plan_chunks`) the least recomputation whose walk
# along the order fits. Every rank's measured peak must equal its closed form, and every gradient the single
# process's.

# %%
def measure(cfg, batch, seq, M, repeats):
    params = init_params(cfg, seed=0)
    input_ids, targets = make_batch(cfg, batch, seq, "cpu", seed=0)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    def job(policy, schedule, V, **extra):
        return ParallelJob(params, cfg, input_ids, targets, policy,
                           Layout(pp=P, microbatches=M, schedule=schedule, virtual_stages=V), rng_state=state, **extra)
    jobs = [job(policy, s, V) for s, V in SCHEDULES for policy in POLICIES]
    for s, V in SCHEDULES:
        size = max(layer_forms(job("every:2", s, V), stage).peak_bytes for stage in range(P))
        jobs.append(job(f"budget:{size}", s, V))
    timed = [job("full", s, V, measure=False) for _ in range(repeats) for s, V in SCHEDULES]  # interleaved
    with spawning_ranks():  # the ranks need picockpt, not this lesson's cells
        results = run_jobs(jobs + timed, P, "cpu", start_method=START)
    torch.set_rng_state(state)
    _, grads0 = loss_and_grads(params, cfg, input_ids, targets, "none")
    worst = max(((grads[n] - grads0[n]).abs().max() / grads0[n].abs().max()).item()
                for _, grads, _ in results for n in grads0)
    names = [p for _ in SCHEDULES for p in POLICIES] + ["budget"] * len(SCHEDULES)  # each job's policy, as named
    memory = {(j.layout.schedule, j.layout.virtual_stages, name): sorted(ranks, key=lambda r: r["stage"])
              for j, name, (_, _, ranks) in zip(jobs, names, results)}
    timing = [(j.layout.schedule, j.layout.virtual_stages, sorted(ranks, key=lambda r: r["stage"]))
              for j, (_, _, ranks) in zip(timed, results[len(jobs):])]
    return memory, timing, worst


args = lesson_args()
plan = shapes(args.mode)
cfg, batch, seq, M = plan["run"]
memory, timing, worst = measure(cfg, batch, seq, M, plan["repeats"])
print(f"L={cfg.layers} h={cfg.hidden} f={cfg.ffn}, {batch} x {seq} tokens in M={M} micro-batches, P={P}, fp32, "
      f"dropout {cfg.dropout}; every gradient within {worst:.1e} of the single process (relative)")
exact = all(r["peak_activation_bytes"] == r["predicted_activation_bytes"] for ranks in memory.values() for r in ranks)
assert exact and worst < 1e-5, "a rank's stored peak or a gradient differs from its closed form / the single process"
print(f"{'schedule':<15}" + "".join(f"{p:>26}" for p in POLICIES + ("budget",)))
for s, V in SCHEDULES:
    cells = [" / ".join(f"{r['peak_activation_bytes']:,}" for r in memory[s, V, p]) for p in POLICIES + ("budget",)]
    print(f"{label(s, V):<15}" + "".join(f"{c:>26}" for c in cells))
print("(stored peak in bytes, stage 0 / stage 1; each equal to its closed form: yes)")

# %% [markdown]
# Three things to read off the table:
#
# - **Interleaving** stores more on stage 0 under `none`: more micro-batch-chunks in flight
#   ($2(P-1) + (V-1)P + 1$ of them, each $1/V$ of the stage), the factor $1 + (P-1)/(PV)$ of Korthikanti et al.
#   (2022, sec. 4.2.3) where $M > P$.
# - **ZB-H1 under `none`**: stage 0 runs every W straight after its B and stores what 1F1B does (a W reads
#   linear inputs the layer kept anyway, and the output gradients it adds are fewer bytes than B frees). Stage
#   $s$ lets $s$ W's wait: stage 1's peak is 1F1B's plus one micro-batch's waiting W (printed below).
# - **ZB-H1 under `full`** loses much of what recomputation saved on a stage whose W's wait (stage 1 here, the
#   busiest rank): the layer is recomputed before its B, and its W reads those recomputed inputs, so they stay
#   until W runs. Stage 0, whose W's run straight after their B's, keeps most of the saving (the rows below
#   print both). Deferring W is a memory cost that checkpointing cannot remove, only a schedule that runs W
#   sooner (or recomputes it again).

# %%
def closed_forms_for(s, V, policy, stage):
    """The closed forms of one stage's rank (parallel/job.py), the shapes of this lesson's runs."""
    params = init_params(cfg, seed=0)
    input_ids, targets = make_batch(cfg, batch, seq, "cpu", seed=0)
    return layer_forms(ParallelJob(params, cfg, input_ids, targets, policy,
                                    Layout(pp=P, microbatches=M, schedule=s, virtual_stages=V)), stage)


one_w = [f.w_layer_bytes * len(f.layers) for f in (closed_forms_for("zb-h1", 1, "full", s) for s in range(P))]
for policy in ("none", "full"):
    for stage in range(P):
        zb, one = (memory[s, 1, policy][stage]["peak_activation_bytes"] for s in ("zb-h1", "1f1b"))
        print(f"stage {stage} under {policy}: ZB-H1 stores {zb:,} B against 1F1B's {one:,} B ({zb / one:.1f}x), "
              f"{(zb - one) / one_w[stage]:.2f} of one micro-batch's waiting W ({one_w[stage]:,} B) more")


def plot_memory():
    fig, ax = plt.subplots(figsize=(9, 4))
    width, x = 0.13, np.arange(len(POLICIES))
    for i, (s, V) in enumerate(SCHEDULES):
        for stage in range(P):
            values = [memory[s, V, p][stage]["peak_activation_bytes"] / 2**20 for p in POLICIES]
            ax.bar(x + (i * P + stage - 2.5) * width, values, width, color=f"C{i}", alpha=1.0 - 0.45 * stage,
                   label=f"{label(s, V)}, stage {stage}")
    ax.set_xticks(x, POLICIES)
    ax.set_ylabel("stored peak (MiB), measured = closed form")
    ax.set_title(f"P={P}, M={M}: what each schedule stores per stage (L={cfg.layers}, h={cfg.hidden}, "
                 f"{batch}x{seq} tokens)", fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return save_figure(fig, "30_schedule_memory")


figure = plot_memory()
wrote(figure)

# %% [markdown]
# ## The bubble, measured and modelled
#
# Each rank's timeline gives its bubble, $1 - \text{computing}/\text{step}$, over interleaved repeats of the three
# schedules under `full`. Beside it, two models: the equal-time formula, and the clock (`run_orders`) paced by the
# rank's own measured times, its forward seconds per action and its backward seconds (recomputation included)
# split into B and W by their matmul FLOPs (`ChunkForms.action_flops`). The clock leaves out what a CPU run is
# full of: the sends, Python between actions, two ranks sharing a machine.

# %%
def paced(s, V, ranks):
    """The clock's idle share per rank, each action as long as the rank measured it on average."""
    forms = [closed_forms_for(s, V, "full", stage) for stage in range(P)]
    seconds = []
    for f, r in zip(forms, ranks):
        chunks = f.chunks
        flops = [c.action_flops() for c in chunks]
        t = r["timeline_seconds"]
        back = (t["backward"] + t["recompute"]) / sum(x["B"] + x["W"] for x in flops) / M  # seconds per FLOP
        fwd = t["forward"] / sum(x["F"] for x in flops) / M
        seconds.append([{"F": fwd * x["F"], "B": back * x["B"], "W": back * x["W"]} for x in flops])
    orders = [actions(s, P, M, stage, V) for stage in range(P)]
    return run_orders(orders, P, V, seconds=lambda stage, a: seconds[stage][a.chunk][a.kind])["idle"]


bubbles = {}
for s, V, ranks in timing:
    bubbles.setdefault((s, V), []).append((max(r["bubble"] for r in ranks), max(paced(s, V, ranks))))
print(f"{'schedule':<15}{'measured bubble':>28}{'clock, measured times':>26}{'equal times':>14}")
for (s, V), runs in bubbles.items():
    measured, clock = Spread(tuple(b for b, _ in runs)), Spread(tuple(c for _, c in runs))
    print(f"{label(s, V):<15}{measured.text('{:.1%}'):>28}{clock.text('{:.1%}'):>26}"
          f"{bubble_idle(P, M, s, V):>14.1%}")
order = sorted(bubbles, key=lambda k: Spread(tuple(b for b, _ in bubbles[k])).median)
apart = all(Spread(tuple(b for b, _ in bubbles[a])).high < Spread(tuple(b for b, _ in bubbles[b])).low
            for a, b in zip(order, order[1:]))
equal_order = sorted(bubbles, key=lambda k: bubble_idle(P, M, *k))
paced_order = sorted(bubbles, key=lambda k: Spread(tuple(c for _, c in bubbles[k])).median)
print("the models, least idle first: equal times " + " < ".join(label(*k) for k in equal_order)
      + "; clock paced by the measured times " + " < ".join(label(*k) for k in paced_order))
if args.mode == "fast":
    print("measured bubbles: timing not meaningful at --fast shapes (milliseconds a step, one repeat)")
elif apart:
    print("measured, least idle first: " + " < ".join(label(*k) for k in order) + " (every repeat agrees)"
          + ("; the same order as the paced clock" if order == paced_order else "; not the paced clock's order"))
else:
    print("measured order of the bubbles: inconclusive on this machine (the repeats overlap)")

# %% [markdown]
# On a busy 2-core CPU the measured bubble sits above both models: the step includes every send and receive
# and the Python between actions, and interleaving doubles the messages. The two models need not agree with
# each other either: paced by the ranks' own times, a chunk's forward is not exactly $1/V$ of a stage's and a
# backward not exactly twice a forward, so the clock can rank interleaving ahead of ZB-H1 where equal times rank
# it behind. Neither model is the verdict: the measured line is, and it names an order only when every repeat
# agrees; otherwise this machine cannot tell the schedules apart, and the lesson draws no conclusion from it.
# Where the clock ranks interleaving first and the measured line does not, look first at the messages
# interleaving doubles: the clock leaves them out.
#
# **Can recomputation fill the bubble?** Recomputation is work that can run before the gradient it serves
# arrives: picockpt's `recompute_early` (lesson 16) recomputes a stage's top segment while it waits for its
# gradient, the same bytes held longer. ZB-H1 fills the same waits with W instead, at the price measured above;
# under `full` every W also keeps the recomputed inputs it reads, so the two do not stack for free.

# %% [markdown]
# ## The peer: torch.distributed.pipelining, side by side
#
# torch's own `ScheduleInterleaved1F1B` and `ScheduleInterleavedZeroBubble` on the autograd reference model
# (`pipeline_parallel/pipelining_peer.py`: $P = 2$, $V = 2$, one gloo launch, no dropout: torch's stages would
# draw masks in another order). Its gradients must equal the single process's; its memory is what autograd saves
# for backward (`saved_tensors_hooks`), a different inventory from picockpt's store, so only the ranks' order is
# compared: which rank holds more.

# %%
peer_cfg = cfg.replace(dropout=0.0, layers=4)
peer_params = init_params(peer_cfg, seed=0)
peer_ids, peer_targets = make_batch(peer_cfg, 4, seq, "cpu", seed=0)
with spawning_ranks():
    peer = run_ranks(pipelining_rank_steps, P, peer_params, peer_cfg, peer_ids, peer_targets,
                     ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"), 2, 4, start_method=START)
_, peer_reference = loss_and_grads(peer_params, peer_cfg, peer_ids, peer_targets, "none")
for v, name in enumerate(("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")):
    runs = [peer[r][v] for r in range(P)]
    grads = {k: g for run in runs for k, g in run.get("grads", {}).items()}
    diff = max(((grads[k] - peer_reference[k]).abs().max() / peer_reference[k].abs().max()).item()
               for k in peer_reference)
    print(f"torch {name}: gradients within {diff:.1e} of the single process; saved for backward at its peak "
          + ", ".join(f"rank {r} {run['peak_saved_bytes']:,} B" for r, run in enumerate(runs)))
ours = [r["peak_activation_bytes"] for r in memory["interleaved", 2, "none"]]
theirs = [peer[r][0]["peak_saved_bytes"] for r in range(P)]
agree = ("agree: rank 0 has the most micro-batch-chunks in flight in both" if np.argmax(ours) == np.argmax(theirs)
         else "disagree: the two inventories weigh the ranks' tensors differently")
print(f"interleaved 1F1B, which rank holds more: picockpt's store (none) rank {int(np.argmax(ours))}, torch's "
      f"saved tensors rank {int(np.argmax(theirs))}; they {agree}")

# %% [markdown]
# ## Exercises
#
# **1.** Interleaved 1F1B, $P = 2$ stages, $V = 2$ chunks a rank, $M = 4$ micro-batches: at most how many
# micro-batch-chunks does rank 0 hold from a forward to its backward?

# %%
answer = 5  # micro-batch-chunks

# %%
check("micro-batch-chunks rank 0 holds, interleaved P = 2, V = 2, M = 4", answer, in_flight("interleaved", 2, 4, 0, 2),
      rel=0, why="its warm-up is (P - 1) 2 + (V - 1) P = 4 forwards, and the steady state's first forward comes "
                 "before the first backward: 5, against 1F1B's P = 2 micro-batches of twice the layers")

# %% [markdown]
# **2.** ZB-H1 with equal F, B and W times, $P = 4$, $M = 8$: what share of the step does a stage idle?

# %%
answer = 0.111  # share of the step

# %%
check("ZB-H1's idle share, P = 4, M = 8, equal F, B, W", answer, bubble_idle(4, 8, "zb-h1"),
      why="the step is M (F + B + W) + (P - 1)(F + B - W) = 24 + 3 time units, idle (P - 1)/(3M + P - 1) = 3/27; "
          f"1F1B idles (P - 1)/(M + P - 1) = {bubble_idle(4, 8):.3f} of its own, longer step: its bubble time, "
          f"(P - 1)(F + B + W) = 9 units, is three times ZB-H1's 3, its share "
          f"{bubble_idle(4, 8) / bubble_idle(4, 8, 'zb-h1'):.2f} times")

# %%
stored = {stage: [memory[s, 1, "full"][stage]["peak_activation_bytes"] for s in ("zb-h1", "1f1b")] for stage in range(P)}
RESULT = {"figures": [str(figure)],
          "summary": {"every stage's stored peak = its closed form": exact,
                      "worst gradient difference (relative)": f"{worst:.1e}",
                      **{f"stage {stage} under full, ZB-H1 / 1F1B stored": f"{zb / one:.2f}"
                         for stage, (zb, one) in stored.items()},
                      **{f"equal-time bubble, {label(s, V)}": f"{bubble_idle(P, M, s, V):.1%}" for s, V in SCHEDULES}}}

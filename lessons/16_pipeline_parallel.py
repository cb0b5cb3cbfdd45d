# %% [markdown]
# # Lesson 16: pipeline parallelism with recomputation, and data parallelism with overlapped all-reduces
#
# A pipeline splits the layers over $P$ stages (processes); the batch is cut into $M$ micro-batches that
# flow through them, activations forward and their gradients back, point to point. Each stage runs the
# engine's own loop on each micro-batch: store per the policy, recompute from the nearest checkpoint,
# use, drop. What changes is how many micro-batches a stage holds at once. AFAB (all forwards, then all
# backwards: GPipe, Huang et al. 2019) holds all $M$ on every stage; 1F1B (PipeDream-Flush, Narayanan et
# al. 2021) starts each backward as early as it can, so stage $s$ holds $w = \min(P - s, M)$: stage 0
# holds $P$ micro-batches of $L/P$ layers, about $L$ layers' worth whatever $P$ is (Korthikanti et al.
# 2022, sec. 4.2.3). Every backward of a stage runs while the $w - 1$ other micro-batches in flight hold
# what their forwards stored, so
#
# $$\text{stage peak} = (w - 1)\,E + \text{one micro-batch's own peak}$$
#
# with $E$ what one micro-batch's forward leaves stored. Here it is measured to the byte, for every
# policy, against the closed forms of `picockpt/parallel/pipeline_parallel/pp_forms.py`. What to look at:
#
# * **stage memory**: per stage, AFAB against 1F1B under each policy, the points (measured) on the lines
#   (the closed form). Under 1F1B the first stage is the one that must fit.
# * **stage-aware budget**: `budget:SIZE` plans each stage with its own in-flight count: stage 0
#   recomputes, the later stages keep more. Against the best uniform policy whose largest stage fits the
#   same SIZE: the same or a lower peak, and less recomputation.
# * **Gantt**: every rank's forward, recompute, backward and waits, with and without recompute-early (a
#   stage waiting for a gradient recomputes that micro-batch's top segment meanwhile), and the measured
#   bubble against $(P - 1)/(M + P - 1)$, the idle share of the step. Narayanan et al. (2021, sec. 2.2.1)
#   and the Ultra-Scale Playbook state the bubble in another convention, bubble time over ideal
#   compute time, $(P - 1)/M$; both are below, with the conversion.
# * **data parallel**: gradients all-reduced per layer as soon as they are final, overlapping the rest of
#   the backward, against all-reducing them after it: the exposed time.
# * **Llama 3 70B**: predicted only: $p = 8$ stages, the first holding about $L$ layers' worth;
#   interleaving multiplies that by $1 + (p - 1)/(p v)$ ($v$ model chunks per stage; Korthikanti et al.
#   write $m$ for it, here the number of micro-batches).
#
# **Run it** as a script, `python lessons/16_pipeline_parallel.py` (the CPU run: 4 and 2 gloo ranks,
# about a minute; `--fast` for seconds, what the tests run), or step through this notebook, where the
# same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset: the CPU run).

# %%
import multiprocessing
from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np
import torch

from _check import check
from _lesson import (FAST_TIMING, Claim, Spread, choose, large, lesson_args, ranks_device, shape_line, spawning_ranks,
                     timed_claim, wrote)
from picockpt import Config, init_params
from picockpt.planning.published import GIB
from picockpt.measurement.measure import make_batch
from picockpt.parallel import Layout, ParallelJob, run_jobs
from picockpt.parallel.tensor_parallel.tp_forms import rank_layer_inventory
from picockpt.parallel.pipeline_parallel.pp_forms import ChunkForms
from picockpt.parallel.pipeline_parallel.pp_schedules import actions, bubble_fraction, in_flight, unequal_bubble
from picockpt.teaching.plotting import PHASE_COLORS, mib, policy_color, save_figure
from picockpt.recompute.policy import SELECTIVE

POLICIES = ("none", "selective", "every:2", "full")
RIVALS = ("none", "selective", "cheap", "every:2", "every:2+selective", "every:4", "full", "full+selective")
KIND_COLORS = {**PHASE_COLORS, "wait": "#D9D9D9", "send": "#9E9E9E", "reduce": "#8172B3", "idle": "white"}
START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"

# %% [markdown]
# ## The shapes, and the closed forms per stage
#
# Three runs: the memory run on $P$ stages, the timing run on 2 stages (one core per rank on a 2-core
# CPU) and the data-parallel run (2 replicas of a wider model: more gradient bytes to move).
# `uniform_peaks` is the closed form of every stage under one policy: its stored peak, and the FLOPs
# its $M$ micro-batches recompute (`ChunkForms`).

# %%
def shapes(mode):
    """The memory run (P stages), the timing run (2 stages: one core per rank on a 2-core CPU) and the
    data-parallel run (2 replicas of a wider model: more gradient bytes to move)."""
    tiny = Config(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, max_seq=64, dropout=0.1)
    cpu = Config(vocab=256, hidden=128, layers=8, heads=4, kv_heads=2, ffn=448, max_seq=256, dropout=0.1)
    return choose(mode,
                  fast=dict(memory=(tiny, 4, 16, 2, 4), timing=(tiny.replace(dropout=0.0), 4, 16, (1, 4)),
                            dp=(tiny.replace(dropout=0.0), 4, 16), repeats=1),
                  cpu=dict(memory=(cpu, 8, 64, 4, 8), timing=(cpu.replace(dropout=0.0), 8, 128, (1, 2, 4, 8)),
                           dp=(cpu.replace(hidden=256, heads=8, kv_heads=4, ffn=896, dropout=0.0), 4, 128), repeats=5),
                  large=dict(memory=(large(layers=8, dropout=0.1), 8, 512, 4, 8),
                             timing=(large(layers=8), 8, 512, (1, 2, 4, 8)), dp=(large(layers=8), 4, 512), repeats=3))


def batch_of(cfg, batch, seq, device):
    params = init_params(cfg, seed=0, device=device)
    return params, *make_batch(cfg, batch, seq, device, seed=0)


def rng(device):
    torch.manual_seed(0)
    return torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)


def uniform_peaks(cfg, batch, seq, pp, M, schedule, policy):
    forms = [ChunkForms(cfg, batch, seq, policy, Layout(pp=pp, microbatches=M, schedule=schedule), s) for s in range(pp)]
    return [f.peak_bytes for f in forms], [f.M * f.recompute_flops for f in forms]


# %% [markdown]
# ## Measuring every stage's memory
#
# One launch of $P$ gloo ranks runs every job: each policy under both schedules, the stage-aware
# `budget:SIZE` beside the best uniform policy that fits the same SIZE (the one that recomputes the
# least among `RIVALS`), and `full` with and without recompute-early. SIZE is what `every:2` needs on its
# worst stage under 1F1B. Each rank reports its tracker's stored peak and the closed form's.

# %%
def measure_memory(shape, device):
    cfg, batch, seq, pp, M = shape
    params, input_ids, targets = batch_of(cfg, batch, seq, device)
    state = rng(device)
    size = max(uniform_peaks(cfg, batch, seq, pp, M, "1f1b", "every:2")[0])  # what 'every:2' needs on its worst stage
    fitting = [(sum(uniform_peaks(cfg, batch, seq, pp, M, "1f1b", p)[1]), p) for p in RIVALS
               if max(uniform_peaks(cfg, batch, seq, pp, M, "1f1b", p)[0]) <= size]
    best_uniform = min(fitting)[1]
    layout = Layout(pp=pp, microbatches=M)
    jobs = [ParallelJob(params, cfg, input_ids, targets, policy, replace(layout, schedule=schedule), measure=False,
                        rng_state=state) for schedule in ("afab", "1f1b") for policy in POLICIES]
    jobs += [ParallelJob(params, cfg, input_ids, targets, policy, layout, rng_state=state)
             for policy in (f"budget:{size}", best_uniform)]
    jobs += [ParallelJob(params, cfg, input_ids, targets, "full", replace(layout, recompute_early=early),
                         rng_state=state) for early in (False, True)]
    with spawning_ranks():  # the ranks need picockpt, not this lesson's cells
        results = run_jobs(jobs, pp, device.type, start_method=START)
    reports = {(job.layout.schedule, job.policy, job.layout.recompute_early): sorted(ranks, key=lambda r: r["stage"])
               for job, (_, _, ranks) in zip(jobs, results)}
    return reports, size, best_uniform


# %%
args = lesson_args()
plans = shapes(args.mode)
cfg, batch, seq, pp, M = plans["memory"]
print(f"lesson 16, pipeline P={pp}, M={M}: {shape_line(cfg, batch, seq, args.device)}")
reports, size, best_uniform = measure_memory(plans["memory"], ranks_device(args.device, pp))

print("\nstored peak per stage, measured | closed form (bytes), and micro-batches in flight:")
exact = True
for (schedule, policy, early), ranks in reports.items():
    exact &= all(r["peak_activation_bytes"] == r["predicted_activation_bytes"] for r in ranks)
    row = "  ".join(f"{r['peak_activation_bytes']:>10,} | {r['predicted_activation_bytes']:<10,} "
                    f"x{r['microbatches_in_flight']}" for r in ranks)
    print(f"  {schedule:<5} {policy + (' early' if early else ''):<20} {row}")
print(f"every stage's stored peak equals (in flight - 1) x E + one micro-batch's peak: {exact}")

# %% [markdown]
# Under AFAB every stage holds all $M$ micro-batches; under 1F1B stage $s$ holds $\min(P - s, M)$, so
# the first stage stores the most, and the last one micro-batch at a time, the head's logits included.
#
# ## A budget per stage
#
# `budget:SIZE` plans each stage's micro-batch for its own in-flight count $w$: the least recomputation
# such that $(w - 1)\,E + \text{peak} \le \text{SIZE}$ (`plan_in_flight` in `picockpt/parallel/pipeline_parallel/pp_plan.py`). A uniform policy has to
# fit the first stage, and so over-recomputes on the others.

# %%
planned, uniform = reports["1f1b", f"budget:{size}", False], reports["1f1b", best_uniform, False]
planned_recompute = sum(r["flops"]["recompute"] for r in planned)
uniform_recompute = sum(r["flops"]["recompute"] for r in uniform)
fits = all(r["peak_activation_bytes"] <= size for r in planned)
print(f"\nbudget:{size} per stage (what every:2 needs on its worst stage), 1F1B: the stage-aware plan peaks at "
      f"{max(r['peak_activation_bytes'] for r in planned):,} B and recomputes {planned_recompute / 1e9:.4f} GFLOP; "
      f"the best uniform policy that fits, {best_uniform}, peaks at "
      f"{max(r['peak_activation_bytes'] for r in uniform):,} B and recomputes {uniform_recompute / 1e9:.4f} GFLOP "
      f"({planned_recompute / uniform_recompute:.0%} of it)" if uniform_recompute else "")
for r in planned:
    print(f"  stage {r['stage']}: {r['microbatches_in_flight']} in flight, schedule from {r['stage_schedule']}, "
          f"peak {r['peak_activation_bytes']:,} B, recompute {r['flops']['recompute'] / 1e9:.4f} GFLOP")

# %% [markdown]
# ## Recompute-early
#
# A stage that waits for a micro-batch's gradient can recompute that micro-batch's top segment meanwhile,
# instead of after the gradient arrives. It stores nothing more at the peak (the peak is reached inside a
# backward either way); between backwards it holds the recomputed segment longer.

# %%
late, on_time = reports["1f1b", "full", True], reports["1f1b", "full", False]
same_peaks = [r["peak_activation_bytes"] for r in late] == [r["peak_activation_bytes"] for r in on_time]
live = ", ".join(f"{a['peak_live_bytes'] - b['peak_live_bytes']:+,} B" for a, b in zip(late, on_time))
print(f"\nrecompute-early, memory: the same stored peak on every stage ({same_peaks}); live peak per stage {live}")

# %% [markdown]
# ## Where the time goes: bubbles, recompute-early, data-parallel overlap
#
# The timing run launches 2 ranks once for everything, repeated (a first round warms every path up and is
# not counted): the pipeline under `full` at each $M$ with and without recompute-early, and 2
# data-parallel replicas all-reducing their gradients after the backward, or per layer as soon as they
# are final. The two runs of a pair follow each other, and which goes first alternates from repeat to
# repeat, so a machine that slows down or speeds up within a repeat does not favour one of them. A rank's bubble is $1 - \text{computing} / \text{step}$; `in_flight_seconds` is how long some
# overlapped all-reduce was in flight before the rank's final wait.

# %%
def measure_time(shapes_, device, repeats):
    cfg, batch, seq, Ms = shapes_["timing"]
    params, input_ids, targets = batch_of(cfg, batch, seq, device)
    dp_cfg, dp_batch, dp_seq = shapes_["dp"]
    dp_params, dp_ids, dp_targets = batch_of(dp_cfg, dp_batch, dp_seq, device)
    state = rng(device)
    jobs, keys = [], []
    for repeat in range(repeats + 1):  # the first round warms up every path; it is not counted
        turn = (False, True) if repeat % 2 else (True, False)  # which of a pair runs first alternates, repeat by repeat
        for M in Ms:
            for early in turn:
                jobs.append(ParallelJob(params, cfg, input_ids, targets, "full",
                                        Layout(pp=2, microbatches=M, recompute_early=early), measure=False,
                                        rng_state=state))
                keys.append(("pipeline", M, early, repeat))
        for overlap in turn:
            jobs.append(ParallelJob(dp_params, dp_cfg, dp_ids, dp_targets, "full",
                                    Layout(dp=2, overlap=overlap, microbatches=2), measure=False, rng_state=state))
            keys.append(("dp", 2, overlap, repeat))
    with spawning_ranks():  # the ranks need picockpt, not this lesson's cells
        results = run_jobs(jobs, 2, device.type, start_method=START)
    runs = {}
    for key, (_, _, ranks) in zip(keys, results):
        if key[-1] > 0:
            runs.setdefault(key[:-1], []).append(sorted(ranks, key=lambda r: r["rank"]))
    return runs


def mean_bubble(ranks):
    return sum(r["bubble"] for r in ranks) / len(ranks)


def in_flight_seconds(report):
    """Seconds during which some overlapped all-reduce was in flight before the rank's final wait began (its
    "reduce" span): the union of the buckets' [launch, seen complete] intervals, cut at that wait."""
    waits = [start for kind, _, start, _ in report["timeline"] if kind == "reduce"]
    until = waits[0] if waits else report["timeline_seconds"]["total"]
    covered, reach = 0.0, float("-inf")
    for _, _, launched, done in sorted(report["dp_buckets"], key=lambda bucket: bucket[2]):
        start, end = max(launched, reach), min(done, until)
        covered += max(0.0, end - start)
        reach = max(reach, end)
    return covered


# %%
tcfg, tbatch, tseq, Ms = plans["timing"]
print(f"\ntimings, P=2, policy full, 1F1B: {shape_line(tcfg, tbatch, tseq, args.device)}")
runs = measure_time(plans, ranks_device(args.device, 2), plans["repeats"])
bubbles, paced = {}, {}
for M_ in Ms:
    for early in (False, True):
        bubbles[M_, early] = Spread(tuple(mean_bubble(ranks) for ranks in runs["pipeline", M_, early]))
    paced[M_] = Spread(tuple(float(np.mean(unequal_bubble([r["computing_seconds"] for r in ranks], M_)))
                             for ranks in runs["pipeline", M_, False]))
    print(f"  M={M_}: bubble {bubbles[M_, False].text('{:.0%}')}, with recompute-early "
          f"{bubbles[M_, True].text('{:.0%}')}; (P-1)/(M+P-1) = {bubble_fraction(2, M_):.0%}, "
          f"with the stages' measured times {paced[M_].text('{:.0%}')}")
falls = all(bubbles[a, False].high < bubbles[b, False].low for a, b in zip(Ms[1:], Ms))  # each M below the last
print(f"  the measured bubble falls with M beyond the spread of the repeats at every step of M: "
      f"{FAST_TIMING if args.mode == 'fast' else falls}")
held = Spread(tuple(a[0]["mean_activation_bytes"] / b[0]["mean_activation_bytes"]
                    for a, b in zip(runs["pipeline", Ms[-1], True], runs["pipeline", Ms[-1], False])))
print(f"  recompute-early holds the recomputed segment while it waits: stage 0's time-weighted mean stored bytes "
      f"at M={Ms[-1]} are {held.text('{:.2f}')}x those without it (the stored peak is the same)")

# %% [markdown]
# $(P - 1)/(M + P - 1)$ falls with $M$; a line above says whether the measured bubble falls with it
# beyond the spread of the repeats. That formula assumes equal stages, and the last one also
# runs the final norm, the head and the loss. Put the stages' own measured computing times into it
# (`unequal_bubble`: the slowest stage sets the pace, the step lasts about
# $\sum_s t_s + (M - 1)\max_s t_s$ for per-micro-batch stage times $t_s$) and what is left between it
# and the measurement is the sends and the schedule's own Python, which neither formula counts. That
# remainder is reported as it is, repeat by repeat (the measured bubble minus the paced formula of the
# same run, median [min..max]), without a pass mark: no tolerance was fixed before the runs. Sends and
# Python add idle time (a positive gap); a CPU shared with other work also slows single micro-batches
# unevenly, which moves the gap either way: read it with its spread.
#
# **Two conventions.** With $p$ stages, $m$ micro-batches and equal stage times $t$, a stage computes for
# $m t$ of a step that lasts $(m + p - 1) t$. Narayanan et al. (2021, sec. 2.2.1) and the Ultra-Scale
# Playbook divide the bubble time $(p - 1) t$ by the ideal time $m t$: $b = (p - 1)/m$. This lesson
# (`bubble_fraction`, and every measurement: $1 - \text{computing}/\text{step}$) divides it by the whole
# step: $(p - 1)/(m + p - 1) = b/(1 + b)$. At $p = 4$, $m = 8$: $b = 37.5\%$ of the ideal time, $27.3\%$
# of the step. The interleaved schedule (Narayanan et al., sec. 2.2.2) gives each stage $v$ model chunks
# and cuts $b$ to $(p - 1)/(v m)$, for $v$ times the point-to-point sends.
#
# **Recompute-early moves work; it removes none.** The top segment's recomputation that would follow a
# gradient's arrival is done while the stage waits for it. That shortens the step only where the wait
# is on the step's critical path. In 1F1B's steady state the two stages alternate one forward and one
# backward, and the step advances by the slower stage's forward + backward per micro-batch, with or
# without the move: the moved recomputation is still the same stage's work, done before the same
# backward. What the move can take off the step is the wait that nothing else fills: in the cool-down,
# the last micro-batch's top segment, when the next stage sets the pace. So the gain is at most one
# top-segment recompute of one micro-batch per step, whose size falls as $1/M$ (the batch is fixed,
# so a micro-batch shrinks as $M$ grows), and never more than all the recomputation it moved.
#
# What overlaps what matters too. On a GPU with NCCL, a transfer runs on its own engine while the kernels
# run, and the wait for a gradient includes the transfer: recomputing in it hides the communication. On
# gloo and a CPU there is no separate engine: gloo's threads copy the bytes on the same cores, and a
# micro-batch's gradient here, $b \cdot n \cdot h \cdot 4$ bytes (64 KiB at $M = 8$), crosses the loopback in
# microseconds. The wait is almost all the next stage's compute. Below, for each $M$, the lesson measures
# from the timelines how much recomputation the move put in front of stage 0's waits, the part of it a
# paced 1F1B can gain, how the step changed (repeat by repeat), and whether the next stage waited longer
# for its activations (the sends posted just before the moved recomputation). A step that changed by
# more than all the work moved is the machine's doing, not the schedule's: then the timing is
# inconclusive on this machine, whatever its sign.

# %%
def bubble_over_ideal(stages, microbatches, chunks=1):
    """Narayanan et al.'s convention: bubble time over ideal compute time, (p - 1) / (v·m) with v model chunks
    per stage (v = 1: plain 1F1B). share = b / (1 + b) is bubble_fraction's share of the step at v = 1."""
    return (stages - 1) / (chunks * microbatches)


for M_ in Ms:
    b = bubble_over_ideal(2, M_)
    print(f"  M={M_}: bubble over ideal time (P-1)/M = {b:.1%}; as a share of the step b/(1+b) = {b / (1 + b):.1%} "
          f"= (P-1)/(M+P-1) = {bubble_fraction(2, M_):.1%}; interleaved with v=2 chunks (P-1)/(vM) = "
          f"{bubble_over_ideal(2, M_, 2):.1%}")


# %%
def moved_seconds(report):
    """{micro-batch: seconds of its recomputation done before its wait for the gradient} on one rank: the work
    recompute-early put in front of the wait (without it, none: the loop recomputes after the wait)."""
    moved, backward, waited = {}, set(), set()
    for kind, m, start, end in report["timeline"]:  # leaf spans in time order
        if kind == "backward":
            backward.add(m)  # micro-batch m's backward has begun
        elif kind == "wait":
            waited.add(m)  # ... and its gradient was waited for
        elif kind == "recompute" and m in backward and m not in waited:
            moved[m] = moved.get(m, 0.0) + end - start  # recomputed inside its backward, before the wait
    return moved


def early_measure(runs, M):
    """Spreads over the repeats at M, each from one repeat's pair of runs (without, with recompute-early):
    ratio (step time with / without), change (seconds with - without), moved (stage 0's recomputation put before
    its waits), last (of it, the last micro-batch's: what a paced 1F1B can gain), step (seconds without it),
    paced_by_next (the next stage computed longer: it sets the pace), inputs_wait (the next stage's wait for
    its activations, with - without)."""
    pairs = list(zip(runs["pipeline", M, False], runs["pipeline", M, True]))
    moved = [moved_seconds(on[0]) for _, on in pairs]

    def spread(values):
        return Spread(tuple(values))
    return dict(ratio=spread(on[0]["step_seconds"] / off[0]["step_seconds"] for off, on in pairs),
                change=spread(on[0]["step_seconds"] - off[0]["step_seconds"] for off, on in pairs),
                moved=spread(sum(m.values()) for m in moved), last=spread(m.get(M - 1, 0.0) for m in moved),
                step=spread(off[0]["step_seconds"] for off, _ in pairs),
                paced_by_next=all(off[1]["computing_seconds"] > off[0]["computing_seconds"] for off, _ in pairs),
                inputs_wait=spread(on[1]["timeline_seconds"]["wait"] - off[1]["timeline_seconds"]["wait"]
                                   for off, on in pairs))


def early_verdict(mode, M, measured):
    """Print what recompute-early did at M (early_measure's Spreads) and return its Claim: conclusive only when
    the step was shorter in every repeat and by no more than the work moved, in every repeat."""
    claim = timed_claim(mode, measured["ratio"], f"M={M}: step time with recompute-early / without", "<1", 1.0)
    if mode == "fast":
        print(f"  {claim.text}")
        return claim
    change, moved, last, step = (measured[key] for key in ("change", "moved", "last", "step"))
    beyond = sum(abs(a) > b for a, b in zip(change.samples, moved.samples))  # changed by more than it moved
    share = Spread(tuple(a / b for a, b in zip(last.samples, step.samples)))  # of the step, repeat by repeat
    pace = ("the next stage computes longer in every repeat, so it sets the pace, and the most a steady 1F1B can "
            "gain is" if measured["paced_by_next"] else
            "stage 0 computes longer in some repeat (then a steady 1F1B gains nothing), and the most it can gain is")
    print(f"  M={M}: the move puts {moved.text('{:.1f}', 1e3)} ms of stage 0's recomputation in front of its waits; "
          f"{pace} the last micro-batch's {last.text('{:.1f}', 1e3)} ms of a {step.text('{:.0f}', 1e3)} ms step "
          f"({share.text('{:.1%}')}); the step changed by {change.text('{:+.1f}', 1e3)} ms; the next stage waited "
          f"{measured['inputs_wait'].text('{:+.1f}', 1e3)} ms longer for its activations")
    if beyond:
        claim = Claim(f"M={M}: recompute-early: inconclusive on this machine (step time with / without "
                      f"{measured['ratio'].text('{:.3f}')}; in {beyond} of {len(change.samples)} repeats the step changed "
                      f"by more than all the work the move shifts, which the schedule cannot do: that difference is "
                      f"the machine's); by work (exact) the ratio is 1.000",
                      False, f"inconclusive ({measured['ratio'].text('{:.3f}')}; by work 1.000)")
    print(f"  {claim.text}")
    if claim.conclusive:
        print(f"  M={M}: the moved recomputation hid in the wait: the step was shorter in every repeat, by no more "
              f"than the work moved")
    elif share.median < measured["ratio"].high - measured["ratio"].low:
        print(f"  M={M}: what a steady 1F1B can gain, {share.median:.1%} of the step, is less than the spread of the "
              f"repeats' ratios ({measured['ratio'].high - measured['ratio'].low:.1%} wide): this machine does not "
              f"resolve it, and the sign of the measured change is not recompute-early's")
    return claim


if args.mode != "fast":
    for M_ in Ms:
        gaps = Spread(tuple(float(np.mean([r["bubble"] for r in ranks]) -
                                  np.mean(unequal_bubble([r["computing_seconds"] for r in ranks], M_)))
                            for ranks in runs["pipeline", M_, False]))
        print(f"  M={M_}: measured bubble - paced formula, repeat by repeat {gaps.text('{:+.1%}')}")
print("\nrecompute-early, where the time goes (stage 0 of 2, full recomputation, repeat by repeat):")
early = {M_: early_verdict(args.mode, M_, early_measure(runs, M_)) for M_ in Ms}

# %%
exposed = {overlap: Spread(tuple(max(r["timeline_seconds"]["reduce"] for r in ranks)
                                 for ranks in runs["dp", 2, overlap])) for overlap in (False, True)}
launched_early = Spread(tuple(max(in_flight_seconds(r) for r in ranks) for ranks in runs["dp", 2, True]))
step = {overlap: Spread(tuple(ranks[0]["step_seconds"] for ranks in runs["dp", 2, overlap]))
        for overlap in (False, True)}
print(f"\ndata parallel dp=2, M=2, gradients of {runs['dp', 2, True][0][0]['dp_bytes'] / 2**20:.1f} MiB per rank: "
      f"all-reduced after the backward, {exposed[False].text('{:.1f}', 1e3)} ms, all exposed; per layer as soon as "
      f"final, {launched_early.text('{:.1f}', 1e3)} ms of them in flight during the backward and "
      f"{exposed[True].text('{:.1f}', 1e3)} ms exposed at the end; step {step[False].text('{:.0f}', 1e3)} | "
      f"{step[True].text('{:.0f}', 1e3)} ms")
pairs = list(zip(runs["dp", 2, False], runs["dp", 2, True]))  # the two runs of one repeat, side by side
exposed_ratio = Spread(tuple(max(r["timeline_seconds"]["reduce"] for r in on) /
                             max(max(r["timeline_seconds"]["reduce"] for r in off), 1e-9) for off, on in pairs))
step_ratio = Spread(tuple(on[0]["step_seconds"] / off[0]["step_seconds"] for off, on in pairs))
overlap_claims = {"exposed": timed_claim(args.mode, exposed_ratio, "overlapped / after, exposed all-reduce wait", "<1",
                                         1.0),  # the same bytes reduced either way
                  "step": timed_claim(args.mode, step_ratio, "overlapped / after, step time", "<1", 1.0)}
for claim in overlap_claims.values():
    print(f"  {claim.text}")
if overlap_claims["exposed"].conclusive:
    print("  the overlapped all-reduces hid part of their time in the backward: a shorter exposed wait in every repeat"
          + ("; and a shorter step" if overlap_claims["step"].conclusive else
             "; the step itself did not shorten in every repeat (the reductions took their cores from the backward)"))
elif args.mode != "fast":
    print("  overlap: the timing was inconclusive on this machine; by bytes the two move the same "
          f"{runs['dp', 2, True][0][0]['dp_bytes'] / 2**20:.1f} MiB per rank")

# %% [markdown]
# Overlap launches each bucket's all-reduce during the backward, so by the final wait most of them
# should be done: a ratio below 1 for the exposed wait, and a shorter step. On this 2-core CPU each
# rank's compute already takes a core, and gloo's threads copy and sum on the same cores: a bucket in
# flight only moves when the backward lets go of a core, so how much it hides depends on the moment,
# and the lines above say whether the repeats agreed. A GPU reduces with NCCL on its own stream while
# the kernels run; that is where the exposed wait and the step should fall by the in-flight
# milliseconds.
#
# ## The figures
#
# First, the stored peak of every stage under AFAB and 1F1B, each policy's points (measured) on its line
# (the closed form).

# %%
def plot_stage_memory(cfg, batch, seq, pp, M, reports):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    stages = np.arange(pp)
    for ax, schedule in zip(axes, ("afab", "1f1b")):
        for policy in POLICIES:
            ranks = reports[schedule, policy, False]
            color = policy_color(policy)
            ax.plot(stages, mib([r["predicted_activation_bytes"] for r in ranks]), "-", color=color, lw=1.2, alpha=0.8)
            ax.plot(stages, mib([r["peak_activation_bytes"] for r in ranks]), "o", color=color, label=policy)
        flight = [r["microbatches_in_flight"] for r in reports[schedule, "none", False]]
        ax.set_xticks(stages, [f"stage {s}\n{w} in flight" for s, w in zip(stages, flight)], fontsize=8)
        ax.set_title(f"{schedule.upper()}: stored peak per stage (points measured, lines closed form)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MiB")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"P={pp}, M={M}, L={cfg.layers}, h={cfg.hidden}, batch {batch} x {seq}, {cfg.dtype}: "
                 f"(in flight - 1) x E + one micro-batch's peak", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, "16_stage_memory")


paths = [plot_stage_memory(cfg, batch, seq, pp, M, reports)]
wrote(paths[-1])

# %% [markdown]
# The stage-aware budget against the best uniform policy that fits: the stored peak per stage (left)
# and the FLOPs each stage recomputes (right).

# %%
def plot_budget(pp, size, best_uniform, planned, uniform):
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    x = np.arange(pp)
    for ax, key, scale, unit in ((left, "peak_activation_bytes", 2**20, "MiB"),
                                 (right, "recompute", 1e9, "GFLOP recomputed")):
        get = (lambda r: r["flops"]["recompute"]) if key == "recompute" else (lambda r: r[key])
        ax.bar(x - 0.2, [get(r) / scale for r in planned], 0.4, color=policy_color("budget"),
               label=f"budget:{size} (stage-aware)")
        ax.bar(x + 0.2, [get(r) / scale for r in uniform], 0.4, color=policy_color(best_uniform),
               label=f"{best_uniform} (best uniform that fits)")
        ax.set_xticks(x, [f"stage {r['stage']}\n{r['microbatches_in_flight']} in flight" for r in planned], fontsize=8)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3, axis="y")
    left.axhline(size / 2**20, color="black", ls="--", lw=1, label="SIZE")
    left.set_ylim(0, size / 2**20 * 1.4)  # room for the legend above the bars
    left.set_title("stored peak per stage", fontsize=10)
    right.set_title(f"recomputation per stage: {sum(r['flops']['recompute'] for r in planned) / 1e9:.3f} against "
                    f"{sum(r['flops']['recompute'] for r in uniform) / 1e9:.3f} GFLOP in all", fontsize=10)
    left.legend(fontsize=8, loc="upper center", ncol=3)
    fig.suptitle("1F1B: each stage planned for its own micro-batches in flight, against one policy for every stage",
                 fontsize=10)
    fig.tight_layout()
    return save_figure(fig, "16_stage_aware_budget")


paths.append(plot_budget(pp, size, best_uniform, planned, uniform))
wrote(paths[-1])

# %% [markdown]
# The Gantt chart of one repeat at one $M$, without and with recompute-early (each bar a micro-batch's
# forward, recompute or backward, or a wait), and below it every measured bubble against
# $(P - 1)/(M + P - 1)$.

# %%
def draw_timeline(ax, ranks, labels=True):
    origin = min(r["timeline_start"] for r in ranks)
    for row, r in enumerate(ranks):
        shift = r["timeline_start"] - origin
        for kind, m, start, end in r["timeline"]:
            if kind == "send":  # sends are isend, non-blocking: the one span is the final wait for the last ones,
                # far shorter than a bar can show: a tick at its start, whatever its length
                ax.plot([start + shift] * 2, [row - 0.48, row + 0.48], color="black", lw=0.8)
                continue
            ax.barh(row, end - start, left=start + shift, color=KIND_COLORS[kind], edgecolor="white", lw=0.3)
            if labels and m is not None and kind in ("forward", "backward") and end - start > 0.02 * ax.get_xlim()[1]:
                ax.text(start + shift + (end - start) / 2, row, str(m), ha="center", va="center", fontsize=6)
        for bucket, _, launched, done in r.get("dp_buckets", ()):
            ax.plot([launched + shift, done + shift], [row + 0.42, row + 0.42], color=KIND_COLORS["reduce"], lw=2)
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']}" for r in ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")


def legend_kinds(ax, kinds):
    for kind in kinds:
        if kind == "send":
            ax.plot([], [], color="black", lw=0.8, label="send: the wait for the last non-blocking sends (tick)")
        else:
            ax.barh(0, 0, color=KIND_COLORS[kind], label=kind)
    ax.legend(fontsize=7, ncol=len(kinds), loc="lower right", bbox_to_anchor=(1.0, 1.06), frameon=False)


def plot_gantt(runs, Ms, bubbles, paced):
    M = Ms[-1] if len(Ms) < 3 else Ms[-2]
    fig, axes = plt.subplots(3, 1, figsize=(12, 7.5), gridspec_kw=dict(height_ratios=(1, 1, 1.3)))
    for ax, early in zip(axes[:2], (False, True)):
        ranks = runs["pipeline", M, early][len(runs["pipeline", M, early]) // 2]
        end = max(r["timeline_start"] + r["timeline_seconds"]["total"] for r in ranks) - min(
            r["timeline_start"] for r in ranks)
        ax.set_xlim(0, end * 1.01)
        draw_timeline(ax, ranks)
        ax.set_title(f"1F1B, P=2, M={M}, full recomputation{', recompute-early' if early else ''}: bubble "
                     f"{mean_bubble(ranks):.0%} (median over repeats {bubbles[M, early].median:.0%})", fontsize=9)
    legend_kinds(axes[0], ("forward", "recompute", "backward", "wait", "send"))
    ax = axes[2]
    grid = np.linspace(1, Ms[-1], 50)
    ax.plot(grid, [bubble_fraction(2, m) for m in grid], "-", color="black", lw=1,
            label="(P-1)/(M+P-1): the idle share of the step")
    for early, color in ((False, PHASE_COLORS["backward"]), (True, PHASE_COLORS["recompute"])):
        med = [bubbles[m, early].median for m in Ms]
        err = [[bubbles[m, early].median - bubbles[m, early].low for m in Ms],
               [bubbles[m, early].high - bubbles[m, early].median for m in Ms]]
        ax.errorbar(np.array(Ms) + (0.08 if early else -0.08), med, yerr=err, fmt="o", color=color, capsize=3,
                    label="measured" + (", recompute-early" if early else ""))
    ax.plot(Ms, [paced[m].median for m in Ms], "x", color="black", ms=8,
            label="paced by the stages' measured times (unequal_bubble)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(Ms, [str(m) for m in Ms])
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("bubble: 1 - computing / step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, "16_pipeline_gantt")


paths.append(plot_gantt(runs, Ms, bubbles, paced))
wrote(paths[-1])

# %% [markdown]
# The two data-parallel replicas, all-reducing after the backward (top) and per layer as soon as each
# gradient is final (bottom; the purple lines are the buckets in flight).

# %%
def plot_dp(runs, exposed):
    fig, axes = plt.subplots(2, 1, figsize=(12, 4.8), sharex=True)
    for ax, overlap in zip(axes, (False, True)):
        ranks = runs["dp", 2, overlap][len(runs["dp", 2, overlap]) // 2]
        draw_timeline(ax, ranks, labels=False)
        how = "per layer as soon as final (overlapped)" if overlap else "after the backward"
        ax.set_title(f"data parallel dp=2, M=2: all-reduce {how}: exposed {exposed[overlap].text('{:.1f}', 1e3)} ms "
                     f"(purple line: each bucket from launch to seen complete)", fontsize=9)
    legend_kinds(axes[0], ("forward", "recompute", "backward", "reduce"))
    fig.tight_layout()
    return save_figure(fig, "16_dp_overlap")


paths.append(plot_dp(runs, exposed))
wrote(paths[-1])

# %% [markdown]
# Llama 3 70B ($L = 80$, bf16, $s = 8192$, $b = 1$) on $p = 8$ stages of 1F1B, with $t = 8$ tensor
# parallelism, sequence parallelism and selective recomputation: what each stage stores, predicted, by
# Korthikanti et al.'s $34\,sbh/t$ per layer and by picockpt's own layer (GQA 64/8, SwiGLU). Stage 0
# holds $p$ micro-batches of $L/p$ layers: $L$ layers' worth.

# %%
def plot_llama(p=8, seq=8192, batch=1, t=8):
    """Llama 3 70B, bf16, s=8192, b=1, t=8 with sequence parallelism and selective recomputation (predicted)."""
    cfg = Config.from_preset("llama3-70b", dtype="bf16")
    L, h = cfg.layers, cfg.hidden
    published = seq * batch * h * 34 / t  # Korthikanti: 34sbh/t per layer with sp + selective
    own = sum(v[2] for v in rank_layer_inventory(cfg, batch, seq, t, True, SELECTIVE).values())
    stages = np.arange(p)
    fig, ax = plt.subplots(figsize=(10, 4.4))
    for offset, per_layer, label, color in ((-0.2, published, "34sbh/t per layer (Korthikanti)", "#999999"),
                                            (0.2, own, "picockpt's layer, bf16, GQA 64/8", policy_color("selective"))):
        ax.bar(stages + offset, [(p - s) * (L // p) * per_layer / GIB for s in stages], 0.4, color=color,
               label=label)
    for v, style in ((2, "--"), (4, ":")):
        ax.axhline(L * (1 + (p - 1) / (p * v)) * published / GIB, color="black", ls=style, lw=1,
                   label=f"stage 0 interleaved, v={v} chunks: L(1 + (p-1)/(pv)) layers")
    ax.axhline(L * published / GIB, color="black", lw=0.8, alpha=0.5,
               label="L layers' worth (L x 34sbh/t): stage 0 without interleaving")
    ax.set_xticks(stages, [f"stage {s}\n{p - s} in flight" for s in stages], fontsize=8)
    ax.set_ylabel("activations stored (GiB)")
    ax.set_title(f"Llama 3 70B (L={L}), p={p} 1F1B, t={t} with sp, selective, s={seq}, b={batch}: stage 0 holds "
                 f"{p} x {L // p} = {L} layers' worth (predicted)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return save_figure(fig, "16_llama3_70b_stages")


paths.append(plot_llama())
wrote(paths[-1])

# %% [markdown]
# ## Beyond 1F1B, modelled: interleaving and zero-bubble on one clock
#
# Two schedules go further; here `pipeline_parallel/pp_orders.py`'s clock runs their orders beside 1F1B's (no
# ranks: each action takes its modelled time, and waits for the message it needs). Lesson 30 runs both on ranks
# and measures what they store:
#
# - **interleaved 1F1B** (Narayanan et al. 2021; Megatron-LM's order): each rank holds $V$ chunks of layers, so
#   a forward is $1/V$ as long and the fill and drain shrink: idle $(p-1)/(Vm+p-1)$, for stage 0 holding
#   $1 + (p-1)/(pV)$ times 1F1B's micro-batches;
# - **ZB-H1** (Qi et al. 2023): each backward split into B, the input's gradient that the previous stage waits
#   for, and W, the weights' gradients that nobody waits for. Stage $s$ lets $s$ of its W's wait until the end,
#   where 1F1B would idle. Its bubble *time* is a third of 1F1B's: $(p-1)(T_F+T_B-T_W)$ against
#   $(p-1)(T_F+T_B+T_W)$ (Qi et al. 2023, $T_B$ the input-gradient pass alone), that is $(p-1)$ against
#   $3(p-1)$ with equal F, B, W times. Its idle *share* of the step is not a third: the
#   step shrinks with the bubble, and the share is $(p-1)/(3m+p-1)$ against $(p-1)/(m+p-1)$, at $p = 4$,
#   $m = 8$ 0.111 against 0.273, 0.41 of it (the lines below print both). picockpt's backward already
#   computes B and W as separate lines (`linear_backward`'s input and weight gradients).
#
# What a waiting W costs is memory: from its B to its W, a layer holds what W reads, each linear's input and
# the gradient of its output (`w_pending_bytes`). Recomputation does not shrink it: under `full` the layer is
# recomputed before its B, and W reads those same recomputed inputs, so they stay until W runs.

# %%
from picockpt.parallel.pipeline_parallel.pp_orders import one_f_one_b_orders, run_orders, w_pending_bytes
from picockpt.parallel.pipeline_parallel.pp_schedules import interleaved_actions, zb_h1_actions
from picockpt.planning.layer_forms import layer_inventory, total

P_, M_ = 4, 8
clock = {"1F1B": run_orders(one_f_one_b_orders(P_, M_), P_, times={"F": 1, "B": 2}),
         "interleaved V=2": run_orders([interleaved_actions(P_, M_, 2, s) for s in range(P_)], P_, 2,
                                       times={"F": 0.5, "B": 1.0}),
         "ZB-H1": run_orders([zb_h1_actions(P_, M_, s) for s in range(P_)], P_)}
formula = {"1F1B": (P_ - 1) / (M_ + P_ - 1), "interleaved V=2": (P_ - 1) / (2 * M_ + P_ - 1),
           "ZB-H1": (P_ - 1) / (3 * M_ + P_ - 1)}
print(f"P = {P_}, M = {M_}, equal stage times (modelled): idle share of the step on the clock, and by formula")
for name, result in clock.items():
    print(f"  {name:<16} clock {result['idle'][0]:.3f}   formula {formula[name]:.3f}")
assert all(abs(clock[n]["idle"][0] - formula[n]) < 1e-12 for n in clock)
llama = Config.from_preset("llama3-8b", dtype="bf16", attention="fused")
pending, stored = w_pending_bytes(llama, 1, 4096), total(layer_inventory(llama, 1, 4096))
checkpoint = layer_inventory(llama, 1, 4096)["input"][2]
print(f"Llama 3 8B, one layer, 1 x 4096 tokens, bf16: a waiting W holds {pending / 2**20:.0f} MiB; the layer stores "
      f"{stored / 2**20:.0f} MiB under none and {checkpoint / 2**20:.0f} MiB (its input) under full, so under full a "
      f"waiting W holds {pending / checkpoint:.1f} times what the layer's checkpoint does (predicted)")
held_zb = clock["ZB-H1"]["held"]  # micro-batches from F to W: a waiting W counted whole, an upper bound here
print(f"a waiting W holds {pending / stored:.0%} of what the layer stores under none: ZB-H1's stage s holds about "
      f"s more micro-batches' worth than 1F1B ({held_zb} against {clock['1F1B']['held']} from F to W); under none "
      f"stage 0's peak stays 1F1B's, under full not even there: each B leaves its W's bytes until the W (lesson 30)")

# %% [markdown]
# ## Exercises
#
# **1.** A 1F1B pipeline of $P = 8$ stages runs $M = 16$ micro-batches. How many micro-batches does
# stage 2 (the third) hold in flight at most?

# %%
answer = 6  # micro-batches

# %%
order = actions("1f1b", 8, 16, 2)
warmup = next(n for n, action in enumerate(order) if action.kind == "B")
check("micro-batches in flight on stage 2 of 1F1B, P = 8, M = 16", answer, in_flight("1f1b", 8, 16, 2), rel=0,
      why=f"min(P - s, M) = min(8 - 2, 16): the stage runs {warmup} forwards before its first backward "
          f"(P - s - 1 warm-up ones, then the one just forwarded), then one forward, one backward; AFAB would "
          f"hold all {in_flight('afab', 8, 16, 2)}")

# %% [markdown]
# **2.** With equal stage times, $P = 4$ stages and $M = 8$ micro-batches: what share of the whole step
# does a stage spend idle (this lesson's convention, what it measures)? Narayanan et al. (2021, sec. 2.2.1)
# state the bubble as bubble time over ideal compute time, $(P - 1)/M$: convert it.

# %%
answer = 0.273  # share of the step

# %%
least_M = next(m for m in range(1, 1000) if bubble_fraction(4, m) <= 0.1)
b = bubble_over_ideal(4, 8)
check("bubble as a share of the step, P = 4, M = 8", answer, bubble_fraction(4, 8),
      why=f"(P - 1)/(M + P - 1) = 3/11: each stage idles P - 1 slots of the M + P - 1 of each kind; in Narayanan et "
          f"al.'s convention b = (P - 1)/M = {b:.3f} of the ideal time, and b/(1 + b) = {b / (1 + b):.3f} of the step; "
          f"interleaving v = 2 chunks per stage halves b to {bubble_over_ideal(4, 8, 2):.4f}. Below 10% of the step "
          f"takes M >= {least_M}, whose activations AFAB holds all at once, 1F1B only P = 4 of them on stage 0")

# %% [markdown]
# **3.** This lesson's CPU memory run under `full` and 1F1B: $P = 4$ stages of 2 layers, $M = 8$
# micro-batches of one sequence of 64 tokens, $h = 128$, fp32. By how many bytes does stage 0's stored
# peak exceed one micro-batch's own peak? (What does a micro-batch's forward leave stored under `full`
# on a stage of 2 layers, and how many others are in flight during a backward?)

# %%
answer = 196_608  # bytes

# %%
memory_cfg, memory_batch, memory_seq, memory_P, memory_M = shapes("cpu")["memory"]
stage0 = ChunkForms(memory_cfg, memory_batch, memory_seq, "full", Layout(pp=memory_P, microbatches=memory_M), 0)
check("bytes stage 0 stores beyond one micro-batch's peak (full, 1F1B, P = 4, M = 8)", answer,
      stage0.peak_bytes - stage0.microbatch_peak_bytes, rel=0,
      why=f"(w - 1)·E with w = {stage0.in_flight} in flight and E = its {len(stage0.layers)} layer inputs, "
          f"{len(stage0.layers)}·{stage0.b}·{memory_seq}·{memory_cfg.hidden}·4 = {stage0.microbatch_stored_bytes:,} "
          f"bytes; the stage peak is that plus one micro-batch's own peak (while it recomputes a layer), "
          f"{stage0.microbatch_peak_bytes:,}: {stage0.peak_bytes:,} bytes")

# %%
def timed(spread, spec, scale=1.0):
    """A timing for the summary: median [min..max], or no number at all from a --fast run."""
    return FAST_TIMING if args.mode == "fast" else spread.text(spec, scale)


RESULT = {"figures": [str(p) for p in paths],
          "summary": {"stage peak = closed form (every policy, both schedules)": bool(exact),
                      "stage-aware budget peak <= SIZE on every stage": bool(fits),
                      "stage-aware recompute / best uniform": round(planned_recompute / uniform_recompute, 3)
                      if uniform_recompute else 0.0,
                      f"bubble at M={Ms[-1]} (formula {bubble_fraction(2, Ms[-1]):.2f})":
                          timed(bubbles[Ms[-1], False], "{:.3f}"),
                      f"bubble at M={Ms[-1]}, paced by the stages' measured times": timed(paced[Ms[-1]], "{:.3f}"),
                      "recompute-early: stage 0 mean stored bytes ratio": timed(held, "{:.3f}"),
                      f"recompute-early: step time / without, M={Ms[-1]}": early[Ms[-1]].short,
                      "dp overlapped / after, exposed wait": overlap_claims["exposed"].short,
                      "dp exposed all-reduce ms, after": timed(exposed[False], "{:.1f}", 1e3),
                      "dp exposed all-reduce ms, overlapped": timed(exposed[True], "{:.1f}", 1e3)}}

# %% [markdown]
# # Lesson 08: the price of recomputation, in FLOPs and in time
#
# Two ways to count the work of a step (Korthikanti et al. 2022):
#
# | count | what it is |
# |---|---|
# | **model FLOPs** | what the step needs without any recomputation: forward $F$ + backward $2F$ (each matmul $y = a b$ needs $da = dy\, b^\top$ and $db = a^\top dy$ in the backward) |
# | **hardware FLOPs** | what was actually executed: forward + recompute + backward |
#
# Full recomputation runs every layer's forward once more, so hardware/model $= 1 + F_\text{layers}/(3F)$, a
# little under 4/3 (the head, final norm + logits, is not recomputed). `every:C` costs the same (each layer
# is still recomputed exactly once, whatever $C$); `selective` only rebuilds $q k^\top$. The lesson counts
# FLOPs by `FlopCounterMode`'s formulas (the tracker applies them to every op) on one step of each policy
# (checked against `inventory.step_flops`), and times forward + backward of every policy in one run,
# interleaved.
#
# Published numbers: one extra forward is +33% of the model FLOPs when the backward costs two forwards;
# Korthikanti et al. (2022) measured +36-39% time for full recomputation of their GPT models against 2-7%
# for selective; Chen et al. (2016) report about +30% for their sublinear plan.
#
# **Run it** as a script, `python lessons/08_the_price.py` (the CPU run, well under a minute; `--fast` for
# seconds, `--large --device cuda` for a bigger shape on a GPU), or step through this notebook, where the
# same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset: the CPU run).

# %%
import statistics
import time

import matplotlib.pyplot as plt
import torch

from _check import check
from _lesson import (FAST_TIMING, Spread, choose, device_name, interleaved_seconds, large, lesson_args,
                     paired_ratios, shape_line, small, timed_claim, wrote)
from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import layer_flops, step_flops
from picockpt.measurement.measure import make_batch
from picockpt.teaching.plotting import PHASE_COLORS, mib, policy_color, save_figure
from picockpt.measurement.tracker import Tracker

POLICIES = ("none", "selective", "cheap", "every:4", "every:2", "full", "full+selective")
PHASES = ("forward", "backward", "recompute")

# %% [markdown]
# ## Counting and timing
#
# `measure` does three things per policy: one step under a tracker that counts FLOPs by phase; the
# interleaved timing of all policies; and as many traced steps again, whose trace lines are timestamped
# as they arrive, to split each step's time into forward, recompute and backward (`phase_seconds`). On a
# CPU it also counts the minor page faults of each step (fresh pages the OS maps and zeroes).

# %%
def shape(mode):
    """(Config, batch, seq, timed repeats) of each run mode."""
    return choose(mode, fast=(small(layers=4), 2, 32, 1), cpu=(small(), 4, 128, 9), large=(large(), 4, 1024, 5))


def measure(cfg, batch, seq, policies, device="cpu", seed=0, repeats=5):
    """policy -> {flops by phase, stored bytes, timing (a Spread of seconds) and its median seconds,
    phase_seconds (median per phase) and phase_samples (one {phase: seconds} per traced repeat)}."""
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)
    rows = {}
    for policy in policies:
        with Tracker(device, physical=False) as tracker:  # FLOPs and store bytes; no tensor watching
            loss_and_grads(params, cfg, input_ids, targets, policy, tracker=tracker)
        rows[policy] = {phase: tracker.flops[phase] for phase in PHASES}
        rows[policy]["stored"] = tracker.peak_logical
    steps = {p: (lambda p=p: loss_and_grads(params, cfg, input_ids, targets, p)) for p in policies}
    for policy, timing in interleaved_seconds(steps, device, repeats).items():
        rows[policy]["timing"], rows[policy]["seconds"] = timing, timing.median
    split, faults = {p: [] for p in policies}, {p: [] for p in policies}
    for _ in range(repeats):  # the same steps again, traced, to split their time by phase
        for p in policies:
            before = minor_page_faults()
            split[p].append(phase_seconds(lambda trace, p=p: loss_and_grads(params, cfg, input_ids, targets, p,
                                                                              trace=trace), device))
            if before is not None:
                faults[p].append(minor_page_faults() - before)
    for p in policies:
        rows[p]["phase_seconds"] = {phase: statistics.median(s[phase] for s in split[p]) for phase in PHASES}
        rows[p]["phase_samples"] = split[p]
        rows[p]["page_faults"] = statistics.median(faults[p]) if faults[p] else None
    return rows


def minor_page_faults():
    """Minor page faults of this process so far: each is a fresh 4 KiB page the OS maps and zeroes
    the first time a new allocation touches it. None where the OS does not say (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def phase_seconds(step, device):
    """Wall seconds of forward / recompute / backward in one step, from the engine's own trace:
    step(trace) runs loss_and_grads(..., trace=trace), and each trace line is timestamped as it
    arrives. The time up to a line belongs to what that line reports: "forward layer k" lines
    before the loss are forward, after it recompute; the loss line closes the forward (head
    included); everything else (head backward, "backward layer i", embedding) is backward."""
    marks = []

    def trace(line):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)  # kernels run ahead of Python: wait, then stamp
        marks.append((time.perf_counter(), line))

    start = time.perf_counter()
    step(trace)
    trace("end")
    seconds, before, after_loss = dict.fromkeys(PHASES, 0.0), start, False
    for stamp, line in marks:
        if line.startswith("loss"):
            phase, after_loss = "forward", True
        elif line.startswith("forward layer"):
            phase = "recompute" if after_loss else "forward"
        else:
            phase = "backward"
        seconds[phase] += stamp - before
        before = stamp
    return seconds


def per_repeat(rows, policy, value):
    """Spread of value(policy's traced split, none's traced split), one per interleaved repeat."""
    return Spread(tuple(value(mine, plain) for mine, plain in zip(rows[policy]["phase_samples"],
                                                                  rows["none"]["phase_samples"])))

# %%
args = lesson_args()
cfg, batch, seq, repeats = shape(args.mode)
L, fast = cfg.layers, args.mode == "fast"
print(f"lesson 08, the price: {shape_line(cfg, batch, seq, args.device)}")
rows = measure(cfg, batch, seq, POLICIES, args.device, args.seed, repeats)
ideal = step_flops(cfg, batch, seq, "none")
model_flops = ideal["forward"] + ideal["backward"]
for row in rows.values():
    row["hardware"] = sum(row[phase] for phase in PHASES)
formula_ok = all(rows[p]["hardware"] == sum(step_flops(cfg, batch, seq, p).values()) for p in POLICIES)
ratio = {p: paired_ratios(rows[p]["timing"], rows["none"]["timing"]) for p in POLICIES}  # time / none's
full_expected = 1 + (ideal["forward"] - 2 * batch * seq * cfg.hidden * cfg.vocab) / model_flops

print(f"\nmodel FLOPs of one step (forward + backward, no recomputation): {model_flops / 1e9:.3f} GFLOP")
print(f"{'policy':<16}{'stored MiB':>11}{'hardware GFLOP':>16}{'/ model':>9}{'ms':>26}{'time / none':>22}"
      f"{'hardware GFLOP/s':>18}")
for p, row in rows.items():
    print(f"{p:<16}{mib(row['stored']):>11.2f}{row['hardware'] / 1e9:>16.3f}{row['hardware'] / model_flops:>9.3f}"
          f"{row['timing'].text('{:.1f}', scale=1e3):>26}{ratio[p].text('{:.3f}'):>22}"
          f"{row['hardware'] / row['seconds'] / 1e9:>18.2f}")
print(f"(FLOPs by FlopCounterMode's formulas, {'equal to' if formula_ok else 'DIFFERENT FROM'} inventory.step_flops; "
      f"times: median [min..max] of {repeats} interleaved forward + backward steps, time / none taken within "
      f"each repeat)")

# %% [markdown]
# The FLOP columns are exact (and equal `step_flops`); the time columns are measurements on this
# machine, each with its spread. On a CPU, time follows FLOPs only roughly: elementwise ops and Python
# overhead are not FLOPs, and on a shared machine one sample can be off by tens of percent, so no
# conclusion is drawn from a single one (and none at all from `--fast`, whose steps take milliseconds).
#
# Before any sentence below concludes from a time, the lesson checks what must hold: every policy
# here runs at least the FLOPs of `none` and a little more, so its time over none's, taken within each
# repeat, must be above 1 in every repeat (`timed_claim`). When it is not (the repeats straddle 1, or
# more work came out faster), the timing was inconclusive on this machine: the lesson says so and
# gives the FLOP ratio instead.
#
# ## Where the time goes
#
# The engine's trace splits each step by phase: "forward layer k" lines before the loss are forward,
# after it recompute; everything else is backward.

# %%
print(f"\ntime by phase (ms, median [min..max] of {repeats} traced steps; the trace's timestamps split the step):")
print(f"{'policy':<16}" + "".join(f"{phase:>24}" for phase in PHASES))
for p, row in rows.items():
    print(f"{p:<16}" + "".join(f"{Spread(tuple(s[phase] for s in row['phase_samples'])).text('{:.1f}', 1e3):>24}"
                               for phase in PHASES))

# %% [markdown]
# ## What the times may say
#
# `time_claims` checks each policy's time ratio against its FLOP ratio's side of 1; `explain` prints
# the sentences that conclude from a time only where that check holds, and the FLOP figure where it
# does not.

# %%
def time_claims(mode, ratio, rows, model_flops):
    """policy -> Claim: its step time over none's must lie above 1 in every repeat, as its FLOPs do."""
    return {p: timed_claim(mode, ratio[p], f"{p} / none, step time", ">1", rows[p]["hardware"] / model_flops)
            for p in ratio if p != "none"}


def explain(mode, claims, ratio, rest, faults, flops_over_model):
    """Print every claim, then what the timings show, each conclusion only where its claim holds.
    ratio: {policy: Spread of its time over none's}; rest: Spread of full's own forward + backward over
    none's (traced, repeat by repeat); faults: (full's, none's) minor page faults per step, or None;
    flops_over_model: {policy: hardware / model FLOPs}."""
    print("the check before any conclusion: more work is never faster (time / none within each repeat):")
    for claim in claims.values():
        print(f"  {claim.text}")
    for policy in ("full", "selective"):
        extra = f"{flops_over_model[policy] - 1:+.1%}"
        if claims[policy].conclusive:
            print(f"{policy}: measured here it costs {ratio[policy].median - 1:+.1%} of none's time (median), "
                  f"for {extra} FLOPs")
        elif mode != "fast":
            print(f"{policy}: the timing was inconclusive on this machine; by FLOPs it costs {extra}")
    own = timed_claim(mode, rest, "full's own forward + backward / none's, time", "<1", 1.0)  # the same FLOPs
    print(own.text)
    if own.conclusive and faults is not None:
        fewer = faults[0] < faults[1]
        print(f"  full's own forward and backward are faster in every repeat for the same FLOPs; minor page faults per "
              f"step (each a fresh 4 KiB page the OS maps and zeroes; a GPU's caching allocator hides them): full "
              f"{faults[0]:,.0f}, none {faults[1]:,.0f}"
              + (": full keeps fewer bytes live and touches less fresh memory, one measured part of it; a smaller "
                 "working set in the CPU's caches is the likely rest (not pinned down here)" if fewer else
                 ": not fewer, so not that; a smaller working set in the CPU's caches is the likely cause (not "
                 "pinned down here)"))


# %%
full = rows["full"]
claims = time_claims(args.mode, ratio, rows, model_flops)
print(f"\nfull recomputation: +{full['hardware'] / model_flops - 1:.1%} FLOPs "
      f"(1 + F_layers/3F = {full_expected:.4f}: one extra forward of the {L} layers, not of the head).")
print(f"selective: +{rows['selective']['hardware'] / model_flops - 1:.1%} FLOPs.")
extra_forward = per_repeat(rows, "full", lambda mine, plain: mine["recompute"] / sum(plain.values()))
rest = per_repeat(rows, "full", lambda mine, plain: (mine["forward"] + mine["backward"])
                  / (plain["forward"] + plain["backward"]))
backward_over_forward = per_repeat(rows, "none", lambda mine, plain: mine["backward"] / mine["forward"])
if fast:
    print(f"where the time goes: {FAST_TIMING}")
else:
    print(f"where the time goes: the recompute phase costs {extra_forward.text('{:.1%}')} of none's step; "
          f"full's own forward and backward take {rest.text('{:+.1%}', shift=-1)} against none's; none's backward "
          f"takes {backward_over_forward.text('{:.2f}')}x its forward's time (2x in FLOPs).")
faults = ((full["page_faults"], rows["none"]["page_faults"])
          if args.device.type == "cpu" and full["page_faults"] is not None else None)
explain(args.mode, claims, ratio, rest, faults, {p: rows[p]["hardware"] / model_flops for p in claims})
print(f"Published: Korthikanti et al. measured +36-39% time for full and 2-7% for selective; Chen et al. about "
      f"+30%. One extra forward is +{full['hardware'] / model_flops - 1:.1%} of the FLOPs here (+33% for a model "
      f"without a head); a time overhead measured on one machine is a property of that machine and its "
      f"kernels, not a constant of recomputation.")

# %% [markdown]
# ## The figure
#
# Left, what the price buys: each policy's stored bytes against its time relative to `none` (bars: the
# spread of the repeats). Right, pairs of bars per policy: FLOPs (hatched, counted) and time (solid,
# measured), both split by phase and both relative to `none`; the dotted line is 4/3, one extra forward,
# and the shaded bands Korthikanti et al.'s measured overheads.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [1, 1.5]})
for p in POLICIES:  # what the price buys: bytes against time, with the spread of the repeats
    x, y = mib(rows[p]["stored"]), ratio[p].median
    left.errorbar(x, y, yerr=[[y - ratio[p].low], [ratio[p].high - y]], fmt="o", color=policy_color(p), ms=8,
                  capsize=3)
    left.annotate(f" {p}", (x, y), fontsize=8, va="center", xytext=(6, 0), textcoords="offset points")
left.axhline(1, color="0.6", lw=0.8)
left.margins(x=0.15)  # room for the names right of the points
left.set_xlabel("peak stored activations (MiB)")
left.set_ylabel(f"time / time of none (median, bars: min..max of {repeats})")
left.set_title("what the price buys: memory against time")
left.grid(alpha=0.3)

xs, width = range(len(POLICIES)), 0.4
flop_bottom, time_bottom = [0.0] * len(POLICIES), [0.0] * len(POLICIES)
for phase in PHASES:  # pairs of bars: FLOPs (light, left) and time (solid, right), both split by phase
    flops = [rows[p][phase] / model_flops for p in POLICIES]
    share = [ratio[p].median * rows[p]["phase_seconds"][phase] / sum(rows[p]["phase_seconds"].values())
             for p in POLICIES]  # the measured time ratio, split in the proportions the trace saw
    right.bar([x - width / 2 for x in xs], flops, width, bottom=flop_bottom, color=PHASE_COLORS[phase],
              alpha=0.35, hatch="//", edgecolor="white")
    right.bar([x + width / 2 for x in xs], share, width, bottom=time_bottom, color=PHASE_COLORS[phase],
              label=phase)
    flop_bottom = [b + v for b, v in zip(flop_bottom, flops)]
    time_bottom = [b + v for b, v in zip(time_bottom, share)]
medians = [ratio[p].median for p in POLICIES]  # = the top of each time bar
right.errorbar([x + width / 2 for x in xs], medians, fmt="none", ecolor="black", capsize=3, lw=0.8,
               yerr=[[ratio[p].median - ratio[p].low for p in POLICIES],
                     [ratio[p].high - ratio[p].median for p in POLICIES]])
for x, p in zip(xs, POLICIES):
    right.annotate(f"{flop_bottom[x]:.2f}", (x - width / 2, flop_bottom[x]), ha="center", va="bottom", fontsize=7)
    right.annotate(f"{ratio[p].median:.2f}", (x + width / 2, ratio[p].high), ha="center", va="bottom", fontsize=8,
                   weight="bold", xytext=(0, 2), textcoords="offset points")
right.axhline(4 / 3, color="k", ls=":", lw=1, label="4/3: one extra forward")
right.axhspan(1.36, 1.39, color="#C44E52", alpha=0.25, label="Korthikanti, full: +36-39%")
right.axhspan(1.02, 1.07, color="#4C72B0", alpha=0.25, label="Korthikanti, selective: +2-7%")
right.set_ylim(0, max(1.75, max(flop_bottom + [ratio[p].high for p in POLICIES]) * 1.3))
right.set_xticks(list(xs), POLICIES, rotation=20)
right.set_ylabel("ratio to policy none")
right.set_title("each pair: FLOPs (hatched, counted) | time (solid, measured: median, bar min..max)")
right.legend(fontsize=7, loc="upper left", ncol=3)
unsure = [p for p, claim in claims.items() if not claim.conclusive]  # time not above none's in every repeat
fig.suptitle(f"The price of recomputation: L={L}, h={cfg.hidden}, batch {batch} x {seq}, {cfg.dtype}, "
             f"on {device_name(args.device)}" + (f" ({FAST_TIMING})" if fast else "" if not unsure else
                                                 f"\ntiming inconclusive on this machine for {', '.join(unsure)} "
                                                 f"(not above none's in every repeat): read their hatched FLOP bars"))
fig.tight_layout()
path = save_figure(fig, "08_the_price")
wrote(path)

# %% [markdown]
# ## Exercises
#
# **1.** Full recomputation for Llama 3 8B at one sequence of $s = 4096$ tokens: hardware FLOPs over
# model FLOPs, $1 + F_\text{layers}/(3F)$. The LM head ($2 s h V$ FLOPs, with $V = 128256$) is in $F$ but
# not in $F_\text{layers}$, so the answer is below 4/3. (`step_flops(cfg, 1, 4096, "full")` gives every
# phase.)

# %%
answer = 1.313

# %%
llama8 = Config.from_preset("llama3-8b", dtype="bf16")
price = step_flops(llama8, 1, 4096, "full")
model = price["forward"] + price["backward"]
check("hardware / model FLOPs of full recomputation, Llama 3 8B at s = 4096", answer,
      (model + price["recompute"]) / model, rel=0.001,
      why=f"forward {price['forward'] / 1e12:.2f} TFLOP of which the head 2·s·h·V = "
          f"{2 * 4096 * llama8.hidden * llama8.vocab / 1e12:.2f}; recompute {price['recompute'] / 1e12:.2f} "
          f"(the layers once more) over model {model / 1e12:.2f}")

# %% [markdown]
# **2.** `every:4` on the `small` model at batch 4 × 128: how many GFLOP does its recompute phase cost?
# One layer's forward is its projections ($q, k, v, o$), its MLP (three $h \times f$ matmuls) and the two
# $T \times T$ products of attention, at 2 FLOPs per multiply-add.

# %%
answer = 2.080  # GFLOP

# %%
exercise = small()
parts = layer_flops(exercise, 4, 128)
check("the recompute GFLOP of every:4 (small, 4 x 128)", answer,
      step_flops(exercise, 4, 128, "every:4")["recompute"] / 1e9, rel=0.001,
      why=f"every layer is recomputed once whatever C is: L = {exercise.layers} layers of "
          f"{sum(parts.values()) / 1e9:.4f} GFLOP ({', '.join(f'{k} {v / 1e6:.1f}' for k, v in parts.items())} "
          f"MFLOP)")

# %%
def timed(spread):  # a share of time for the results table
    return FAST_TIMING if fast else spread.text("{:.3f}")


RESULT = {"figures": [str(path)],
          "summary": {"full FLOPs / model": round(full["hardware"] / model_flops, 4),
                      "full time / none": claims["full"].short,
                      "selective time / none": claims["selective"].short,
                      "recompute phase / none's step": timed(extra_forward),
                      "FLOPs = formula": formula_ok}}

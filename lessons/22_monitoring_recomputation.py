# %% [markdown]
# # Lesson 22: monitoring recomputation in a training run
#
# A run prints a line per step; this lesson reads those lines as curves and asks the question a
# practitioner asks when a step is slower than expected: is the machine slower, or is the step doing
# more work? Three numbers answer it, each printed by `python -m picockpt train` (`picockpt/measurement/train.py`):
#
# | number | what it is |
# |---|---|
# | **MFU** | model FLOPs per second over the device's peak; model FLOPs are the step's without any recomputation (policy `none`: forward + backward) |
# | **HFU** | hardware FLOPs per second over the same peak; hardware FLOPs are what ran, recomputation included |
# | **recompute share** | of the step's FLOPs (the closed form `inventory.step_flops`, matmuls as `FlopCounterMode` counts them) and of its time (the tracker's recompute phase) |
#
# MFU and HFU are PaLM's convention (Chowdhery et al. 2022, appendix B, which reports both for PaLM
# 540B: 46.2% MFU, 57.8% HFU with rematerialisation); MFU is the one that compares runs, because its
# numerator does not grow when a run recomputes more. HFU / MFU is the step's hardware FLOPs over its
# model FLOPs, a property of the policy alone. The summary line also gives the peak of each phase
# (forward, recompute, backward, optimizer), stored and live.
#
# On a CPU there is no datasheet peak to divide by, so the lesson measures one: the best rate of a
# square fp32 matmul on this machine (`--peak-tflops` takes any number; on CUDA `train` uses 989.5 TFLOP/s). A
# shared machine's rate drifts, so it is measured before every round of the run and after it, and the
# best of them is the peak: a step's HFU cannot exceed it, which the lesson checks.
#
# **Run it** as a script, `python lessons/22_monitoring_recomputation.py` (the CPU run, under a minute;
# `--fast` for seconds, `--large --device cuda` for a bigger shape on a GPU), or step through this
# notebook, where the same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset: the
# CPU run).

# %%
import math
import statistics
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

from _check import check
from _lesson import FAST_TIMING, Spread, choose, large, lesson_args, shape_line, small, timed_claim, wrote
from picockpt import Config, init_params
from picockpt.planning.step_forms import step_flops
from picockpt.teaching.plotting import PHASE_COLORS, mib, policy_color, save_figure
from picockpt.measurement.train import MarkovTask, Monitor, make_optimizer, train

SEGMENTS = ("none", "full", "cheap")  # one run, its policy changed in this order, round after round

# %% [markdown]
# ## One run, three policies, interleaved
#
# The run trains the `small` model on the synthetic Markov task and changes its policy every few steps,
# `none`, `full`, `cheap`, then `full`, `cheap`, `none`, ... (each round starts one policy later, so no
# policy always follows the same one), the same weights and AdamW state carried on (one optimizer for
# the whole run). That is the situation to diagnose, a step that got slower, with one
# precaution a shared machine needs: a machine's speed drifts (another program starts, a core is
# taken), and three long segments one after the other would blame that drift on the policies. Short
# segments in rounds, each round running every policy once, let a slow moment slow them all alike;
# each round's ratio of full's step time to none's cancels it. The first step of each segment (just
# after the switch) is left out of the medians.

# %%
def shape(mode):
    """(Config, batch, seq, rounds, steps per segment) of each run mode."""
    return choose(mode, fast=(Config.from_preset("tiny"), 2, 32, 2, 3), cpu=(small(), 4, 128, 5, 4),
                  large=(large(), 4, 1024, 4, 4))


def matmul_peak(device, n=512, repeats=20):
    """This device's best fp32 matmul rate, in FLOP/s: the largest 2*n^3 / seconds over a few runs of an
    (n, n) @ (n, n) product, a stand-in for a datasheet's dense peak."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def run(cfg, batch, seq, rounds, steps, device, seed):
    """The run's segments in order, [(policy, round, records)] (train(record=...)), weights and AdamW state
    carried on; the log lines of the first round (what `train` prints, at the peak measured first); and the
    matmul peaks measured before each round and after the last (FLOP/s)."""
    params = init_params(cfg, seed=seed, device=device)
    task, optimizer = MarkovTask(cfg.vocab, seed=seed), make_optimizer(params)
    segments, lines, peaks = [], [], [matmul_peak(device)]  # train's own MFU/HFU: at this first peak
    for round_ in range(rounds):
        if round_:
            peaks.append(matmul_peak(device))  # the machine's rate now
        order = SEGMENTS[round_ % len(SEGMENTS):] + SEGMENTS[:round_ % len(SEGMENTS)]  # each policy first in turn
        for policy in order:
            records = []
            train(params, cfg, task, steps, batch, seq, policy, device=device, seed=seed + len(segments),
                  optimizer=optimizer, monitor=Monitor(log=lines.append if round_ == 0 else None, every=steps,
                                                       peak_tflops=peaks[0] / 1e12, record=records))
            segments.append((policy, round_, records))
    peaks.append(matmul_peak(device))
    return segments, lines, peaks


def at_peak(segments, first, best):
    """Every record's MFU and HFU rescaled from the peak train used (`first`) to the best one measured."""
    for _, _, records in segments:
        for row in records:
            row["mfu"], row["hfu"] = row["mfu"] * first / best, row["hfu"] * first / best


# %%
args = lesson_args()
cfg, batch, seq, rounds, steps = shape(args.mode)
device, fast = args.device, args.mode == "fast"
print(f"lesson 22, monitoring recomputation: {shape_line(cfg, batch, seq, device)}")
segments, lines, peaks = run(cfg, batch, seq, rounds, steps, device, args.seed)
print(f"{rounds} rounds of {len(SEGMENTS)} segments, {steps} steps each; what train printed in the first round "
      f"(MFU/HFU at the peak measured before it, {peaks[0] / 1e9:.1f} GFLOP/s):")
for line in lines:
    print(line)
peak = max(peaks)  # the best rate this device reached: what no step's HFU can exceed
at_peak(segments, peaks[0], peak)
print(f"peak for MFU/HFU from here on: {peak / 1e9:.1f} GFLOP/s, the best 512^3 fp32 matmul rate measured before "
      f"each round and after the run (" + ", ".join(f"{p / 1e9:.1f}" for p in peaks) + ")")

# %% [markdown]
# ## What the curves say
#
# The medians below leave out each segment's first step. Read them in this order:
#
# 1. **tokens/s** fell: the step is slower. By itself this says nothing about why.
# 2. **MFU** falls with it, always: its numerator is fixed by the model and the batch.
# 3. **HFU**: if it held (or rose) while MFU fell, the machine is at least as busy as before and the
#    step executes more FLOPs: recomputation (HFU / MFU is exactly hardware over model FLOPs). If HFU fell
#    as much as MFU, the work did not change and the machine got slower (contention, throttling, a slow
#    input pipeline): look elsewhere. "Held" needs a spread narrower than the effect: HFU's rounds may
#    straddle 1, but each must stay above every round's MFU, or the reading is inconclusive.
# 4. **recompute share of time against of FLOPs**: equal shares mean the recomputed work runs at the
#    speed of the rest. A time share well above the FLOP share means the recompute phase is slower per FLOP
#    (small matmuls, elementwise rebuilds the FLOP count leaves out: `cheap` rebuilds norms and the SwiGLU
#    product, which `FlopCounterMode` does not count). That is a statement about the phase, not about the
#    price: the time spent in a phase is not its marginal cost. The forward that did not store those
#    tensors, and the backward that reads them freshly rebuilt, can each run faster for it, so what
#    recomputation costs a step is the paired whole-step ratio against `none`, and only that ratio, set
#    against the FLOP ratio, says whether FLOP-based estimates understate the price.
#
# Each reading is checked before it is printed. `full` runs the same model FLOPs as `none` and more
# hardware FLOPs, so its step time over none's must be above 1 in every round (its MFU at most none's);
# `cheap` runs none's FLOPs and a little more, so the same holds for it. HFU / MFU must equal the FLOP
# ratio on every step (both rates share one step time and one peak). Where a check fails, the timing
# was inconclusive on this machine, and the FLOP figure is printed instead of the conclusion.

# %%
def medians(records, skip=1):
    """Medians over the steps after the first `skip` (a segment's first step follows the switch)."""
    rest = records[skip:] or records
    keys = ("tokens_per_second", "mfu", "hfu", "recompute_time", "recompute_flops_share", "seconds")
    return {key: statistics.median(row[key] for row in rest) for key in keys}


def by_round(segments, policy, key):
    """The per-round medians of one key for one policy, in round order."""
    return [medians(records)[key] for name, _, records in segments if name == policy]


def flop_ratio(cfg, batch, seq, policy):
    """A policy's hardware FLOPs over its model FLOPs (none's): exact, the closed form."""
    return sum(step_flops(cfg, batch, seq, policy).values()) / sum(step_flops(cfg, batch, seq, "none").values())


def diagnose(mode, rounds_of, flops):
    """Print the checks and the readings each one allows. rounds_of(policy, key): that policy's per-round
    medians; flops: {policy: FLOP ratio}. Returns {name: Claim}."""
    ratio = {p: Spread(tuple(a / b for a, b in zip(rounds_of(p, "seconds"), rounds_of("none", "seconds"))))
             for p in ("full", "cheap")}  # step time / none's, round by round: a drift slows both alike
    claims = {p: timed_claim(mode, ratio[p], f"{p} / none, step time (round by round; none's MFU / {p}'s)", ">1",
                             flops[p]) for p in ratio}
    for claim in claims.values():
        print(claim.text)
    full = claims["full"]
    if full.conclusive:
        mfu = Spread(tuple(1 / r for r in ratio["full"].samples))  # model FLOPs fixed: MFU goes as 1 / time
        hfu = Spread(tuple(flops["full"] / r for r in ratio["full"].samples))  # hardware FLOPs x flops["full"]
        if hfu.high < 1:
            reading = ("HFU fell too, in every round: full's step costs more than its extra FLOPs at none's rate; its "
                       "recomputation (or its own passes) ran slower per FLOP than none's step")
        elif hfu.low > 1 or hfu.low > mfu.high:  # a straddle reads as "held" only above every round's MFU
            held = "rose in every round" if hfu.low > 1 else "held (its rounds straddle 1, each above every MFU)"
            reading = (f"HFU {held} while MFU fell: the slowdown is the extra work (recomputation), not a slower machine: each "
                       f"round ran both policies on the machine as it was then")
        else:
            reading = ("HFU's rounds straddle 1 and overlap MFU's: the round-to-round spread here is wider than the "
                       f"extra FLOPs' factor ({flops['full']:.3f}), so whether the machine slowed is inconclusive")
        print(f"full against none: MFU x{mfu.text('{:.3f}')} (below 1 in every round, as it must be), HFU "
              f"x{hfu.text('{:.3f}')}: {reading}")
    elif mode != "fast":
        print(f"full against none: the timing was inconclusive on this machine; by FLOPs, at equal HFU full's MFU is "
              f"1 / {flops['full']:.3f} = {1 / flops['full']:.3f} of none's")
    share = Spread(tuple(t / f for t, f in zip(rounds_of("cheap", "recompute_time"),
                                               rounds_of("cheap", "recompute_flops_share"))))
    cheap = timed_claim(mode, share, "cheap: recompute share of time / share of FLOPs (round by round)", ">1")
    print(cheap.text)
    if cheap.conclusive:
        print(f"cheap: its recompute phase takes {share.median:.1f}x the share of time that its FLOPs would: its "
              f"rebuilds are elementwise work the FLOP count does not see")
    elif mode != "fast":
        print(f"cheap: the timing was inconclusive on this machine; by FLOPs, recomputation is "
              f"{statistics.median(rounds_of('cheap', 'recompute_flops_share')):.1%} of its step")
    claims["cheap recompute share"] = cheap
    priced = timed_claim(mode, Spread(tuple(r / flops["cheap"] for r in ratio["cheap"].samples)),
                         "cheap: its step time over none's / its FLOP ratio (round by round)", ">1")
    print(priced.text)
    if priced.conclusive:
        print(f"cheap: every round's step ratio is above its FLOP ratio ({flops['cheap']:.3f}): here FLOP-based "
              f"estimates understate its price")
    elif mode != "fast":
        print("cheap: whether FLOP-based estimates understate its price is inconclusive on this machine (the "
              "whole-step ratio, not the recompute phase's share of time, is the price)")
    claims["cheap price against FLOPs"] = priced
    return claims


# %%
counted = {policy: [row for name, _, records in segments if name == policy for row in records[1:] or records]
           for policy in SEGMENTS}  # every segment's steps after its first
summary = {policy: medians(rows, skip=0) for policy, rows in counted.items()}
flop_ratios = {policy: flop_ratio(cfg, batch, seq, policy) for policy in SEGMENTS}
print(f"\nmedians over every segment's steps after its first ({rounds} segments per policy):")
print(f"{'policy':<8}{'tokens/s':>10}{'step ms':>9}{'MFU':>8}{'HFU':>8}{'HFU/MFU':>9}{'FLOP ratio':>11}"
      f"{'recompute: FLOPs':>18}{'time':>7}")
for policy, row in summary.items():
    print(f"{policy:<8}{row['tokens_per_second']:>10,.0f}{row['seconds'] * 1e3:>9.1f}{row['mfu']:>8.1%}"
          f"{row['hfu']:>8.1%}{row['hfu'] / row['mfu']:>9.3f}{flop_ratios[policy]:>11.3f}"
          f"{row['recompute_flops_share']:>18.1%}{row['recompute_time']:>7.1%}")
exact = all(math.isclose(row["hfu"] / row["mfu"], flop_ratios[policy], rel_tol=1e-9)
            for policy, rows in counted.items() for row in rows)  # one step time and one peak under both rates
print(f"HFU / MFU equals the FLOP ratio on every step: {exact}")
below_peak = all(row["hfu"] <= 1 for rows in counted.values() for row in rows)
print(f"HFU at most 100% of the peak on every step: {below_peak}"
      + ("" if below_peak else " (a step ran faster than every peak measurement: their levels are inconclusive on "
                               "this machine; their ratios, under one peak, are not)"))


def rounds_of(policy, key):
    return by_round(segments, policy, key)


drift = {policy: Spread(tuple(v / rounds_of(policy, "seconds")[0] for v in rounds_of(policy, "seconds")))
         for policy in SEGMENTS}  # each round's step time over the first round's
print("the machine's drift over the run, each policy's step time by round over its first round's: "
      + (FAST_TIMING if fast else "; ".join(f"{policy} {' '.join(f'{v:.2f}' for v in drift[policy].samples)}"
                                            for policy in SEGMENTS))
      + " (a drift that slows every policy alike cancels in the ratios taken within a round)")
claims = diagnose(args.mode, rounds_of, flop_ratios)
none, full, cheap = (summary[p] for p in SEGMENTS)

# %% [markdown]
# ## Memory per phase over the run
#
# The other half of monitoring is what recomputation buys. The stored peak of each phase comes from the
# activation store (exact, equal to `inventory.predicted_peak_bytes` at its largest); it changes only
# when the policy does: under `full` the forward keeps one input per layer, and the recompute and
# backward phases hold one rebuilt layer at a time on top of them.

# %%
def plot(segments, peak):
    """Four panels over the run's steps: tokens/s; MFU and HFU; recompute share of time and FLOPs;
    stored peak per phase. Shaded: the policy of each segment."""
    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    start = 0
    for policy, _, records in segments:
        x = np.arange(start, start + len(records))
        for ax in axes:
            ax.axvspan(x[0] - 0.5, x[-1] + 0.5, color=policy_color(policy), alpha=0.12)
        axes[0].text(x.mean(), 0.02, policy, transform=axes[0].get_xaxis_transform(), ha="center", fontsize=6)
        axes[0].plot(x, [r["tokens_per_second"] for r in records], "o-", ms=3, color="black")
        axes[1].plot(x, [100 * r["mfu"] for r in records], "o-", ms=3, color="#4C72B0",
                     label="MFU (model FLOPs: no recomputation)" if start == 0 else None)
        axes[1].plot(x, [100 * r["hfu"] for r in records], "s--", ms=3, color="#DD8452",
                     label="HFU (hardware FLOPs: recomputation included)" if start == 0 else None)
        axes[2].plot(x, [100 * r["recompute_time"] for r in records], "o-", ms=3, color=PHASE_COLORS["recompute"],
                     label="recompute share of step time" if start == 0 else None)
        axes[2].plot(x, [100 * r["recompute_flops_share"] for r in records], "--", color="black",
                     label="recompute share of FLOPs (closed form)" if start == 0 else None)
        for phase in ("forward", "recompute", "backward"):
            axes[3].plot(x, mib([r["phases"][phase]["stored"] for r in records]), "o-", ms=3,
                         color=PHASE_COLORS[phase], label=f"{phase} phase" if start == 0 else None)
        start += len(records)
    axes[0].set_ylabel("tokens/s")
    axes[1].set_ylabel(f"% of {peak / 1e9:.0f} GFLOP/s")
    axes[2].set_ylabel("% recompute")
    axes[3].set_ylabel("stored peak (MiB)")
    axes[3].set_xlabel("step of the run (shaded: each segment's policy; a segment's first step follows the switch)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    for ax in axes[1:]:  # room above the curves for a legend in one row
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)
        ax.legend(fontsize=7, loc="upper center", ncol=3)
    steps_each = len(segments[0][2])
    axes[0].set_title(f"One run, its policy changed every {steps_each} steps: {shape_line(cfg, batch, seq, device)}",
                      fontsize=9)
    fig.tight_layout()
    return fig


path = save_figure(plot(segments, peak), "22_monitoring_recomputation")
wrote(path)

# %% [markdown]
# ## Exercises
#
# Both for the `small` model at batch 4 × 128 tokens, fp32.
#
# **1.** A run switches from `none` to `full` and its HFU stays where it was. By what factor does its
# MFU fall? (HFU / MFU is hardware FLOPs over model FLOPs: `inventory.step_flops` has both.)

# %%
exercise = small()
answer = 1.328  # MFU under none / MFU under full

# %%
ratio = sum(step_flops(exercise, 4, 128, "full").values()) / sum(step_flops(exercise, 4, 128, "none").values())
run_ratio = sum(step_flops(cfg, batch, seq, "full").values()) / sum(step_flops(cfg, batch, seq, "none").values())
check("MFU(none) / MFU(full) at equal HFU (small, 4 x 128)", answer, ratio, rel=0.005,
      why=f"full runs every layer's forward once more: {ratio:.4f} times the model FLOPs (one extra forward of the "
          f"layers, not of the head); this run's own HFU / MFU under full is {full['hfu'] / full['mfu']:.4f}, its "
          f"shape's FLOP ratio ({run_ratio:.4f}), since both rates share one step time and one peak")

# %% [markdown]
# **2.** Under `cheap`, what share of the step's FLOPs is recomputation? (Then compare it with the share
# of time the run printed, and with what the check on cheap's recompute share said of it.)

# %%
answer = 0.021  # share of the step's FLOPs

# %%
flops = step_flops(exercise, 4, 128, "cheap")
share = flops["recompute"] / sum(flops.values())
check("recompute share of FLOPs under cheap (small, 4 x 128)", answer, share, rel=0.02,
      why=f"cheap recomputes q k^T's matmul ({flops['recompute'] / 1e9:.3f} GFLOP of {sum(flops.values()) / 1e9:.2f}); "
          f"its norm and SwiGLU rebuilds are elementwise, uncounted; this run measured "
          f"{cheap['recompute_time']:.1%} of the time in the recompute phase")

# %%
RESULT = {"figures": [str(path)], "summary": {
    "peak GFLOP/s (measured matmul)": round(peak / 1e9, 1),
    **{f"{policy} MFU": FAST_TIMING if fast else f"{row['mfu']:.1%}" for policy, row in summary.items()},
    **{f"{policy} HFU": FAST_TIMING if fast else f"{row['hfu']:.1%}" for policy, row in summary.items()},
    "full HFU / MFU": round(full["hfu"] / full["mfu"], 4), "full FLOP ratio": round(flop_ratios["full"], 4),
    "HFU / MFU = FLOP ratio (every step)": exact,
    "full / none step time (none's MFU / full's)": claims["full"].short,
    "cheap / none step time": claims["cheap"].short}}

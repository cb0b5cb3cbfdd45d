# %% [markdown]
# # Lesson 18: monitoring recomputation in a training run
#
# A run prints a line per step; this lesson reads those lines as curves and asks the question a
# practitioner asks when a step is slower than expected: is the machine slower, or is the step doing
# more work? Three numbers answer it, each printed by `python -m picockpt train` (`picockpt/train.py`):
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
# square fp32 matmul on this machine (`--peak-tflops` takes any number; on CUDA `train` uses 989.5).
#
# **Run it** as a script, `python lessons/18_monitoring_recomputation.py` (the CPU run, under a minute;
# `--fast` for seconds, `--large --device cuda` for a bigger shape on a GPU), or step through this
# notebook, where the same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset: the
# CPU run).

# %%
import statistics
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

from _check import check
from _lesson import FAST_TIMING, choose, large, lesson_args, shape_line, small, wrote
from picockpt import Config, init_params
from picockpt.inventory import step_flops
from picockpt.plotting import PHASE_COLORS, mib, policy_color, save_figure
from picockpt.train import MarkovTask, train

SEGMENTS = ("none", "full", "cheap")  # one run, its policy changed twice on the way

# %% [markdown]
# ## One run, three policies
#
# The run trains the `small` model on the synthetic Markov task; after a third of its steps the policy
# changes from `none` to `full`, after two thirds to `cheap`, the same weights and optimizer state
# carried on (each change restarts `train`, whose first step rebuilds AdamW's state and which the medians
# leave out). That is the situation to diagnose: the same job, a step that got slower.

# %%
def shape(mode):
    """(Config, batch, seq, steps per policy) of each run mode."""
    return choose(mode, fast=(Config.from_preset("tiny"), 2, 32, 5), cpu=(small(), 4, 128, 14),
                  large=(large(), 4, 1024, 14))


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


def run(cfg, batch, seq, steps, device, seed, peak):
    """The run's records (train(record=...)), one list per policy segment, weights carried on."""
    params = init_params(cfg, seed=seed, device=device)
    task = MarkovTask(cfg.vocab, seed=seed)
    segments, lines = {}, []
    for number, policy in enumerate(SEGMENTS):
        segments[policy] = []
        train(params, cfg, task, steps, batch, seq, policy, device=device, log=lines.append,
              every=steps, seed=seed + number, peak_tflops=peak / 1e12, record=segments[policy])
    return segments, lines


# %%
args = lesson_args()
cfg, batch, seq, steps = shape(args.mode)
device, fast = args.device, args.mode == "fast"
print(f"lesson 18, monitoring recomputation: {shape_line(cfg, batch, seq, device)}")
peak = matmul_peak(device)
print(f"peak for MFU/HFU: {peak / 1e9:.1f} GFLOP/s (this device's best 512^3 fp32 matmul)")
segments, lines = run(cfg, batch, seq, steps, device, args.seed, peak)
for line in lines:
    print(line)

# %% [markdown]
# ## What the curves say
#
# The medians below leave out each segment's first step (the warm-up). Read them in this order:
#
# 1. **tokens/s** fell: the step is slower. By itself this says nothing about why.
# 2. **MFU** falls with it, always: its numerator is fixed by the model and the batch.
# 3. **HFU**: if it held (or rose) while MFU fell, the machine is at least as busy as before and the
#    step executes more FLOPs: recomputation (HFU / MFU is exactly hardware over model FLOPs). If HFU fell
#    as much as MFU, the work did not change and the machine got slower (contention, throttling, a slow
#    input pipeline): look elsewhere.
# 4. **recompute share of time against of FLOPs**: equal shares mean the recomputed work runs at the
#    speed of the rest. A time share well above the FLOP share means recomputation is slower per FLOP
#    (small matmuls, elementwise rebuilds the FLOP count leaves out: `cheap` rebuilds norms and the SwiGLU
#    product, which `FlopCounterMode` does not count), so FLOP-based estimates understate its price.

# %%
def medians(records):
    """A segment's medians over its steps after the first."""
    rest = records[1:] or records
    keys = ("tokens_per_second", "mfu", "hfu", "recompute_time", "recompute_flops_share", "seconds")
    return {key: statistics.median(row[key] for row in rest) for key in keys}


summary = {policy: medians(records) for policy, records in segments.items()}
print(f"{'policy':<8}{'tokens/s':>10}{'step ms':>9}{'MFU':>8}{'HFU':>8}{'HFU/MFU':>9}{'FLOP ratio':>11}"
      f"{'recompute: FLOPs':>18}{'time':>7}")
for policy, row in summary.items():
    flops = step_flops(cfg, batch, seq, policy)
    ratio = sum(flops.values()) / sum(step_flops(cfg, batch, seq, "none").values())
    print(f"{policy:<8}{row['tokens_per_second']:>10,.0f}{row['seconds'] * 1e3:>9.1f}{row['mfu']:>8.1%}"
          f"{row['hfu']:>8.1%}{row['hfu'] / row['mfu']:>9.3f}{ratio:>11.3f}{row['recompute_flops_share']:>18.1%}"
          f"{row['recompute_time']:>7.1%}")
none, full, cheap = (summary[p] for p in SEGMENTS)
if fast:
    print(f"full against none: {FAST_TIMING}")
else:
    mfu_drop, hfu_drop = 1 - full["mfu"] / none["mfu"], 1 - full["hfu"] / none["hfu"]
    print(f"full against none: tokens/s {full['tokens_per_second'] / none['tokens_per_second'] - 1:+.0%}, MFU "
          f"{-mfu_drop:+.0%}, HFU {-hfu_drop:+.0%}: "
          + ("MFU did not fall: the machine ran faster under this segment (a shared CPU's rate drifts) by more than "
             "full's extra work costs; HFU / MFU still gives the policy's share of the work, whatever the speed"
             if mfu_drop <= 0 else
             "HFU fell far less than MFU (or held, or rose): most of the slowdown is extra work (recomputation), "
             "not a slower machine"
             if hfu_drop < mfu_drop / 2 else
             "HFU fell about as much as MFU: more than the recomputation slowed this step down"))
    print(f"cheap: recompute {cheap['recompute_flops_share']:.1%} of FLOPs but {cheap['recompute_time']:.1%} of time: "
          f"its rebuilds are elementwise work the FLOP count does not see")

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
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    start = 0
    for policy, records in segments.items():
        x = np.arange(start, start + len(records))
        for ax in axes:
            ax.axvspan(x[0] - 0.5, x[-1] + 0.5, color=policy_color(policy), alpha=0.08)
        axes[0].text(x.mean(), 0.02, policy, transform=axes[0].get_xaxis_transform(), ha="center", fontsize=9)
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
    axes[3].set_xlabel("step of the run (each segment restarts train: its first step rebuilds AdamW's state)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    for ax in axes[1:]:
        ax.legend(fontsize=7, loc="upper right" if ax is axes[3] else "upper left")
    axes[0].set_title(f"One run, its policy changed twice: {shape_line(cfg, batch, seq, device)}", fontsize=9)
    fig.tight_layout()
    return fig


path = save_figure(plot(segments, peak), "18_monitoring_recomputation")
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
# of time the run printed: the gap is the elementwise work no FLOP count sees.)

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
    "full HFU / MFU": round(full["hfu"] / full["mfu"], 4), "full FLOP ratio": round(ratio, 4)}}

# %% [markdown]
# # Lesson 04: segments of C layers, and the U-shaped curve of memory against C
#
# Keep only the input of every $C$-th layer (policy `every:C`). During the backward, the segment being
# worked on is recomputed from its checkpoint and held whole while the checkpoints of the segments below
# it wait, so the store peaks at about
#
# $$\frac{L}{C}\,X + C\,A \qquad\text{(Chen et al. 2016)},$$
#
# with $X$ the bytes of one checkpoint (a layer input) and $A$ the bytes of one fully stored layer; the
# minimum is at $C^* = \sqrt{L X / A}$. Few checkpoints (large $C$) means a big segment to hold; many
# checkpoints (small $C$) means many inputs to hold: memory against $C$ is a U. picockpt's exact
# formula, `predicted_peak_bytes`, counts the same two parts without rounding:
#
# $$P(C) = \max\Big(n X + F,\ \max_k\,(k X + n_k A)\Big),$$
#
# with $n$ segments of $n_k$ layers and $F$ the bytes around the layers (final norm, logits).
#
# This lesson uses a deep, narrow model (many layers, small widths), measures the store's peak at every
# $C$, and draws the points on the exact formula's curve and on Chen's. Notebook 02
# (`03_deriving_L_over_C_plus_C`) derives the formula step by step.
#
# **Run it** as a script, `python lessons/04_segments_of_C_layers.py` (the CPU run, well under a minute;
# `--fast` for seconds, `--large --device cuda` for a bigger shape on a GPU), or step through this
# notebook, where the same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset: the
# CPU run).

# %%
import math

import matplotlib.pyplot as plt
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from _check import check
from _lesson import choose, lesson_args, shape_line, wrote
from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import chain_sizes, predicted_peak_bytes
from picockpt.measurement.measure import make_batch
from picockpt.teaching.plotting import mib, policy_color, save_figure
from picockpt.measurement.tracker import Tracker

# %% [markdown]
# ## A deep, narrow model, and one measurement per C
#
# The U needs many layers, not wide ones. `measure_peaks` runs one forward and backward per $C$, with
# a tracker that watches only the store's events (its logical view: exact on any device, and fast).

# %%
def deep(layers, hidden=32, heads=2, ffn=64, vocab=64):
    """A deep, narrow Llama-like stack: the U needs many layers, not wide ones."""
    return Config(vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=1, ffn=ffn, max_seq=1024)


def shape(mode):
    """(Config, batch, seq) of each run mode."""
    return choose(mode, fast=(deep(32), 2, 16), cpu=(deep(128), 2, 16),
                  large=(deep(512, hidden=256, heads=4, ffn=512, vocab=1024), 4, 256))


def segment_sizes(L):
    """Every C from 1 to L; for very deep models, C <= 32 and the C where the segment count changes."""
    if L <= 128:
        return list(range(1, L + 1))
    return sorted(set(range(1, 33)) | {math.ceil(L / n) for n in range(1, 17)})


def measure_peaks(cfg, batch, seq, segments, device="cpu", seed=0):
    """C -> peak bytes of the activation store over one forward + backward under every:C."""
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)
    peaks = {}
    for C in segments:
        with Tracker(device, physical=False, flops=False) as tracker:  # store events only: fast
            loss_and_grads(params, cfg, input_ids, targets, f"every:{C}", tracker=tracker)
        peaks[C] = tracker.peak_logical
    return peaks


def chen(L, C, X, A):
    """Chen et al.'s count: L/C checkpoints and one segment of C stored layers."""
    return L / C * X + C * A


def argmins(values):
    """The keys of the smallest value (a list: two C can tie)."""
    low = min(values.values())
    return [key for key, value in values.items() if value == low]


# %%
args = lesson_args()
cfg, batch, seq = shape(args.mode)
L = cfg.layers
X, A, F = chain_sizes(cfg, batch, seq)
print(f"lesson 04, every:C for C = 1..{L}: {shape_line(cfg, batch, seq, args.device)}")
print(f"X (one checkpoint) = {X:,} B, A (one stored layer) = {A:,} B, A/X = {A / X:.2f}, "
      f"F (final norm + logits) = {F:,} B")

segments = segment_sizes(L)
measured = measure_peaks(cfg, batch, seq, segments, args.device, args.seed)
exact = {C: predicted_peak_bytes(cfg, batch, seq, f"every:{C}") for C in range(1, L + 1)}
best_measured, best_formula = argmins(measured), argmins({C: exact[C] for C in segments})
chen_best = math.sqrt(L * X / A)

print(f"\n{'C':>4}{'segments':>10}{'measured MiB':>14}{'formula MiB':>13}{'equal':>7}{'Chen MiB':>10}")
for C in segments:
    print(f"{C:>4}{math.ceil(L / C):>10}{mib(measured[C]):>14.4f}{mib(exact[C]):>13.4f}"
          f"{'yes' if measured[C] == exact[C] else 'NO':>7}{mib(chen(L, C, X, A)):>10.4f}")
all_equal = all(measured[C] == exact[C] for C in segments)
print(f"\nmeasured minimum: C = {best_measured} ({mib(measured[best_measured[0]]):.4f} MiB); "
      f"the formula puts it at C = {best_formula}; Chen's sqrt(L·X/A) = {chen_best:.2f}")
print(f"every:1 (full) {mib(measured[1]):.3f} MiB, every:{L} (one segment) {mib(measured[L]):.3f} MiB, "
      f"best {mib(measured[best_measured[0]]):.3f} MiB: {measured[1] / measured[best_measured[0]]:.2f}x "
      f"below full; store everything (none) would hold {mib(L * A + F):.3f} MiB")

# %% [markdown]
# Every measured point equals the exact formula, and the lowest measured point is the formula's
# minimum (the tests assert both). Chen's curve runs a little above (it counts all $L/C$ checkpoints
# and no head) and its $\sqrt{L X / A}$ lands next to the measured minimum.
#
# ## The figure
#
# Left, the whole U on log axes: the measured points on the exact curve, Chen's smooth curve above
# them. Right, the bottom of the U split into its two parts at the peak moment: the checkpoints held
# (grey) and the segment being recomputed (orange). Fewer checkpoints, bigger segment.

# %%
def parts(L, C, X, A, F):
    """(held, segment) at the moment the store peaks under every:C: the same max as the formula's."""
    sizes = [min(C, L - start) for start in range(0, L, C)]
    candidates = [(len(sizes) * X + F, 0)] + [(k * X, n_k * A) for k, n_k in enumerate(sizes)]
    return max(candidates, key=sum)


fig, (wide, zoom) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
every_c = range(1, L + 1)
smooth = [1 + i * (L - 1) / 400 for i in range(401)]
wide.plot(every_c, mib([exact[C] for C in every_c]), color="0.3", lw=1, label="exact formula (every C)")
wide.plot(smooth, mib([chen(L, C, X, A) for C in smooth]), "--", color=policy_color("every"),
          label="Chen: (L/C)·X + C·A")
wide.plot(segments, mib([measured[C] for C in segments]), "o", ms=4, mfc="none", mew=0.8,
          color=policy_color("full"), label="measured peak of the store")
low = best_measured[0]
wide.plot([low], [mib(measured[low])], "*", ms=16, color="gold", mec="k", zorder=5,
          label=f"measured minimum, C = {low}")
wide.axvline(chen_best, color="0.5", ls=":", label=f"sqrt(L·X/A) = {chen_best:.2f}")
wide.set_xscale("log")
wide.set_yscale("log")
for axis in (wide.xaxis, wide.yaxis):  # plain numbers at 1, 2, 5, 10, ... on the log axes; minor ticks unlabelled
    axis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    axis.set_major_formatter(FormatStrFormatter("%g"))
    axis.set_minor_formatter(NullFormatter())
wide.set_xlabel("C, layers per segment (log scale)")
wide.set_ylabel("peak stored activations (MiB, log scale)")
wide.set_title(f"every:C on L={L} layers: memory against C is a U")
wide.legend(fontsize=8)
wide.grid(alpha=0.3, which="both")

near = [C for C in segments if C <= min(L, 12)]  # the bottom of the U, split into its two parts at the peak
held, segment_part = zip(*(parts(L, C, X, A, F) for C in near))
zoom.bar(near, mib(list(held)), color="0.55", label="checkpoints held (+ F at the end of the forward)")
zoom.bar(near, mib(list(segment_part)), bottom=mib(list(held)), color=policy_color("every"), alpha=0.8,
         label="the segment being recomputed")
zoom.plot(near, mib([measured[C] for C in near]), "o", color=policy_color("full"), label="measured")
zoom.set_xticks(near)
zoom.set_xlabel("C")
zoom.set_ylabel("MiB at the peak")
zoom.set_title("the bottom of the U: fewer checkpoints, bigger segment")
zoom.legend(fontsize=8)
fig.suptitle(f"Segments of C layers (h={cfg.hidden}, A/X = {A / X:.1f}, batch {batch} x {seq}, "
             f"{cfg.dtype}): every measured point is on the exact formula")
fig.tight_layout()
path = save_figure(fig, "04_segments_of_C_layers")
wrote(path)

# %% [markdown]
# ## When does any C > 1 beat full?
#
# Three sizes decide it, not $A/X$ alone. With $C$ dividing $L$, `every:C` peaks at
# $\max\big(\tfrac{L}{C} X + F,\ (\tfrac{L}{C} - 1) X + C A\big)$; the first term is always below full's
# $L X + F$, so `every:C` beats `full` exactly when
#
# $$\Big(\frac{L}{C} - 1\Big) X + C A \;<\; \max\big(L X + F,\ (L - 1) X + A\big)\quad\text{(full's peak)}.$$
#
# When the backward sets full's peak ($A > X + F$), that is $A/X < L/C$: deep models whose layers are
# not too big for their input. When the head sets it ($X + F > A$: a large vocabulary's logits beside
# layers made small by not storing the probabilities), fewer checkpoints lower the end of the forward
# directly, and $C = 2$ or $3$ wins even with $A/X > L/C$. For Llama 3 in bf16 at one sequence of 4096
# tokens, no dropout, `every:2` needs 8.7% less than `full` for 405B, while for 8B and 70B `full` is
# best; with the probabilities not stored (`selective`, as under FlashAttention), `every:2` is 24.5%
# below `full+selective` for 8B and 25.8% for 70B, and `every:3` is 37.1% below it for 405B. Notebook 02
# prints that table from `predicted_peak_bytes`, and checks the criterion at every $C$.
#
# ## Exercises
#
# **1. Predict, then measure.** The deep model with $L = 24$ layers, batch 2 × 16 tokens, under
# `every:3`: 8 segments of 3 layers. With the sizes printed below, which moment sets the peak, and how
# many bytes is it? Write your prediction, then the next cell measures it.

# %%
deep24 = deep(24)
X24, A24, F24 = chain_sizes(deep24, 2, 16)
print(f"L = 24, batch 2 x 16: X = {X24:,} bytes, A = {A24:,} bytes, F = {F24:,} bytes")

# %%
answer = 201_472  # bytes: your prediction of the store's peak under every:3

# %%
measured24 = measure_peaks(deep24, 2, 16, [3], args.device, args.seed)[3]
check("the store's peak under every:3 at L = 24, in bytes (measured)", answer, measured24, rel=0,
      why=f"max(n·X + F, (n-1)·X + 3·A) with n = 8: max({8 * X24 + F24:,}, {7 * X24 + 3 * A24:,}) bytes; "
          f"the tracker measured {measured24:,}")

# %% [markdown]
# **2.** The same layers, 256 of them: Chen's continuous optimum is $\sqrt{L X / A}$. Which whole $C$
# gives the least peak by the exact formula?

# %%
answer = 4

# %%
deep256 = deep(256)
curve256 = {C: predicted_peak_bytes(deep256, 2, 16, f"every:{C}") for C in range(1, 257)}
X256, A256, _ = chain_sizes(deep256, 2, 16)
check("the best C of every:C for L = 256", answer, min(curve256, key=curve256.get), rel=0,
      why=f"sqrt(L·X/A) = sqrt(256·{X256:,}/{A256:,}) = {math.sqrt(256 * X256 / A256):.2f}; the exact "
          f"peaks at C = 3, 4, 5: {', '.join(f'{curve256[C]:,}' for C in (3, 4, 5))} bytes")

# %% [markdown]
# **3.** A real layer. For Llama 3 70B in bf16 at one sequence of $s = 8192$ tokens (eager attention,
# no dropout), what is $A/X$, a stored layer against its input? (`chain_sizes` on
# `Config.from_preset("llama3-70b", dtype="bf16")` tells; or count: the input is $2sh$ bytes, and the
# $s \times s$ probabilities of 64 heads dominate the layer.)

# %%
answer = 80.75

# %%
llama70 = Config.from_preset("llama3-70b", dtype="bf16")
X70, A70, _ = chain_sizes(llama70, 1, 8192)
check("A/X of a Llama 3 70B layer at s = 8192, bf16", answer, A70 / X70,
      why=f"A = {A70:,} bytes, of which the probabilities 2·a·s² = {2 * llama70.heads * 8192 ** 2:,}; "
          f"X = 2·s·h = {X70:,} bytes. A/X = {A70 / X70:.2f} is above L/C for every C > 1 (L/2 = 40), so no "
          f"every:C beats full here")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"L": L, "best C measured": best_measured, "best C formula": best_formula,
                      "sqrt(L·X/A)": round(chen_best, 2), "all C = formula": all_equal}}

# %% [markdown]
# # Lesson 02: the anatomy of one training step's memory
#
# One AdamW training step of the `small` model, watched tensor by tensor, twice: storing every
# activation (policy `none`) and storing only each layer's input (policy `full`). Three curves,
# against the step's event number (every tensor created or freed, every store put or pop):
#
# | curve | what it counts |
# |---|---|
# | **stored** | the activation store's bytes (the *logical* view): what the backward will need |
# | **live** | every tensor created during the step and still alive (the *physical* view): the store plus working memory, the gradients of activations and each op's transient outputs |
# | **+ grads & optimizer state** | live, plus the weight gradients and AdamW's two moments |
#
# Under `none` the forward ramps up to $L \cdot A + F$ bytes ($A$: one layer's stored activations,
# $F$: the final norm and the logits) and the backward ramps them down again, layer by layer. Under
# `full` the forward stores one input per layer, a *checkpoint* (in picockpt always a stored
# activation, never a saved model file), and the backward shows a micro-spike per layer: the layer's
# activations come back (recompute), are used (backward) and leave. The store's peak is checked
# against picockpt's exact formula, `inventory.predicted_peak_bytes`, to the byte.
#
# **Run it** as a script, `python lessons/02_anatomy_of_a_step.py` (the CPU run, well under a minute;
# `--fast` for seconds, `--large --device cuda` for a bigger shape on a GPU), or step through this
# notebook, where the same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset: the
# CPU run).

# %%
import matplotlib.pyplot as plt
import torch

from _check import check
from _lesson import choose, large, lesson_args, shape_line, small, wrote
from picockpt import init_params
from picockpt.planning.step_forms import chain_sizes, predicted_peak_bytes
from picockpt.measurement.measure import make_batch
from picockpt.teaching.plotting import mib, phase_spans, save_figure, shade_phases
from picockpt.measurement.tracker import PHASES, Tracker
from picockpt.measurement.train import make_optimizer, train_step

POLICIES = ("none", "full")
STORED_COLOR, LIVE_COLOR = "#2F4858", "#C44E52"

# %% [markdown]
# ## Watching one step
#
# `watch_step` runs one training step (forward, hand-written backward, AdamW) inside a `Tracker`,
# which records both views at every event, and the phase each event belongs to. The watched step is
# the first from fresh weights, after one untracked warm-up step on a copy of them: on a GPU the first
# step also allocates cuBLAS's workspace and fills the caching allocator, which is not the memory of a
# training step.

# %%
def shape(mode):
    """(Config, batch, seq) of each run mode."""
    return choose(mode, fast=(small(layers=4), 2, 32), cpu=(small(), 4, 128), large=(large(), 4, 1024))


def watch_step(cfg, batch, seq, policy, device, seed=0):
    """One tracked training step (forward, backward, AdamW) from fresh weights; returns the Tracker.
    An untracked warm-up step on a copy of the weights runs first (cuBLAS workspace, allocator)."""
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)
    copy = {name: p.clone() for name, p in params.items()}
    train_step(copy, make_optimizer(copy), cfg, input_ids, targets, policy)  # warm-up, not tracked
    del copy  # its weights, gradients and AdamW state go: the watched step creates its own
    optimizer = make_optimizer(params)
    torch.manual_seed(seed)  # the dropout masks, if any
    with Tracker(device, cuda_timeline=True) as tracker:  # on a GPU, memory_allocated at every store event
        train_step(params, optimizer, cfg, input_ids, targets, policy, tracker)
    return tracker


# %%
args = lesson_args()
cfg, batch, seq = shape(args.mode)
print(f"lesson 02, one training step: {shape_line(cfg, batch, seq, args.device)}")

trackers = {policy: watch_step(cfg, batch, seq, policy, args.device, args.seed) for policy in POLICIES}
predicted = {policy: predicted_peak_bytes(cfg, batch, seq, policy) for policy in POLICIES}

print(f"\n{'policy':<7}{'phase':<11}{'stored MiB':>12}{'live MiB':>12}{'+ grads & optimizer MiB':>26}")
for policy, tracker in trackers.items():
    for phase in ("forward", "recompute", "backward", "optimizer"):
        if phase in tracker.peaks:
            peak = tracker.peaks[phase]
            print(f"{policy:<7}{phase:<11}{mib(peak['logical']):>12.3f}{mib(peak['physical']):>12.3f}"
                  f"{mib(peak['total']):>26.3f}")
print()
for policy, tracker in trackers.items():
    same = "equal" if tracker.peak_logical == predicted[policy] else "DIFFERENT"
    print(f"{policy}: peak stored {tracker.peak_logical:,} bytes, formula {predicted[policy]:,} bytes ({same}); "
          f"peak live {mib(tracker.peak_physical):.3f} MiB")
none, full = trackers["none"], trackers["full"]
print(f"full / none: stored {none.peak_logical / full.peak_logical:.1f}x less, "
      f"live {none.peak_physical / full.peak_physical:.1f}x less")

# %% [markdown]
# The table gives each phase's peak. The stored peak of each policy equals the formula to the byte:
# the tracker counts the storages the engine put in the store, the formula multiplies shapes, and they
# agree. The live peak is larger: working memory rides on top of the store. The optimizer phase holds
# no activations at all, but the weight gradients and AdamW's state (the dashed curve below) are the
# largest thing in memory for a model this small.
#
# ## The figure
#
# What to look at: under `none`, the forward's ramp and the backward's ramp-down; under `full`, the
# flat, low forward (one checkpoint per layer) and the micro-spikes of the backward, one per layer:
# recompute (orange) brings the layer back, backward (green) uses it and drops it. Both panels share
# the y axis.

# %%
def point_at_first_spike(ax, timeline):
    """An arrow to the first recompute micro-spike: the last layer comes back, then its backward runs."""
    spans = [(first, last) for phase, first, last in phase_spans(timeline) if phase == "recompute"]
    if not spans:
        return
    first, last = spans[0]
    end = spans[1][0] if len(spans) > 1 else len(timeline)  # the tooth lasts until the next recompute
    top = max(range(first, end), key=lambda i: timeline[i]["physical"])
    y = mib(timeline[top]["physical"])
    ax.annotate("micro-spike: the last layer is recomputed,\nthen its backward runs, then it is dropped",
                (top, y), xytext=(top + 0.08 * len(timeline), y * 1.9 + 1), fontsize=8,
                arrowprops=dict(arrowstyle="->", lw=0.8))


fig, axes = plt.subplots(2, 1, figsize=(11, 7.5), sharey=True)
for ax, (policy, tracker) in zip(axes, trackers.items()):
    timeline = tracker.timeline
    steps = range(len(timeline))
    shade_phases(ax, timeline)
    ax.plot(steps, mib([e["total"] for e in timeline]), color="0.55", lw=1, ls="--",
            label="live + weight grads & AdamW state")
    ax.fill_between(steps, mib([e["logical"] for e in timeline]), color=STORED_COLOR, alpha=0.55, lw=0,
                    label="stored (activation store)")
    ax.plot(steps, mib([e["physical"] for e in timeline]), color=LIVE_COLOR, lw=1.2,
            label="live (activations + working memory)")
    if any(e["cuda"] is not None for e in timeline):  # on a GPU: the allocator's own count
        points = [(i, e["cuda"]) for i, e in enumerate(timeline) if e["cuda"] is not None]
        ax.plot([i for i, _ in points], mib([c for _, c in points]), ".", ms=2, color="k",
                label="torch.cuda.memory_allocated")
    ax.set_title(f"policy {policy}: peak stored {mib(tracker.peak_logical):.2f} MiB "
                 f"(formula {mib(predicted[policy]):.2f}), peak live {mib(tracker.peak_physical):.2f} MiB")
    if policy != "none":
        point_at_first_spike(ax, timeline)
    ax.set_ylabel("MiB")
    ax.set_xlim(0, len(timeline))
    ax.grid(alpha=0.3)
legend = {}  # label -> handle over both panels: the recompute shading is only in the second
for ax in axes:
    handles, labels = ax.get_legend_handles_labels()
    legend.update({label: handle for handle, label in zip(handles, labels) if label not in legend})
labels = sorted(legend, key=lambda label: PHASES.index(label) if label in PHASES else len(PHASES))  # phases first
axes[0].legend([legend[label] for label in labels], labels, loc="upper left", fontsize=8, ncol=2)
axes[1].set_xlabel("event of the step (each tensor created or freed, each store put or pop)")
fig.suptitle(f"One training step, tensor by tensor: L={cfg.layers}, h={cfg.hidden}, "
             f"batch {batch} x {seq} tokens, {cfg.dtype}")
fig.tight_layout()
path = save_figure(fig, "02_anatomy_of_a_step", fast=args.mode == "fast")
wrote(path)

# %% [markdown]
# ## Exercises
#
# These use the `small` model at batch 4 × 128 tokens in fp32, whatever shape the run above used.
# `chain_sizes` gives the three sizes every formula of these lessons is made of: $X$ (one checkpoint, a
# layer input), $A$ (one fully stored layer, input included) and $F$ (the final norm and the logits,
# stored once). `python -m picockpt inventory` lists a layer's tensors one by one.

# %%
exercise = small()
X, A, F = chain_sizes(exercise, 4, 128)
print(f"small, batch 4 x 128, fp32: L = {exercise.layers}, h = {exercise.hidden}; "
      f"A = {A:,} bytes (one stored layer), F = {F:,} bytes (final norm and logits)")

# %% [markdown]
# **1.** How many bytes does one checkpoint take? A layer input is $B \times T \times h$ numbers of
# 4 bytes.

# %%
answer = 262_144  # bytes

# %%
check("one checkpoint of `small` at batch 4 x 128, fp32, in bytes", answer, X, rel=0,
      why=f"X = B·T·h·4 = 4·128·{exercise.hidden}·4 = {X:,} bytes")

# %% [markdown]
# **2.** Under `none` the store peaks at the end of the forward, holding every layer and the head:
# $L \cdot A + F$. With $A$ and $F$ as printed above, how many MiB is that?

# %%
answer = 44.03  # MiB

# %%
check("the peak stored under none, in MiB", answer, mib(predicted_peak_bytes(exercise, 4, 128, "none")),
      why=f"L·A + F = {exercise.layers}·{A:,} + {F:,} = {exercise.layers * A + F:,} bytes "
          f"(predicted_peak_bytes: {predicted_peak_bytes(exercise, 4, 128, 'none'):,})")

# %% [markdown]
# **3.** Under `full` two moments compete for the peak: the end of the forward, with all $L$
# checkpoints and the head ($L \cdot X + F$), and the backward of the last layer, recomputed whole beside
# the $L - 1$ checkpoints below it ($(L-1) \cdot X + A$). Which one sets the peak: `"forward"` or
# `"backward"`?

# %%
answer = "backward"

# %%
forward_end, last_layer = exercise.layers * X + F, (exercise.layers - 1) * X + A
check("the moment that sets full's peak", answer, "backward" if last_layer > forward_end else "forward",
      why=f"L·X + F = {forward_end:,} bytes against (L-1)·X + A = {last_layer:,} bytes; "
          f"predicted_peak_bytes says {predicted_peak_bytes(exercise, 4, 128, 'full'):,}")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"stored MiB none/full": f"{mib(none.peak_logical):.2f}/{mib(full.peak_logical):.2f}",
                      "live MiB none/full": f"{mib(none.peak_physical):.2f}/{mib(full.peak_physical):.2f}",
                      "stored = formula": all(trackers[p].peak_logical == predicted[p] for p in POLICIES)}}

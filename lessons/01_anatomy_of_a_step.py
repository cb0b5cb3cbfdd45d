"""Lesson 01: the anatomy of one training step's memory.

One AdamW training step of the `small` model, watched tensor by tensor, twice: storing every
activation (policy none) and storing only each layer's input (policy full). Three curves,
against the step's event number:

    stored   the activation store's bytes (the logical view): what the backward will need
    live     every tensor created during the step and still alive (the physical view): the
             store plus working memory (gradients of activations, each op's transient outputs)
    + grads & optimizer state   live, plus the weight gradients and AdamW's two moments

What to look at: under `none` the forward ramps up to L*A + F bytes and the backward ramps
them down again, layer by layer; under `full` the forward stores one input per layer, and the
backward shows a micro-spike per layer: the layer's activations come back (recompute, orange),
are used (backward, green) and leave. Both panels share the y axis. The peak of the store is
checked against picockpt's exact formula, inventory.predicted_peak_bytes, to the byte.

Each watched step is the first from fresh weights, after one untracked warm-up step on a copy of
them: on a GPU the first step also allocates cuBLAS's workspace and fills the caching allocator,
which is not the memory of a training step. With --fast the figure goes to out/figures/.

    python lessons/01_anatomy_of_a_step.py            # the CPU run (small preset), well under a minute
    python lessons/01_anatomy_of_a_step.py --fast     # seconds: what the tests run
    python lessons/01_anatomy_of_a_step.py --large --device cuda   # a bigger shape for a GPU
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere, no install

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from lessons._lesson import choose, large, parse_args, shape_line, small
from picockpt import init_params
from picockpt.inventory import predicted_peak_bytes
from picockpt.measure import make_batch
from picockpt.plotting import mib, phase_spans, save_figure, shade_phases
from picockpt.tracker import PHASES, Tracker
from picockpt.train import make_optimizer, train_step

POLICIES = ("none", "full")
STORED_COLOR, LIVE_COLOR = "#2F4858", "#C44E52"


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


def _point_at_first_spike(ax, timeline):
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


def main(argv=None):
    args = parse_args(__doc__, argv)
    cfg, batch, seq = shape(args.mode)
    print(f"lesson 01, one training step: {shape_line(cfg, batch, seq, args.device)}")

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
            _point_at_first_spike(ax, timeline)
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
    path = save_figure(fig, "01_anatomy_of_a_step", fast=args.mode == "fast")
    print(f"wrote {path}")
    return {"figures": [str(path)],
            "summary": {"stored MiB none/full": f"{mib(none.peak_logical):.2f}/{mib(full.peak_logical):.2f}",
                        "live MiB none/full": f"{mib(none.peak_physical):.2f}/{mib(full.peak_physical):.2f}",
                        "stored = formula": all(trackers[p].peak_logical == predicted[p] for p in POLICIES)}}


if __name__ == "__main__":
    main()

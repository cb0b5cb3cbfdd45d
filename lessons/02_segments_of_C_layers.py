"""Lesson 02: segments of C layers, and the U-shaped curve of memory against C.

Keep only the input of every C-th layer (policy every:C). During the backward, the segment
being worked on is recomputed from its checkpoint and held whole while the checkpoints of the
segments below it wait, so the store peaks at about

    (L/C)·X  +  C·A        Chen et al. 2016: X = bytes of one checkpoint (a layer input),
                           A = bytes of one fully stored layer; minimum at C* = sqrt(L·X/A)

Few checkpoints (large C) means a big segment to hold; many checkpoints (small C) means many
inputs to hold: memory against C is a U. picockpt's exact formula, predicted_peak_bytes, counts
the same two parts without rounding: max(n·X + F, max over segments k of k·X + n_k·A), with n
segments of n_k layers and F the bytes around the layers (final norm, logits).

This script uses a deep, narrow model (many layers, small widths), measures the store's peak
at every C, and draws the points on the exact formula's curve and on Chen's. What to look at:
every point sits on the exact curve, and the lowest measured point is the formula's minimum
(the script prints both; the tests assert it). Chen's curve runs a little above (it counts all
L/C checkpoints and no head) and its sqrt(L·X/A) lands next to the measured minimum.

Whether any C > 1 beats full (C = 1) is decided by three sizes, not by A/X alone. With C dividing
L, every:C peaks at max((L/C)·X + F, (L/C - 1)·X + C·A); the first term is always below full's
L·X + F, so every:C beats full exactly when

    (L/C - 1)·X + C·A  <  max(L·X + F, (L - 1)·X + A)       (full's peak)

When the backward sets full's peak (A > X + F), that is A/X < L/C: deep models whose layers are
not too big for their input. When the head sets it (X + F > A: a large vocabulary's logits
beside layers made small by not storing the probabilities), fewer checkpoints lower the end of
the forward directly, and C = 2 or 3 wins even with A/X > L/C. For Llama 3 in bf16 at one
sequence of 4096 tokens, no dropout (predicted_peak_bytes; notebook 02 prints the table):
every:2 needs 8.7% less than full for 405B (full needs 9.6% more), while for 8B and 70B full is
best; with the probabilities not stored (selective, as under FlashAttention), every:2 is 24.5%
below full+selective for 8B and 25.8% for 70B, and every:3 is 37.1% below it for 405B.

    python lessons/02_segments_of_C_layers.py            # the CPU run, well under a minute
    python lessons/02_segments_of_C_layers.py --fast     # seconds: what the tests run
    python lessons/02_segments_of_C_layers.py --large --device cuda   # a bigger shape for a GPU
"""
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere, no install

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from lessons._lesson import choose, parse_args, shape_line
from picockpt import Config, init_params, loss_and_grads
from picockpt.inventory import chain_sizes, predicted_peak_bytes
from picockpt.measure import make_batch
from picockpt.plotting import mib, policy_color, save_figure
from picockpt.tracker import Tracker


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


def main(argv=None):
    args = parse_args(__doc__, argv)
    cfg, batch, seq = shape(args.mode)
    L = cfg.layers
    X, A, F = chain_sizes(cfg, batch, seq)
    print(f"lesson 02, every:C for C = 1..{L}: {shape_line(cfg, batch, seq, args.device)}")
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

    # the bottom of the U, split into its two parts at the peak moment
    near = [C for C in segments if C <= min(L, 12)]
    held, segment_part = zip(*(_parts(L, C, X, A, F) for C in near))
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
    path = save_figure(fig, "02_segments_of_C_layers")
    print(f"wrote {path}")
    return {"figures": [str(path)],
            "summary": {"L": L, "best C measured": best_measured, "best C formula": best_formula,
                        "sqrt(L·X/A)": round(chen_best, 2), "all C = formula": all_equal}}


def _parts(L, C, X, A, F):
    """(held, segment) at the moment the store peaks under every:C: the same max as the formula's."""
    sizes = [min(C, L - start) for start in range(0, L, C)]
    candidates = [(len(sizes) * X + F, 0)] + [(k * X, n_k * A) for k, n_k in enumerate(sizes)]
    return max(candidates, key=sum)


if __name__ == "__main__":
    main()

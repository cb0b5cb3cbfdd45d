"""Lesson 03: selective recomputation and sequence length, or where the s² term goes.

Every attention layer stores its probabilities, a (B, H, T, T) tensor: the one term of a layer's
activations that grows with the square of the sequence length. Korthikanti et al. (2022) count a
layer as s·b·h·(34 + 5·a·s/h) bytes (16-bit activations, 1-byte dropout masks): the 5·a·s²·b
part is that softmax output (2 bytes), its dropout mask (1) and the dropped output (2). Selective
recomputation drops exactly those and rebuilds them from the kept q and k in the backward, for
the price of one q·k^T matmul per layer (a few % of the FLOPs).

This script measures one forward + backward of the `small` model at several T under none,
selective and full, and fits bytes = a + b·T + c·T² to what it measured, with c counted in
"T×T tensors" (one layer's B·H·T² probabilities). What to look at:

    stored (left)   none: c = L, one T×T tensor per layer. selective: c = 0, linear in T.
                    full: c = 1, the one layer being recomputed holds its T×T tensor again.
                    Every point equals the exact formula, predicted_peak_bytes.
    live (right)    the T² term does not vanish, it moves: the backward of one attention layer
                    holds, beside the probabilities (stored, or rebuilt by selective), working
                    T×T tensors (the gradient of the probabilities dP, the product dP·P, the
                    softmax's gradient dS, each freed at its last use: two of them at once).
                    The s² term goes from "times L, for the whole step" to "one layer, for the
                    moment of its backward". (FlashAttention removes even that by never
                    materialising T×T.) The live c are fits, not counts, and depend on the range
                    of T: the live peak is the larger of that T² moment and other moments of
                    the step whose working memory grows only with T, which win at short T. The
                    CPU run (T = 64..512, L = 8) fits c = 9.75 (none), 3.29 (selective), 2.75 (full);
                    over T = 384..768 the same fit gives 10.0, 3.0, 3.0, that is L + 2, 1 + 2
                    and 1 + 2: the stored or rebuilt probabilities plus two working tensors.

    python lessons/03_selective_and_sequence_length.py            # the CPU run (small preset), well under a minute
    python lessons/03_selective_and_sequence_length.py --fast     # seconds: what the tests run
    python lessons/03_selective_and_sequence_length.py --large --device cuda   # a bigger shape for a GPU
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere, no install

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from lessons._lesson import choose, large, parse_args, shape_line, small
from picockpt import init_params, loss_and_grads
from picockpt.inventory import layer_inventory, predicted_peak_bytes, step_flops
from picockpt.measure import make_batch
from picockpt.plotting import mib, policy_color, save_figure
from picockpt.tracker import Tracker

POLICIES = ("none", "selective", "full")
SQUARE = ("attn.probs", "attn.probs_mask", "attn.probs_dropped")  # the (B, H, T, T) names


def shape(mode):
    """(Config, batch, sequence lengths) of each run mode."""
    return choose(mode, fast=(small(layers=2), 1, [16, 32, 48, 64]),
                  cpu=(small(), 2, [64, 128, 256, 384, 512]),
                  large=(large(layers=8), 1, [512, 1024, 2048, 3072, 4096]))


def measure(cfg, batch, seqs, policies, device="cpu", seed=0):
    """(policy, T) -> (peak stored bytes, peak live bytes) of one forward + backward."""
    peaks = {}
    params = init_params(cfg, seed=seed, device=device)
    for T in seqs:
        input_ids, targets = make_batch(cfg, batch, T, device, seed)
        for policy in policies:
            with Tracker(device, flops=False) as tracker:
                loss_and_grads(params, cfg, input_ids, targets, policy, tracker=tracker)
            peaks[policy, T] = (tracker.peak_logical, tracker.peak_physical)
    return peaks


def square_term(seqs, values, unit):
    """c of the least-squares fit values = a + b·T + c·T², divided by `unit` (bytes of one T² element)."""
    c = np.polyfit(np.array(seqs, dtype=float), np.array(values, dtype=float), 2)[0] / unit
    return round(float(c), 3) + 0.0  # + 0.0: no "-0.00" for a term that is exactly zero


def korthikanti_check(cfg, batch, seq):
    """Bytes per B·H·T² element of a layer's T×T tensors in 16-bit with dropout (closed form)."""
    sixteen = cfg.replace(dtype="bfloat16", dropout=0.1)
    inventory = layer_inventory(sixteen, batch, seq)
    return sum(inventory[name][2] for name in SQUARE) / (batch * cfg.heads * seq * seq)


def main(argv=None):
    args = parse_args(__doc__, argv)
    cfg, batch, seqs = shape(args.mode)
    cfg = cfg.replace(max_seq=max(cfg.max_seq, max(seqs)))
    print(f"lesson 03, sequence lengths {seqs}: {shape_line(cfg, batch, 'T', args.device)}")
    peaks = measure(cfg, batch, seqs, POLICIES, args.device, args.seed)
    predicted = {(p, T): predicted_peak_bytes(cfg, batch, T, p) for p in POLICIES for T in seqs}
    element = batch * cfg.heads * (2 if cfg.dtype in ("bfloat16", "float16") else 4)  # bytes per T² of one layer

    print(f"\n{'T':>5}  {'policy':<10}{'stored MiB':>12}{'formula MiB':>13}{'equal':>7}{'live MiB':>11}"
          f"{'one T×T MiB':>13}")
    for T in seqs:
        for p in POLICIES:
            stored, live = peaks[p, T]
            print(f"{T:>5}  {p:<10}{mib(stored):>12.3f}{mib(predicted[p, T]):>13.3f}"
                  f"{'yes' if stored == predicted[p, T] else 'NO':>7}{mib(live):>11.3f}{mib(element * T * T):>13.3f}")
    fits = {p: (square_term(seqs, [peaks[p, T][0] for T in seqs], element),
                square_term(seqs, [peaks[p, T][1] for T in seqs], element)) for p in POLICIES}
    print(f"\nT² coefficient of the fit over T = {seqs[0]}..{seqs[-1]}, in T×T tensors (one layer's B·H·T² "
          f"probabilities; L = {cfg.layers}):")
    for p, (stored_c, live_c) in fits.items():
        print(f"  {p:<10} stored {stored_c:6.2f}   live {live_c:6.2f}")
    print("(stored: exact counts. live: a fit that depends on the range of T; at short T the live peak comes at a "
          "moment that grows only with T, so the live c approach L + 2 / 1 + 2 / 1 + 2 only at long T)")
    flops = step_flops(cfg, batch, seqs[-1], "selective")
    rebuild = flops["recompute"] / (flops["forward"] + flops["backward"])
    layers_forward = flops["forward"] - 2 * batch * seqs[-1] * cfg.hidden * cfg.vocab  # the forward minus the LM head
    print(f"selective's price at T={seqs[-1]}: {flops['recompute'] / 1e9:.3f} GFLOP of q·k^T rebuilt, "
          f"{rebuild:.1%} of the step's FLOPs without recomputation, {flops['recompute'] / layers_forward:.1%} of the "
          f"layers' forward (what full recomputation would rerun: the convention of Korthikanti et al.'s 2.7% for "
          f"GPT-3)")
    per_element = korthikanti_check(cfg, batch, seqs[0])
    print(f"in 16-bit with dropout, one layer's T×T tensors take {per_element:g} bytes per B·H·T² element "
          f"(probabilities 2 + mask 1 + dropped 2): Korthikanti's 5·a·s²·b, exactly")

    fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 5), sharey=True)
    grid = np.linspace(seqs[0], seqs[-1], 60).round().astype(int)
    for p in POLICIES:
        color = policy_color(p)
        left.plot(grid, mib([predicted_peak_bytes(cfg, batch, int(T), p) for T in grid]), color=color, lw=1,
                  alpha=0.7)
        left.plot(seqs, mib([peaks[p, T][0] for T in seqs]), "o", color=color,
                  label=f"{p}: T² term = {fits[p][0]:.2f} T×T tensors")
        right.plot(seqs, mib([peaks[p, T][1] for T in seqs]), "o-", color=color,
                   label=f"{p}: T² term = {fits[p][1]:.2f} T×T tensors")
        right.plot(seqs, mib([peaks[p, T][0] for T in seqs]), ":", color=color, lw=1)
    left.set_title("stored activations (lines: exact formula, dots: measured)")
    right.set_title("live bytes (dotted: stored): the T² term left is working memory")
    for ax in (left, right):
        ax.set_xlabel("sequence length T")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    left.set_ylabel("peak over one forward + backward (MiB)")
    fig.suptitle(f"Where the s² term goes: L={cfg.layers}, h={cfg.hidden}, H={cfg.heads}, batch {batch}, "
                 f"{cfg.dtype}")
    fig.tight_layout()
    path = save_figure(fig, "03_selective_and_sequence_length")
    print(f"wrote {path}")
    T = seqs[-1]
    return {"figures": [str(path)],
            "summary": {f"stored MiB none/selective at T={T}": f"{mib(peaks['none', T][0]):.1f}/"
                                                               f"{mib(peaks['selective', T][0]):.1f}",
                        "T² tensors stored none/selective": f"{fits['none'][0]:.2f}/{fits['selective'][0]:.2f}",
                        "T² tensors live none/selective": f"{fits['none'][1]:.2f}/{fits['selective'][1]:.2f}",
                        "stored = formula": all(peaks[k][0] == predicted[k] for k in predicted)}}


if __name__ == "__main__":
    main()

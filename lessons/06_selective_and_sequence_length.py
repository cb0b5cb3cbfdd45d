# %% [markdown]
# # Lesson 06: selective recomputation and sequence length, or where the s² term goes
#
# Every attention layer stores its probabilities, a $(B, H, T, T)$ tensor: the one term of a layer's
# activations that grows with the square of the sequence length. Korthikanti et al. (2022) count a
# layer as $s b h\,(34 + 5 a s / h)$ bytes (16-bit activations, 1-byte dropout masks): the $5 a s^2 b$
# part is that softmax output (2 bytes), its dropout mask (1) and the dropped output (2). Selective
# recomputation drops exactly those and rebuilds them from the kept $q$ and $k$ in the backward, for the
# price of one $q k^\top$ matmul per layer (a few % of the FLOPs).
#
# This lesson measures one forward + backward of the `small` model at several $T$ under `none`,
# `selective` and `full`, and fits $\text{bytes} = a + b\,T + c\,T^2$ to what it measured, with $c$
# counted in "T×T tensors" (one layer's $B \cdot H \cdot T^2$ probabilities).
#
# **Run it** as a script, `python lessons/06_selective_and_sequence_length.py` (the CPU run, well under a
# minute; `--fast` for seconds, `--large --device cuda` for a bigger shape on a GPU), or step through
# this notebook, where the same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset:
# the CPU run).

# %%
import matplotlib.pyplot as plt
import numpy as np

from _check import check
from _lesson import choose, large, lesson_args, shape_line, small, wrote
from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import layer_inventory, predicted_peak_bytes, step_flops, total
from picockpt.measurement.measure import make_batch
from picockpt.teaching.plotting import mib, policy_color, save_figure
from picockpt.measurement.tracker import Tracker

POLICIES = ("none", "selective", "full")
SQUARE = ("attn.probs", "attn.probs_mask", "attn.probs_dropped")  # the (B, H, T, T) names

# %% [markdown]
# ## Measuring against T, and the T² coefficient
#
# `measure` runs one step per $(T, \text{policy})$ and keeps both peaks: *stored* (the activation
# store, the logical view) and *live* (every tensor alive, the physical view). `square_term` fits a
# parabola and returns its $T^2$ coefficient in units of one layer's probabilities.

# %%
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


# %%
args = lesson_args()
cfg, batch, seqs = shape(args.mode)
cfg = cfg.replace(max_seq=max(cfg.max_seq, max(seqs)))
print(f"lesson 06, sequence lengths {seqs}: {shape_line(cfg, batch, 'T', args.device)}")
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

# %% [markdown]
# What the fits say:
#
# * **stored**: `none` holds $c = L$, one T×T tensor per layer; `selective` $c = 0$, linear in $T$;
#   `full` $c = 1$, the one layer being recomputed holds its T×T tensor again. These are exact counts,
#   and every point equals the exact formula, `predicted_peak_bytes`.
# * **live**: the $T^2$ term does not vanish, it moves. The backward of one attention layer holds,
#   beside the probabilities (stored, or rebuilt by selective), working T×T tensors: the gradient of
#   the probabilities $dP$ and the softmax's gradient $dS = P \circ (dP - \mathrm{rowsum}(dP \circ P))$
#   (one fused kernel, as autograd's: no other T×T temporary), two of them at once. The $s^2$ term goes from "times $L$, for the whole step" to "one layer, for
#   the moment of its backward". (FlashAttention removes even that by never materialising T×T: lesson
#   09.) The live $c$ are fits, not counts, and depend on the range of $T$: the live peak is the larger
#   of that $T^2$ moment and other moments of the step whose working memory grows only with $T$, which
#   win at short $T$. The CPU run ($T$ = 64..512, $L$ = 8) fits $c$ = 9.75 (`none`), 3.29 (`selective`),
#   2.75 (`full`); over $T$ = 384..768 the same fit gives 10.0, 3.0, 3.0, that is $L + 2$, $1 + 2$ and
#   $1 + 2$: the stored or rebuilt probabilities plus two working tensors.
#
# ## The price
#
# Selective rebuilds one $q k^\top$ per layer. A recompute bill is quoted two ways: as a share of the
# step's FLOPs, or of the layers' forward (what full recomputation would rerun: the convention of
# Korthikanti et al.'s 2.7% for GPT-3).

# %%
flops = step_flops(cfg, batch, seqs[-1], "selective")
rebuild = flops["recompute"] / (flops["forward"] + flops["backward"])
layers_forward = flops["forward"] - 2 * batch * seqs[-1] * cfg.hidden * cfg.vocab  # the forward minus the LM head
print(f"selective's price at T={seqs[-1]}: {flops['recompute'] / 1e9:.3f} GFLOP of q·k^T rebuilt, "
      f"{rebuild:.1%} of the step's FLOPs without recomputation, {flops['recompute'] / layers_forward:.1%} of the "
      f"layers' forward")
per_element = korthikanti_check(cfg, batch, seqs[0])
print(f"in 16-bit with dropout, one layer's T×T tensors take {per_element:g} bytes per B·H·T² element "
      f"(probabilities 2 + mask 1 + dropped 2): Korthikanti's 5·a·s²·b, exactly")

# %% [markdown]
# ## The figure
#
# Left, stored bytes against $T$: lines are the exact formula, dots the measurements. Right, live bytes
# (dotted: stored again, for comparison): the gap between the two is working memory, and its $T^2$ part
# is what is left of the square term once the probabilities are not stored.

# %%
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
path = save_figure(fig, "06_selective_and_sequence_length")
wrote(path)

# %% [markdown]
# ## Exercises
#
# **1.** In 16-bit with dropout, how many bytes does one layer keep per element of its $B \cdot H \cdot T^2$
# attention core (the probabilities, their dropout mask and the dropped probabilities)?

# %%
answer = 5  # bytes per element

# %%
check("bytes per B·H·T² element of a layer's T×T tensors, 16-bit with dropout", answer,
      korthikanti_check(small(), 1, 64), rel=0,
      why="attn.probs 2 + attn.probs_mask 1 (bool) + attn.probs_dropped 2, from layer_inventory: "
          "Korthikanti's 5·a·s²·b")

# %% [markdown]
# **2.** For a Llama 3 8B layer in bf16 (no dropout, $b = 1$), the probabilities take $2 a s^2$ bytes and
# everything else in the layer grows linearly in $s$. At which sequence length $s$ do the probabilities
# take as many bytes as the rest of the layer? (Everything else is about $34 s h$ bytes here.)

# %%
answer = 2176  # tokens

# %%
llama8 = Config.from_preset("llama3-8b", dtype="bf16")
inventory = layer_inventory(llama8, 1, 4096)
rest_per_token = (total(inventory) - inventory["attn.probs"][2]) / 4096
check("the sequence length where a Llama 3 8B layer's probabilities equal the rest of it", answer,
      rest_per_token / (2 * llama8.heads),
      why=f"the rest is {rest_per_token:,.0f} bytes per token (34h + 8 = {34 * llama8.hidden + 8:,}); "
          f"2·a·s² = s·{rest_per_token:,.0f} at s = {rest_per_token:,.0f} / (2·{llama8.heads})")

# %% [markdown]
# **3.** Under `full`, how many T×T tensors does the store hold at its peak, whatever $L$ is? (Fit the
# closed form over a few $T$, or think about which layer is whole at the peak.)

# %%
answer = 1

# %%
over = [128, 256, 384, 512]
stored_full = [predicted_peak_bytes(small(), 2, T, "full") for T in over]
check("T×T tensors stored at full's peak", answer, square_term(over, stored_full, 2 * small().heads * 4),
      rel=0.001, why="the last layer's backward brings that one layer back whole, probabilities included, beside "
                     "L - 1 checkpoints that have no T² term: the fit of predicted_peak_bytes over T = "
                     f"{over[0]}..{over[-1]} gives {square_term(over, stored_full, 2 * small().heads * 4):g}")

# %%
T = seqs[-1]
RESULT = {"figures": [str(path)],
          "summary": {f"stored MiB none/selective at T={T}": f"{mib(peaks['none', T][0]):.1f}/"
                                                             f"{mib(peaks['selective', T][0]):.1f}",
                      "T² tensors stored none/selective": f"{fits['none'][0]:.2f}/{fits['selective'][0]:.2f}",
                      "T² tensors live none/selective": f"{fits['none'][1]:.2f}/{fits['selective'][1]:.2f}",
                      "stored = formula": all(peaks[k][0] == predicted[k] for k in predicted)}}

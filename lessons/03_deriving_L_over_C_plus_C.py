# %% [markdown]
# # Lesson 03, derived: $O(L/C + C)$, or where to put the checkpoints
#
# Chen et al. 2016, *Training Deep Nets with Sublinear Memory Cost*, keep the input of every $C$-th
# layer (a **checkpoint**: in picockpt always a stored activation, never a saved model file) and
# nothing else. The backward pass then walks the segments from the last to the first: it recomputes
# the $C$ layers of a segment from their checkpoint, runs their backward, and drops them. This is
# picockpt's policy `every:C` (`full` is `every:1`).
#
# Memory now has two parts that pull in opposite directions: the checkpoints, about $L/C$ of them,
# and the one segment whose $C$ layers are back in memory at a time. This notebook writes the peak
# as a function of $L$ and $C$ **from picockpt's own inventory**, minimises it, and then measures every
# $C$ with the engine and puts formula and measurement on one plot.
#
# **Run it** in Jupyter, or as a script: `python lessons/03_deriving_L_over_C_plus_C.py`. Everything here
# runs in seconds on one CPU core, so `--fast` and `--large` change nothing but where the figures go
# (`--fast`: `out/figures/`).

# %%
import math

import matplotlib.pyplot as plt
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from _check import check
from _lesson import lesson_args
from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.published import chen_memory, chen_optimum, exact_segment_curve
from picockpt.planning.step_forms import chain_sizes, head_inventory, layer_inventory, step_flops
from picockpt.measurement.measure import make_batch
from picockpt.teaching.plotting import save_figure
from picockpt.recompute.policy import OP_LEVEL
from picockpt.recompute.store import format_inventory
from picockpt.measurement.tracker import Tracker

args = lesson_args()  # the device and threads (one: tiny tensors gain nothing from more); shapes are fixed

# A deep model of tiny width: 128 layers, so that the U has room to show; one step takes ~0.1 s.
cfg = Config(vocab=32, hidden=16, layers=128, heads=2, kv_heads=1, ffn=16, max_seq=16)
B, T, L = 1, 8, cfg.layers
X, A, F = chain_sizes(cfg, B, T)  # one checkpoint, one fully stored layer, the head (final norm, logits)
print(format_inventory(layer_inventory(cfg, B, T), "one stored layer (fp32):"))
print()
print(format_inventory(head_inventory(cfg, B, T), "the head, stored once:"))
print(f"\nX = {X} bytes (a checkpoint: the layer input B*T*h*4)   A = {A} bytes (a whole layer)   "
      f"F = {F} bytes   A/X = {A / X:.3f}")

# %% [markdown]
# ## The peak, read off the store's timeline
#
# Write $X$ for the bytes of one checkpoint (a layer input, $B\,T\,h$ elements), $A$ for the bytes of
# one fully stored layer (the table above: the input itself plus everything its backward needs), and
# $F$ for the head (final norm input, its statistic and output, and the logits). With segments of $C$
# layers there are $n = \lceil L/C \rceil$ segments; segment $k$ (counting from $0$) holds $n_k$ layers,
# $C$ for all but perhaps the last.
#
# * **End of the forward.** The store holds the $n$ checkpoints and the head: $nX + F$.
# * **Backward of segment $k$.** The head is gone, segments above $k$ are done; the store holds the
#   checkpoints of segments $0..k-1$ and the $n_k$ recomputed layers of segment $k$, whose first layer's
#   input *is* segment $k$'s checkpoint (it is inside $A$): $kX + n_k A$.
#
# So picockpt's exact peak (`inventory.predicted_peak_bytes`) is
#
# $$P(C) = \max\Big(nX + F,\; \max_{k<n}\,(kX + n_kA)\Big),\qquad n = \lceil L/C\rceil .$$
#
# When $C$ divides $L$ every $n_k = C$ and the largest $k$ wins:
# $P(C) = \max\big(\tfrac{L}{C}X + F,\; (\tfrac{L}{C}-1)X + CA\big)$.
# The second term wins as soon as $CA > X + F$ (here already at $C = 1$, since $A > X + F$).
# Drop the constant $-X$ and you have Chen's formula with $x = X$:
#
# $$M(C) = \frac{L}{C}\,x + C\,A .$$
#
# **Minimise.** $\dfrac{dM}{dC} = -\dfrac{Lx}{C^2} + A = 0$ gives
#
# $$C^* = \sqrt{\frac{L\,x}{A}},\qquad M(C^*) = 2\sqrt{L\,x\,A}.$$
#
# * **Equal layers** ($x = A$, Chen's first setting, where a layer's activations are no bigger than
#   its input): $C^* = \sqrt L$ and $M = 2\sqrt L\,A$, that is $O(\sqrt L)$ instead of the $O(L)$ of
#   storing everything, for one extra forward.
# * **A transformer layer** keeps much more than its input ($A/x \approx 11$ here, $\approx 21.5$ in the
#   `small` preset, $49$ for Llama 3 8B at 4096 tokens), so $C^*$ is $\sqrt{A/x}$ times smaller than
#   $\sqrt L$.

# %%
def peak(L, C, X, A, F):
    """P(C) as derived above: max(nX + F, max over segments k of kX + n_k A)."""
    sizes = [min(C, L - start) for start in range(0, L, C)]  # n_k, the layers of segment k
    return max(len(sizes) * X + F, max(k * X + n_k * A for k, n_k in enumerate(sizes)))


exact = exact_segment_curve(cfg, B, T)                    # {C: P(C)} from picockpt's closed form, C = 1..L
assert exact == {C: peak(L, C, X, A, F) for C in range(1, L + 1)}  # the derivation is the code's formula
best_exact = min(exact, key=exact.get)
c_star = chen_optimum(L, X, A)
print(f"Chen: C* = sqrt(L X / A) = sqrt({L} * {X} / {A}) = {c_star:.3f}   "
      f"(sqrt(L) = {math.sqrt(L):.2f} would be the optimum for equal layers)")
print(f"exact: the minimum of P(C) over whole C is at C = {best_exact}: {exact[best_exact]:,} bytes")
print(f"storing every layer: L*A + F = {L * A + F:,} bytes;  full (C=1): {exact[1]:,};  "
      f"Chen's 2*sqrt(L X A) = {2 * math.sqrt(L * X * A):,.0f}")
print("\n  C   exact P(C)   Chen (L/C)X + CA")
for C in range(1, 9):
    print(f"{C:3d} {exact[C]:12,} {chen_memory(L, C, X, A):18,.0f}")

# %% [markdown]
# ## Measure it
#
# One training step per $C$, with the tracker watching only the store (its *logical* view, exact on any
# device). Every $C$ from 1 to 24, then every 8th up to $L$: a few seconds on one CPU core (at `--fast`,
# 1 to 8 and a few beyond). Each measurement must equal the closed form to the byte.

# %%
params = init_params(cfg, seed=0)
input_ids, targets = make_batch(cfg, B, T, "cpu", seed=0)
measured = {}
every_c = list(range(1, 9)) + [16, 64, L] if args.mode == "fast" else list(range(1, 25)) + list(range(32, L + 1, 8))
for C in every_c:
    with Tracker("cpu", physical=False, flops=False) as tracker:
        loss_and_grads(params, cfg, input_ids, targets, f"every:{C}", tracker=tracker)
    measured[C] = tracker.peak_logical
mismatches = {C: (peak, exact[C]) for C, peak in measured.items() if peak != exact[C]}
assert not mismatches, mismatches
best_measured = min(measured, key=measured.get)
assert best_measured == best_exact
print(f"{len(measured)} values of C measured; every one equals the exact formula to the byte.")
print(f"measured minimum at C = {best_measured} ({measured[best_measured]:,} bytes); "
      f"exact formula: C = {best_exact}; Chen's continuous optimum: {c_star:.2f}")

# %%
Cs = list(range(1, L + 1))
kib = lambda n: n / 1024
fig, (wide, zoom, teeth) = plt.subplots(1, 3, figsize=(17, 4.4))
for ax, last in ((wide, L), (zoom, 12)):
    shown = [C for C in Cs if C <= last]
    ax.plot(shown, [kib(chen_memory(L, C, X, A)) for C in shown], "--", color="#8172B3",
            label=r"Chen: $(L/C)\,X + C\,A$ (continuous C)")
    ax.plot(shown, [kib(exact[C]) for C in shown], "-", color="#2F4858", lw=1.0,
            label=r"exact: $\max(nX+F,\ \max_k\,kX + n_kA)$")
    got = [C for C in measured if C <= last]
    ax.plot(got, [kib(measured[C]) for C in got], "o", ms=4.5, mfc="none", color="#C44E52",
            label="measured by the tracker")
    ax.axvline(c_star, color="#8172B3", lw=0.8)
    ax.axvline(best_exact, color="#2F4858", lw=0.8, ls=":")
    ax.set_xlabel("C, layers per segment (every:C)")
    ax.set_ylabel("peak stored activations (KiB)")
wide.set(xscale="log", yscale="log", title=f"L = {L} layers, h = {cfg.hidden}, A/X = {A / X:.2f} (log-log)")
for axis in (wide.xaxis, wide.yaxis):  # plain numbers at 1, 2, 5, 10, ...; minor ticks unlabelled
    axis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    axis.set_major_formatter(FormatStrFormatter("%g"))
    axis.set_minor_formatter(NullFormatter())
zoom.set_title(f"near the minimum: measured and exact at C = {best_exact}; Chen's C* = {c_star:.2f}", fontsize=10)
zoom.set_ylim(0, kib(exact[1]) * 1.3)
zoom.legend(loc="upper center", fontsize=8)

# where the two curves differ: exact minus Chen, in checkpoints (units of X)
gap = {C: (exact[C] - chen_memory(L, C, X, A)) / X for C in Cs}
divides = [C for C in Cs if L % C == 0]
teeth.plot(Cs, [gap[C] for C in Cs], ".-", ms=3, color="#2F4858", lw=0.6, label=r"$(P(C) - M(C))\,/\,X$")
teeth.plot(divides, [gap[C] for C in divides], "o", ms=5, color="#C44E52", label="C divides L")
teeth.set(xscale="log", xlabel="C, layers per segment (every:C)", ylabel="exact minus Chen (checkpoints of X bytes)",
          title="the teeth: where C does not divide L", ylim=(-2.2, -0.6))
teeth.xaxis.set_major_formatter(FormatStrFormatter("%g"))
teeth.legend(loc="upper right", fontsize=8)
plt.tight_layout()
u_curve = save_figure(fig, "03_u_curve")

assert all(abs(gap[C] + 1) < 1e-9 for C in divides)                    # exactly one checkpoint below Chen
assert all(-2 < gap[C] < -1 for C in Cs if C not in divides)           # between one and two below
# from one C to the next: P(C) = (n - 2 + [C divides L]) X + C A, with n = ceil(L/C)
n, divisor = (lambda C: math.ceil(L / C)), (lambda C: int(L % C == 0))
steps = {C: exact[C + 1] - exact[C] for C in range(1, L)}
assert all(steps[C] == A - (n(C) - n(C + 1) - divisor(C + 1) + divisor(C)) * X for C in steps)
beyond = [C for C in steps if C > math.isqrt(L)]  # where n drops by at most one per step
print(f"exact - Chen = -X at the {len(divides)} divisors of L, between -2X and -X elsewhere "
      f"(X = {X} bytes = A/{A / X:.1f}).")
print(f"for C > sqrt(L): P(C+1) - P(C) = A ({A:,} bytes) {sum(steps[C] == A for C in beyond)} times, "
      f"A - X ({A - X:,} bytes) {sum(steps[C] == A - X for C in beyond)} times, of {len(beyond)}: "
      f"the teeth are one checkpoint deep")

# %% [markdown]
# ### Reading the plot: every difference explained
#
# * **Measured vs exact: none.** The red points sit on the dark step line at every measured $C$, to the
#   byte (the assertion above). The tracker's logical peak and `predicted_peak_bytes` are two
#   independent routes to the same number: one counts the storages the engine put in the store, the
#   other multiplies shapes.
# * **Exact vs Chen, a constant below.** Chen's $(L/C)X$ counts the checkpoint of the segment being
#   recomputed, which the exact formula counts inside $A$: where $C$ divides $L$ the exact curve is
#   Chen's minus exactly $X$. A constant does not move the minimum.
# * **Exact vs Chen, the teeth.** When $C$ does not divide $L$ the last segment is short, and the peak
#   comes from the last *full* segment, $k = n-2$: $P(C) = (n-2)X + CA$ with $n = \lceil L/C\rceil$. So
#   $P(C) - M(C) = (\lceil L/C\rceil - L/C - 2)\,X$, between $-2X$ and $-X$, and exactly $-X$ where $C$
#   divides $L$. The teeth are one checkpoint deep ($X = A/11$ here): beyond $C = \sqrt L$, where
#   $n$ drops by at most one from $C$ to $C + 1$, the exact peak grows by $A$ or by $A - X$ (printed
#   above), where Chen's smooth curve grows by $A - LX/(C(C+1))$. On the two left plots that is
#   invisible; the right panel plots the difference in units of $X$, where the teeth are.
# * **The head $F$** only counts at the end of the forward, $nX + F$, which beats the backward's
#   $(n-1)X + CA$ only when $X + F > CA$: at small $C$, with a head bigger than a layer (a large
#   vocabulary beside small layers). Here, and for Llama 3 8B at 4096 tokens with its probabilities
#   stored, $A > X + F$, so the backward term is the peak at every $C$. Llama 3 8B and 70B
#   without stored probabilities are the other case (below), and there the head changes the best $C$.
# * **Whole layers.** $C$ is an integer; the exact minimum is at $\lfloor C^*\rfloor$ or
#   $\lceil C^*\rceil$, whichever is lower: here $C^* = 3.39$ and the minimum is at $C = 3$.
#
# ### How the best $C$ grows with depth
#
# The closed form is exact (it just matched every measurement), so it can answer for any depth without
# running: the optimum follows $\sqrt{L\,X/A}$, far below the $\sqrt L$ of equal layers, and the best
# peak grows like $\sqrt L$ while storing everything grows like $L$.

# %%
depths = [2 ** k for k in range(2, 12)]
best_C, best_peak = [], []
for depth in depths:
    curve = {C: peak(depth, C, X, A, F) for C in range(1, depth + 1)}  # the same layers, `depth` of them
    C = min(curve, key=curve.get)
    best_C.append(C)
    best_peak.append(curve[C])
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
left.plot(depths, best_C, "o-", color="#2F4858", label="exact minimum of P(C)")
left.plot(depths, [math.sqrt(d * X / A) for d in depths], "--", color="#8172B3", label=r"$\sqrt{L\,X/A}$")
left.plot(depths, [math.sqrt(d) for d in depths], ":", color="#999999", label=r"$\sqrt{L}$ (equal layers)")
left.set(xscale="log", yscale="log", xlabel="L, layers", ylabel="best C")
left.legend()
right.plot(depths, [kib(d * A + F) for d in depths], "-", color="#333333", label="store everything: L A + F")
right.plot(depths, [kib(p) for p in best_peak], "o-", color="#2F4858", label="every:C*, exact")
right.plot(depths, [kib(2 * math.sqrt(d * X * A)) for d in depths], "--", color="#8172B3",
           label=r"Chen: $2\sqrt{L\,X\,A}$")
right.set(xscale="log", yscale="log", xlabel="L, layers", ylabel="peak stored activations (KiB)")
right.legend()
plt.tight_layout()
best_segment = save_figure(fig, "03_best_segment_vs_depth")
for depth, C in zip(depths, best_C):
    print(f"L = {depth:5d}: best C = {C:3d}   sqrt(L X / A) = {math.sqrt(depth * X / A):6.2f}")

# %% [markdown]
# ## The price does not depend on $C$
#
# Under `every:C` the backward recomputes every layer exactly once, whatever $C$ is: each segment is
# rebuilt from its checkpoint once. So the recompute bill is one forward pass of the layers (the head is
# not recomputed), $\approx +33\%$ of a step's FLOPs because the backward costs twice the forward. The
# FLOP counter agrees for any $C$ (on a 16-layer copy of the model):

# %%
shallow = cfg.replace(layers=16)  # the same layers, fewer of them: counting FLOPs op by op is slow
shallow_params = init_params(shallow, seed=0)
for C in (1, 3, 8, 16):
    with Tracker("cpu", physical=False) as tracker:
        loss_and_grads(shallow_params, shallow, input_ids, targets, f"every:{C}", tracker=tracker)
    flops = tracker.flops
    assert flops["recompute"] == step_flops(shallow, B, T, f"every:{C}")["recompute"]
    share = flops["recompute"] / (flops["forward"] + flops["backward"])
    print(f"every:{C:<4d} forward {flops['forward']:>9,}  recompute {flops['recompute']:>9,} "
          f"({flops['recompute'] / flops['forward']:.2%} of the forward)  backward {flops['backward']:>9,}"
          f"  -> +{share:.2%} of the step")
head = flops["forward"] - flops["recompute"]
assert head == 2 * B * T * shallow.hidden * shallow.vocab  # the logits matmul
print(f"forward - recompute = {head:,} FLOPs = 2*B*T*h*V, the LM head's matmul, never recomputed")

# %% [markdown]
# The recompute falls short of a whole forward by exactly the head: the final norm and the logits
# (printed above) are computed once and never recomputed, so the step costs a little less than the
# $+33.3\%$ of one extra forward. The backward is exactly twice the forward (each matmul $y = ab$ needs
# $da = dy\,b^T$ and $db = a^T dy$).
#
# ## What this means for a real transformer: when does $C > 1$ pay?
#
# Because memory is the only thing $C$ trades, pick the $C$ that minimises $P(C)$. Does that ever leave
# $C = 1$ (`full`, what frameworks do by default)? With $C$ dividing $L$,
#
# $$P(C) = \max\Big(\tfrac{L}{C}X + F,\ \big(\tfrac{L}{C} - 1\big)X + CA\Big), \qquad P(1) = \max\big(LX + F,\ (L-1)X + A\big).$$
#
# For $C > 1$ the first term is below $LX + F \le P(1)$, so `every:C` beats `full` exactly when its
# segment term does:
#
# $$\Big(\frac{L}{C} - 1\Big)X + CA \;<\; \max\big(LX + F,\ (L-1)X + A\big).$$
#
# * **The backward sets full's peak** ($A > X + F$). Then the condition is $(C-1)A < (C-1)\tfrac{L}{C}X$,
#   that is $A/X < L/C$: the checkpoints saved, $L(1 - 1/C)$ of them, against the $C - 1$ extra layers
#   held. This is Chen's trade; $C^* = \sqrt{LX/A}$ is its continuous form.
# * **The head sets full's peak** ($X + F > A$). Then `full` peaks at the end of the forward, $L$
#   checkpoints beside the logits, and fewer checkpoints lower that directly: the condition is
#   $CA < (L - L/C + 1)X + F$, which can hold with $A/X > L/C$, where Chen's formula (it has no head)
#   says $C = 1$.
#
# The three sizes for Llama 3's true shapes (bf16 activations, fp32 norm statistics, bf16 logits of the
# 128256-word vocabulary in $F$, one sequence of 4096 tokens, no dropout), with the attention
# probabilities stored (`every:C`) and not stored (`every:C+selective`; FlashAttention does not store
# them either), all from `predicted_peak_bytes`; the code checks the criterion against the exact curve
# at every $C$ that divides $L$:

# %%
def segment_pays(L, C, X, A, F):
    """The criterion, for C dividing L: every:C's segment term against full's peak."""
    return (L // C - 1) * X + C * A < max(L * X + F, (L - 1) * X + A)

cases = [("small (fp32)", Config.from_preset("small"), 4, 128)] + [
    (f"{name} (bf16)", Config.from_preset(name, dtype="bf16"), 1, 4096)
    for name in ("llama3-8b", "llama3-70b", "llama3-405b")]
print(f"{'model':<19}{'probabilities':<15}{'L':>4}{'A/X':>7}{'F/X':>7}  {'full peaks at':<14}{'L/2':>5}"
      f"{'best C':>7}{'full GiB':>10}{'best GiB':>10}{'best vs full':>14}{'full vs best':>14}")
for name, shape, batch, seq in cases:
    for op_level in (None, "selective"):
        x, a, f = chain_sizes(shape, batch, seq, OP_LEVEL.get(op_level, frozenset()))
        curve = exact_segment_curve(shape, batch, seq, op_level)
        L_ = shape.layers
        for C in (C for C in curve if L_ % C == 0 and C > 1):  # the criterion, checked against the closed form
            assert segment_pays(L_, C, x, a, f) == (curve[C] < curve[1]), (name, op_level, C)
        C = min(curve, key=curve.get)
        print(f"{name:<19}{'not stored' if op_level else 'stored':<15}{L_:>4}{a / x:>7.2f}{f / x:>7.2f}  "
              f"{'backward' if a > x + f else 'head (forward)':<14}{L_ / 2:>5.0f}{C:>7}{curve[1] / 2**30:>10.3f}"
              f"{curve[C] / 2**30:>10.3f}{curve[C] / curve[1] - 1:>14.1%}{curve[1] / curve[C] - 1:>+14.1%}")
eight = Config.from_preset("llama3-8b", dtype="bf16")
x, a, f = chain_sizes(eight, 1, 4096, OP_LEVEL["selective"])
print(f"\nllama3-8b without stored probabilities: Chen's C* = sqrt(L X / A) = {chen_optimum(32, x, a):.2f}, "
      f"and Chen's M(2) = {chen_memory(32, 2, x, a) / x:.1f} X > M(1) = {chen_memory(32, 1, x, a) / x:.1f} X; "
      f"the exact P(2) = {exact_segment_curve(eight, 1, 4096, 'selective')[2] / x:.1f} X < P(1) = "
      f"{exact_segment_curve(eight, 1, 4096, 'selective')[1] / x:.1f} X: the head decides")

# %% [markdown]
# Reading the table:
#
# * **Probabilities stored, 8B and 70B**: $A/X \approx 49$, far above $L/2$, and the backward sets
#   `full`'s peak: $C = 1$ is best, as frameworks default (Megatron-LM's `--recompute-granularity full`,
#   `torch.utils.checkpoint` per block).
# * **Probabilities stored, 405B**: $A/X = 47.9$ is below $L/2 = 63$ (126 layers): `every:2` needs 8.7%
#   less than `full` (`full` needs 9.6% more). Chen's $\sqrt{LX/A} = 1.6$ agrees.
# * **Probabilities not stored** (selective, or FlashAttention): $A/X$ drops to about 16–17 while the head
#   stays ($F/X = 33$ for 8B, 18 for 70B, 10 for 405B: $2sV$ bytes of bf16 logits against $2sh$ per
#   checkpoint). For 8B and 70B the head now sets `full`'s peak, and `every:2` is 24.5% and 25.8% below
#   `full+selective`; Chen's formula, which has no head, would keep $C = 1$ for 8B. For 405B the backward
#   still sets it, and with $A/X = 15.9 < L/3 = 42$ `every:3` is 37.1% below.
# * **`small`** ($A/X = 21.5$ stored, $L = 8$): $C = 1$; without stored probabilities the head of its
#   small vocabulary still does not make $C = 2$ pay.
#
# So the best segment is a single layer only when a layer's stored activations dwarf the checkpoints they
# would save and the head is small; otherwise count: the closed form costs nothing to evaluate.
# Anything that shrinks $F$ (a loss computed in chunks never holds all the logits) moves the head cases
# back towards $C = 1$. $\sqrt L$-spaced checkpoints in Chen's sense pay off when layers are cheap to store
# relative to their input (Chen's deep ResNets: 1000 layers, 48 GB $\to$ 7 GB).
#
# **Summary.** From the inventory: $P(C) = \max(nX+F, \max_k kX + n_kA)$, which is Chen's
# $(L/C)x + CA$ less one checkpoint (less two, in the teeth where $C$ does not divide $L$); its minimum
# over real $C$ is $\sqrt{L\,x/A}$ ($\sqrt L$ for equal layers). Measured on a 128-layer model, the store's
# peak equals the exact formula at every $C$, and its minimum is at $C = 3$, next to Chen's $3.39$.
# `every:C` beats `full` exactly when $(L/C - 1)X + CA < \max(LX + F, (L-1)X + A)$: for Llama 3 at 4096
# tokens that is 405B (by 8.7%), and every size once the probabilities are not stored (by 24.5%, 25.8%
# and 37.1%).

# %% [markdown]
# ## Exercises
#
# **1. The teeth.** For the 128-layer model above and $C = 5$ (which does not divide 128), how far is the
# exact peak $P(C)$ below Chen's $M(C) = (L/C) X + C A$, in checkpoints of $X$ bytes? (Use the formula
# for the teeth: the peak comes from the last full segment.)

# %%
answer = -1.6  # checkpoints (negative: below Chen's curve)

# %%
check("(P(5) - M(5)) / X for L = 128", answer, (exact[5] - chen_memory(L, 5, X, A)) / X,
      why=f"(ceil(L/C) - L/C - 2)·X with L/C = {L / 5}: {math.ceil(L / 5)} - {L / 5} - 2 = "
          f"{math.ceil(L / 5) - L / 5 - 2:.1f}; exact {exact[5]:,} bytes, Chen {chen_memory(L, 5, X, A):,.0f}")

# %% [markdown]
# **2.** The same tiny layers, 512 of them. Chen's $\sqrt{L X / A}$ says about 6.8: which whole $C$ is
# best by the exact formula?

# %%
answer = 7

# %%
curve512 = exact_segment_curve(cfg.replace(layers=512), B, T)
check("the best C for 512 of these layers", answer, min(curve512, key=curve512.get), rel=0,
      why=f"sqrt(L·X/A) = sqrt(512·{X}/{A}) = {chen_optimum(512, X, A):.2f}; exact peaks at C = 6, 7, 8: "
          + ", ".join(f"{curve512[C]:,}" for C in (6, 7, 8)) + " bytes")

# %% [markdown]
# **3.** Llama 3 405B with `selective` (the probabilities not stored), bf16, now at $s = 8192$: which $C$
# of `every:C+selective` gives the least peak? Every size in the table doubles with $s$ once the $s^2$ term
# is gone, so think about which ratios decide it.

# %%
answer = 3

# %%
llama405 = Config.from_preset("llama3-405b", dtype="bf16")
curve405 = exact_segment_curve(llama405, 1, 8192, "selective")
x405, a405, f405 = chain_sizes(llama405, 1, 8192, OP_LEVEL["selective"])
check("the best C of every:C+selective for Llama 3 405B at s = 8192", answer, min(curve405, key=curve405.get),
      rel=0, why=f"A/X = {a405 / x405:.2f} and F/X = {f405 / x405:.2f} do not depend on s without the s² term: the "
                 f"same answer as at s = 4096. Chen: sqrt(L·X/A) = {chen_optimum(126, x405, a405):.2f}; exact "
                 f"{curve405[3] / 2**30:.2f} GiB at C = 3 against {curve405[1] / 2**30:.2f} GiB at C = 1")

# %%
RESULT = {"figures": [str(u_curve), str(best_segment)],
          "summary": {"values of C measured": len(measured), "measured = formula": not mismatches,
                      "best C measured": best_measured, "Chen's C*": round(c_star, 2)}}

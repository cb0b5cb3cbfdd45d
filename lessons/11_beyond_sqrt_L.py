# %% [markdown]
# # Lesson 11, beyond √L: recursive and binomial checkpointing
#
# Chen et al. (2016, *Training Deep Nets with Sublinear Memory Cost*) made $\sqrt{L}$ famous: with $L$ equal layers and a checkpoint every $C$ layers, the backward holds $L/C$ checkpoints plus the $C$ layers of the segment it is working on, which is least at $C = \sqrt{L}$, for the price of one extra forward. This notebook asks what lies beyond:
#
# (Notation: $c$ counts checkpoint **slots** and $r$ the **repetitions**, the most times any step is
# advanced, where Griewank & Walther write $s$ and $t$; here $s$ and $t$ stay the sequence length and the
# tensor-parallel size of the other lessons, and $C$ the layers per segment of `every:C`.)
#
# 1. **recursion**: checkpoints inside segments inside segments bring memory down to $\log_2 L$ states for $\tfrac{L}{2}\log_2 L$ recomputed steps;
# 2. **the exact optimum** between these extremes: Griewank & Walther's *binomial checkpointing* (the `revolve` algorithm, 2000), computed by the planner's uniform chain (`picockpt/planning/planner_uniform.py`) and checked against their closed form;
# 3. what $\sqrt{L}$ is, seen from there, said honestly;
# 4. and how picockpt's own planner (`picockpt/planning/planner.py`, rotor's dynamic programme, Beaumont et al. 2019) generalises all of it to layers whose stored activations are much bigger than their input.
#
# Everything here runs on the CPU in seconds. "Checkpoint" means a stored activation (a state), never a saved model file.
#
# **Run it** in Jupyter, or as a script: `python lessons/11_beyond_sqrt_L.py`; `--fast` and `--large`
# change nothing here but where the figure goes (`--fast`: `out/figures/`).

# %%
import math
import time

import matplotlib.pyplot as plt
import numpy as np

from _check import check
from _lesson import lesson_args
from picockpt.planning.planner_uniform import binomial_forward_steps, forward_steps_table, plan_uniform
from picockpt.teaching.plotting import save_figure

args = lesson_args()  # threads and where the figure goes; the chains here are fixed

# %% [markdown]
# ## The uniform chain, and how revolve counts
#
# A chain of $l$ equal steps $x_0 \to x_1 \to \dots \to x_l$. Reversing step $i$ (running its backward) needs its input $x_i$ and nothing else. There are $c$ **slots**, each holding one state; $x_0$ sits in one of them from the start. Following Griewank & Walther, three things are free: the state *in hand* (the one just computed), the one step being reversed and its *record* (its activations, made by one recording forward right before its backward). The cost is the number of **forward steps** (advances), not counting that recording forward.
#
# So with $c \ge l$ slots the first sweep stores every state on the way and costs $l - 1$ advances ($x_{l-1}$ is reached in hand and reversed at once); with one slot every step is reached again from $x_0$: $(l-1) + (l-2) + \dots + 1 = l(l-1)/2$.
#
# The least cost $P(n, c)$ of reversing $n$ steps whose input is stored, with $c$ slots in all, follows from the first decision: advance $k$ steps, reverse the upper $n-k$ steps from $x_k$ (in a new slot, unless it is a single step, reversed from hand), then reverse the lower $k$ steps from the input again:
#
# $$P(1, c) = 0, \qquad P(n, c) = \min_{1 \le k < n} \Big[\, k + Q(n-k,\, c-1) + P(k,\, c) \,\Big], \qquad Q(1, \cdot) = 0,\ \ Q(n', c') = P(n', c').$$
#
# `forward_steps_table(l, c)` fills this table with numpy; `plan_uniform(l, c)` unrolls the decisions into actions.

# %% [markdown]
# ## Recursion: $\log_2 L$ memory for $\tfrac{L}{2}\log_2 L$ compute
#
# Apply the checkpoint idea inside itself by bisection: store the midpoint, reverse the upper half the same way, then the lower half from $x_0$. With $W(l)$ the advances (the work) and $M(l)$ the slots,
#
# $$W(l) = \frac{l}{2} + 2\,W\!\left(\frac{l}{2}\right),\ W(1) = 0 \;\Longrightarrow\; W(l) = \frac{l}{2}\log_2 l, \qquad M(l) = 1 + M\!\left(\frac{l}{2}\right),\ M(2) = 1 \;\Longrightarrow\; M(l) = \log_2 l.$$
#
# Memory logarithmic, compute $O(l \log l)$: each step is advanced about $\log_2 l$ times (Griewank 1992, *Achieving logarithmic growth of temporal and spatial complexity in reverse automatic differentiation*). Bisection is not the optimum for those slots, though; the table says by how much.

# %%
def bisection(l):
    return 0 if l == 1 else l // 2 + 2 * bisection(l // 2)

P = forward_steps_table(1024, 12)  # P[l, c] for every l <= 1024, c <= 12 slots
print(f"{'l':>6}{'slots log2 l':>14}{'bisection':>11}{'(l/2) log2 l':>14}{'optimum':>9}{'saved':>7}")
for k in range(2, 11):
    l = 2 ** k
    print(f"{l:>6}{k:>14}{bisection(l):>11}{l // 2 * k:>14}{int(P[l, k]):>9}{1 - P[l, k] / bisection(l):>7.0%}")

# %% [markdown]
# The bisection count is exactly $\tfrac{l}{2}\log_2 l$, and the optimum with the same $\log_2 l$ slots needs about a quarter fewer advances at $l = 1024$: splitting in the middle is not where the optimum splits.

# %% [markdown]
# ## The binomial bound
#
# How many steps can $c$ slots reverse if no step may be advanced more than $r$ times? Call it $\beta(c, r)$. With one slot, step 0 is advanced $l-1$ times, so $\beta(1, r) = r + 1$; with no advance allowed only one step can be reversed, $\beta(c, 0) = 1$. Otherwise look at the first checkpoint, at $x_k$: the steps $k..l-1$ above it have not been advanced yet and have $c - 1$ slots (one holds $x_0$), so $l - k \le \beta(c-1, r)$; the steps $0..k-1$ below were advanced once on the way up and keep all $c$ slots, so $k \le \beta(c, r-1)$. Hence Pascal's rule and its solution:
#
# $$\beta(c, r) = \beta(c-1, r) + \beta(c, r-1) \quad\Longrightarrow\quad \beta(c, r) = \binom{c+r}{c}.$$
#
# For $l$ steps the repetition number is $r = \min\{r : \binom{c+r}{c} \ge l\}$, and Griewank & Walther show the least number of advances is
#
# $$r\,l - \binom{c+r}{r-1}.$$
#
# The dynamic programme above knows nothing of binomials; it matches the formula everywhere we look (the tests check every $l \le 200$, $c \le 10$):

# %%
mismatches = [(l, c) for l in range(1, 1025) for c in range(1, 13) if P[l, c] != binomial_forward_steps(l, c)[0]]
print(f"l <= 1024, c <= 12: {1024 * 12} cases, {len(mismatches)} differ from r*l - C(c+r, r-1)")
print("beta(c, r) = C(c+r, c):")
print("  c\\r" + "".join(f"{r:>6}" for r in range(6)))
for c in range(1, 6):
    print(f"{c:>5}" + "".join(f"{math.comb(c + r, c):>6}" for r in range(6)))

# %% [markdown]
# ## A worked schedule: $l = 10$ steps, $c = 3$ slots
#
# $\beta(3, 1) = 4 < 10 \le \beta(3, 2) = 10$, so $r = 2$ and the optimum is $2 \cdot 10 - \binom{5}{1} = 15$ advances. Ten is exactly $\beta(3, 2)$: the chain is as long as three slots can reverse with every step advanced at most twice. The planner's schedule:

# %%
plan = plan_uniform(10, 3)
formula, r = binomial_forward_steps(10, 3)
print(f"forward steps: {plan.forward_steps} (formula: {formula}, r = {r})")
for number, line in enumerate(plan.lines(), 1):
    print(f"{number:>3}. {line}")
advanced = np.zeros(10, dtype=int)
for action in plan.actions:
    if action["action"] == "advance":
        advanced[action["from"]:action["to"]] += 1
print("\ntimes each step is advanced:", dict(enumerate(advanced.tolist())), "total", advanced.sum())

# %% [markdown]
# Read it top down: the first sweep spaces its checkpoints $4, 3, 2$ steps apart (each gap is $\beta(c', 1)$ for the slots still free), reverses step 9 from the state in hand, and then every segment is reversed with the slots that have been freed. The count of advances per step shows the binomial structure: no step is advanced more than $r = 2$ times, and exactly $\binom{5}{1} = 5$ fewer than $2 \cdot 10$ advances happen, because the steps nearest a checkpoint are reached in fewer moves.

# %% [markdown]
# ## Forward steps against $l$, for several $c$
#
# Dots: the dynamic programme. Lines: $r\,l - \binom{c+r}{r-1}$. Left, the totals (log scale): one slot is quadratic, every added slot flattens the curve. Right, the same divided by $l$: the average number of times a step is advanced. Between $\beta(c, r-1)$ and $\beta(c, r)$ the total grows with slope $r$, so the average climbs from $r - 1$ towards $r$ and the curve is piecewise linear, with a kink at every binomial coefficient.

# %%
fig, (total, per_step) = plt.subplots(1, 2, figsize=(12, 4.6))
lengths = np.arange(1, 201)
for c, color in zip((1, 2, 3, 5, 10), ("#C44E52", "#DD8452", "#55A868", "#4C72B0", "#8172B3")):
    formula = np.array([binomial_forward_steps(int(l), c)[0] for l in lengths])
    total.plot(lengths, formula, color=color, lw=1.2, label=f"c = {c} slot{'s' * (c > 1)}:  r l - C(c+r, r-1)")
    total.plot(lengths[::7], P[lengths[::7], c], "o", ms=3.5, color=color)
    if c > 1:
        per_step.plot(lengths, formula / lengths, color=color, lw=1.2, label=f"c = {c} slots")
        per_step.plot(lengths[::7], P[lengths[::7], c] / lengths[::7], "o", ms=3.5, color=color)
total.plot([], [], "o", color="gray", ms=3.5, label="dynamic programme")
total.set_yscale("log")
total.set_ylabel("forward steps (advances)")
total.set_title("least advances to reverse l steps with c slots")
per_step.set_ylabel("advances per step")
per_step.set_title("the same, per step: it climbs towards r (repetitions) between kinks")
for ax in (total, per_step):
    ax.set_xlabel("steps l")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
path = save_figure(fig, "11_beyond_sqrt_L")
for c in (1, 2, 3, 5, 10):
    print(f"c = {c:>2} {'slots:' if c > 1 else 'slot:':<6} l = 200 needs {int(P[200, c]):>6} advances (r = {binomial_forward_steps(200, c)[1]}, "
          f"{P[200, c] / 200:.2f} per step)")

# %% [markdown]
# ## Back to $\sqrt{L}$, honestly
#
# Write Chen's two-level scheme in these units. Checkpoints every $C$ steps ($L/C$ of them, $x_0$ included); to reverse a segment, advance through it once, storing each state, and reverse its steps top down. At most, the slots hold the checkpoints below plus the segment's inner states (its first is a checkpoint already, its last is in hand):
#
# $$c_2(C) = \frac{L}{C} + C - 2, \qquad \text{advances} = (L - 1) + \Big(\frac{L}{C} - 1\Big)(C - 1) = 2L - \frac{L}{C} - C = 2L - (c_2 + 2).$$
#
# Every step is advanced at most twice (the first sweep, then once inside its segment), so this is $r = 2$, and at $C = \sqrt{L}$ it holds $2\sqrt{L} - 2$ slots. The binomial optimum for $c$ slots with $r = 2$ is $2L - \binom{c+2}{1} = 2L - (c + 2)$: **the two-level scheme is optimal for the number of slots it uses.** What it does not do is use few slots: $r = 2$ only needs $\binom{c+2}{2} = \tfrac{(c+1)(c+2)}{2} \ge L$, that is $c \approx \sqrt{2L} - 1.5$, **about $\sqrt{2}$ times fewer slots** for the same "every step advanced at most twice", and only $2\sqrt{L} - \sqrt{2L}$ more advances. Allowing $r = 3$ needs $c \approx (6L)^{1/3}$; and with $r \approx c \approx \log_2 L$, $\binom{2c}{c} \approx 4^c/\sqrt{\pi c} \ge L$: memory and repetitions both logarithmic, the recursion of the first section, done optimally.

# %%
def two_level(L, C):
    segments = math.ceil(L / C)
    last = L - (segments - 1) * C
    slots = max(segments + last - 2, segments + C - 3) if segments > 1 else max(L - 1, 1)
    return slots, (L - 1) + (segments - 1) * (C - 1)

table = forward_steps_table(1000, 64)
print(f"{'L':>6}{'best C':>8}{'2-level slots':>15}{'advances':>10}{'optimum, same slots':>21}"
      f"{'least slots, r=2':>18}{'advances':>10}{'2 sqrt L':>10}{'sqrt 2L':>9}")
for L in (16, 64, 100, 256, 1000):
    C = min(range(1, L + 1), key=lambda C: two_level(L, C))
    slots, advances = two_level(L, C)
    c2 = next(c for c in range(1, 64) if math.comb(c + 2, 2) >= L)
    print(f"{L:>6}{C:>8}{slots:>15}{advances:>10}{int(table[L, slots]):>21}{c2:>18}{int(table[L, c2]):>10}"
          f"{2 * math.sqrt(L):>10.1f}{math.sqrt(2 * L):>9.1f}")

# %% [markdown]
# For square $L$ the two-level scheme lands exactly on the optimum for its slots (for $L = 1000$, where $\sqrt{L}$ is not whole, the optimum is a few advances better); the least slots for $r = 2$ are about $\sqrt{2L}$, for a handful more advances.
#
# How does "one extra forward" fit in? Recomputing every layer once costs one forward more, $+33\%$ of a step's FLOPs when the backward costs two forwards. That is the price of any scheme that rebuilds each layer exactly once: Korthikanti et al. 2022 quote it for full recomputation, every layer checkpointed (they measured $+36$–$39\%$ in time), and Chen et al. 2016 pay the same one extra forward for their $\sqrt{L}$ segments (about $+30\%$ in their runs). In revolve's accounting a step's record is made again right before its backward. picockpt's `every:C` instead keeps the *whole segment's activations* from the one recompute (every layer `all`), so each layer is forwarded twice in all, not three times: it pays in memory ($C$ layers' activations, $A$ bytes each, not $C$ states of $X$ bytes) what revolve pays in an extra advance. Which is better depends on $A / X$, and for a transformer layer $A/X$ is large (Chen's rule with unequal sizes, $C^* = \sqrt{L\,X/A}$, already says so; notebook 02 shows when depth and the head still make $C > 1$ pay). That trade is exactly what picockpt's planner decides, layer by layer.

# %% [markdown]
# ## picockpt's layers: bytes, not slots
#
# For picockpt's model the chain's steps are decoder layers: a checkpoint is a layer input, $X = B\,T\,h\,e$ bytes, and a layer stored whole (its record) is $A$ bytes, many times $X$; a layer can also be stored with its attention probabilities or more dropped (`all:selective`, `all:cheap`), rebuilt in the backward for one $q k^\top$ each. The planner (`picockpt/planning/planner.py`) runs rotor's dynamic programme over (first layer, last layer, bytes) with these options; its uniform special case is the table above (a test in `tests/test_planner.py` recovers the binomial counts from it). Below: its frontier for the `small` model against `every:C`, from the closed forms, and one plan run in the engine and measured.

# %%
from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import chain_sizes, predicted_peak_bytes, step_flops
from picockpt.measurement.measure import make_batch
from picockpt.planning.planner import frontier, model_chain, plan_model
from picockpt.measurement.tracker import Tracker

cfg, B, T = Config.from_preset("small"), 2, 128
X, A, F = chain_sizes(cfg, B, T)
print(f"small, batch {B} x {T}: X = {X / 2**20:.2f} MiB, A = {A / 2**20:.2f} MiB (A/X = {A / X:.1f}), "
      f"F = {F / 2**20:.2f} MiB; Chen's C* = sqrt(L X / A) = {math.sqrt(cfg.layers * X / A):.2f}")
seconds = []
for _ in range(3):  # one timing on a shared machine can be off by tens of percent: three, and their spread
    start = time.perf_counter()
    plans = frontier(model_chain(cfg, B, T))
    seconds.append(time.perf_counter() - start)
print(f"planner: {len(plans)} Pareto-optimal plans in {np.median(seconds):.2f} s "
      f"(median [min..max] of 3: [{min(seconds):.2f}..{max(seconds):.2f}] s)")

fig, ax = plt.subplots(figsize=(8, 4.8))
ax.step([p.recompute_flops / 1e9 for p in plans], [p.peak_bytes / 2**20 for p in plans], where="post",
        color="#8172B3", label="planner frontier (budget:SIZE)")
for C in range(1, cfg.layers + 1):
    policy = "full" if C == 1 else f"every:{C}"
    peak, flops = predicted_peak_bytes(cfg, B, T, policy), step_flops(cfg, B, T, policy)["recompute"]
    ax.plot(flops / 1e9, peak / 2**20, "o", color="#DD8452")
    ax.annotate(policy, (flops / 1e9, peak / 2**20), fontsize=7, xytext=(4, 0), textcoords="offset points")
ax.set_xlabel("recompute per step (GFLOP)")
ax.set_ylabel("peak of the activation store (MiB)")
ax.set_title("picockpt small: the planner against every:C")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)

budget = predicted_peak_bytes(cfg, B, T, "full")  # what `full` needs; what does the planner do with it?
print(f"full: end of the forward 8X + F = {(8 * X + F) / 2**20:.2f} MiB, last layer recomputed 7X + A = "
      f"{(7 * X + A) / 2**20:.2f} MiB: its peak is the second")
plan = plan_model(cfg, B, T, budget)
params = init_params(cfg, seed=0)
ids, targets = make_batch(cfg, B, T, "cpu", 0)
with Tracker() as tracker:
    loss_and_grads(params, cfg, ids, targets, f"budget:{budget}", tracker=tracker)
print(f"budget = full's peak, {budget:,} bytes: full recomputes {step_flops(cfg, B, T, 'full')['recompute'] / 1e9:.3f} "
      f"GFLOP; the plan {plan.recompute_flops / 1e9:.3f} GFLOP (measured {tracker.flops['recompute'] / 1e9:.3f}), "
      f"store peak {plan.peak_bytes:,} bytes (measured {tracker.peak_logical:,})")
print("first forward:", plan.schedule.forward)
for target, first, modes in plan.sweeps:
    print(f"  before the backward of layer {target}: from layer {first},", [modes[k] for k in range(first, target + 1)])

# %% [markdown]
# With $A/X \approx 21$, Chen's $C^*$ is below one layer, so among the uniform policies `full` is the least-memory choice, and every `every:C` pays one full extra forward. At `full`'s own budget the planner still finds a cheaper schedule. `full`'s peak comes in the backward, when the last layer is recomputed beside the seven checkpoints below it ($7X + A$); at the end of the forward its store holds only $8X + F$, far less. The planner spends that slack: it stores the last layer whole in the first forward (with the op level that fits beside the checkpoints and the head), so that layer is never recomputed: one layer's forward saved, one $q k^\top$ rebuild paid. And each of its recompute sweeps stops before the last layer's down projection, whose output nobody needs any more (PyTorch's non-reentrant checkpoint stops there too); the fixed policies recompute whole layers, one extra forward exactly. At tighter budgets the frontier goes on below `full`: layers are recomputed more than once (the multi-level schedules of the first sections), down to the least feasible budget where only $x_0$ and one layer fit.
#
# What the measurement says, and what it does not: the store's peak and the recompute FLOPs are measured equal to the planner's prediction, to the byte and the FLOP. The budget limits the *store*; the live memory of a step is that plus the backward's working memory (gradients of activations, rebuilt probabilities), a few MiB here, which `lessons/12_budget_planner.py` measures against every other policy and PyTorch's own checkpointing.

# %% [markdown]
# ## Exercises
#
# **1.** $\beta(c, r)$: with $c = 4$ slots and no step advanced more than $r = 3$ times, how many steps can
# be reversed at most?

# %%
answer = 35  # steps

# %%
longest = max(l for l in range(1, 200) if binomial_forward_steps(l, 4)[1] <= 3)
check("beta(4, 3): the longest chain 4 slots reverse with r <= 3", answer, longest, rel=0,
      why=f"beta(c, r) = C(c + r, c) = C(7, 4) = {math.comb(7, 4)}; the planner's uniform chain needs r = 4 "
          f"from l = {longest + 1} on (binomial_forward_steps)")

# %% [markdown]
# **2.** The least number of advances to reverse $l = 20$ steps with $c = 3$ slots: find $r$ first, then
# use $r\,l - \binom{c+r}{r-1}$.

# %%
answer = 45  # advances

# %%
schedule = plan_uniform(20, 3)
check("least advances for l = 20 steps, c = 3 slots", answer, schedule.forward_steps, rel=0,
      why=f"beta(3, 2) = 10 < 20 <= beta(3, 3) = 20, so r = 3: 3·20 - C(6, 2) = {3 * 20 - math.comb(6, 2)}; "
          f"the planner's schedule has {schedule.forward_steps} advances")

# %% [markdown]
# **3.** Chen's two-level scheme on $L = 64$ steps with $C = 8$: how many slots does it hold at most?
# ($c_2(C) = L/C + C - 2$.)

# %%
answer = 14  # slots

# %%
check("slots of the two-level scheme, L = 64, C = 8", answer, two_level(64, 8)[0], rel=0,
      why=f"L/C + C - 2 = 8 + 8 - 2; two_level() counts {two_level(64, 8)[0]} slots and {two_level(64, 8)[1]} "
          f"advances, the optimum for that many slots is {int(table[64, two_level(64, 8)[0]])}")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"cases where the DP = r l - C(c+r, r-1)": f"{1024 * 12 - len(mismatches)} of {1024 * 12}",
                      "planner plans at full's budget, measured = predicted":
                          tracker.peak_logical == plan.peak_bytes and tracker.flops["recompute"] == plan.recompute_flops}}

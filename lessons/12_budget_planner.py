# %% [markdown]
# # Lesson 12: the memory-budget planner against every other way to fit
#
# "I have this much memory: what is the cheapest way to fit?" For one model and batch, every policy is
# a point (recompute FLOPs, peak bytes): `none`, `selective`, `cheap`, `full`, every `every:C` and their
# combinations with `selective` and `cheap`; the planner (`budget:SIZE`, rotor's dynamic programme,
# Beaumont et al. 2019, in `picockpt/planning/planner.py`): its whole frontier, every Pareto-optimal plan from the
# least feasible budget to storing everything; and PyTorch's recomputation on the autograd reference:
# checkpoint per layer, `checkpoint_sequential` at every segment count, two selective-checkpoint
# policies, and the min-cut partitioner that `torch.compile` uses, swept over its whole range of
# `torch._functorch.config.activation_memory_budget` (from 1, save what it likes, to 0, save only the inputs).
#
# Two views. The **logical** view is the activation store's peak, which a budget constrains: the
# planner's frontier there is exact, and every other policy's point must lie on or above it. The
# planner picks the op level of each layer and of the model head (whose cheap variant drops the final
# norm's output), so plain `budget:SIZE` plans already include everything `selective` and `cheap` can do.
# The **physical** view is every tensor alive (store plus working memory), the only view the PyTorch
# peers have; the planner does not model working memory, so there it could be beaten, and the lesson
# checks whether it is.
#
# **Run it** as a script, `python lessons/12_budget_planner.py` (the CPU run, about two minutes, most of it
# tracing the partitioner's graphs;
# `--fast` for seconds, `--large --device cuda` for a bigger shape on a GPU), or step through this
# notebook, where the same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset: the
# CPU run). Notebook 08 (`11_beyond_sqrt_L`) derives the planner's special case of equal layers.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

from _check import check
from _lesson import FAST_TIMING, Spread, callouts, choose, large, lesson_args, shape_line, small, wrote
from picockpt import init_params, loss_and_grads, parse_policy
from picockpt.cli.plan import benchmark
from picockpt.planning.step_forms import chain_sizes, predicted_peak_bytes, step_flops
from picockpt.measurement.measure import make_batch
from picockpt.measurement.peers import min_cut, per_layer, run_plain, save_matmuls, selective, sequential
from picockpt.planning.planner import frontier, least_budget, model_chain, plan_model
from picockpt.teaching.plotting import mib, policy_color, save_figure
from picockpt.recompute.policy import OP_LEVEL
from picockpt.measurement.reference import ReferenceLlama
from picockpt.measurement.tracker import Tracker

PLANNER_COLOR, TORCH_COLOR, MINCUT_COLOR = "#8172B3", "#7F7F7F", "#2CA02C"

# %% [markdown]
# ## What each run mode measures
#
# `--fast` keeps the tests quick: a few planner points, a few fixed policies, one min-cut budget (0) at a
# four-layer shape. The CPU run (the `small` preset at batch 4 x 128) measures 20 planner points, the
# fixed policies in full, every segment count of `checkpoint_sequential` and eight min-cut budgets from 1
# to 0 (tracing and partitioning the graphs takes 5-8 s per budget here: the run's longest part).

# %%
def shape(mode):
    """(Config, batch, seq) of each run mode."""
    return choose(mode, fast=(small(layers=4), 2, 32), cpu=(small(), 4, 128), large=(large(), 2, 1024))


def extent(mode, cfg):
    """What each run mode measures: planner points run, fixed policies, segment counts of
    checkpoint_sequential, min-cut budgets, layers and repeats of the planning-time benchmark. --fast keeps
    the tests quick: a few of each."""
    layer_levels = ["none", "full"] + [f"every:{C}" for C in range(2, cfg.layers + 1)]
    every = [parse_policy(level + op, cfg).text for level in layer_levels for op in ("", "+selective", "+cheap")]
    some = [p for p in every if "+" not in p or p.split("+")[0] in ("full", "every:2", f"every:{cfg.layers // 2}")]
    return choose(mode, fast=dict(dots=4, run=["none", "cheap", "full", "every:2"], segments=[2], peers=False,
                                  min_cut=(0.0,), benchmark_layers=32, plan_repeats=1),
                  cpu=dict(dots=20, run=some, segments=range(2, cfg.layers + 1), peers=True,
                           min_cut=(1.0, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0), benchmark_layers=128, plan_repeats=3),
                  large=dict(dots=20, run=every, segments=range(2, cfg.layers + 1), peers=True,
                             min_cut=(1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0), benchmark_layers=128,
                             plan_repeats=3)) \
        | {"every": every}


# %% [markdown]
# ## Measuring picockpt and PyTorch
#
# `measure_picockpt` runs one step under a tracker (store peak and live peak; recompute FLOPs measured
# or taken from the closed form, which the tests hold equal to the measurement). `measure_torch` does
# the same for an autograd run, in two passes (its live bytes, then its FLOPs, each measured on its own),
# and also keeps the bytes alive at the end of the forward: what the run saved
# for its backward. `peers.min_cut` puts the reference model through AOTAutograd with `torch.compile`'s
# min-cut partitioner and an activation memory budget, without Dynamo and without code generation, so the
# tracker sees every op of both graphs.

# %%
def planner_frontier(cfg, batch, seq):
    """(peak, recompute, policy) of every Pareto-optimal budget:SIZE plan, from storing everything
    down to the least feasible budget (each layer's and the head's op level chosen by the planner)."""
    return [(p.peak_bytes, p.recompute_flops, f"budget:{p.peak_bytes}")
            for p in frontier(model_chain(cfg, batch, seq))]


def measure_picockpt(cfg, params, ids, targets, policy, device, seed, flops=False):
    """Store peak and live peak, measured. Recompute FLOPs measured with flops=True, otherwise from
    the closed form (equal to the measurement: tests/test_policies.py and test_planner.py), because
    counting FLOPs while watching every storage costs the tracker about three times as long."""
    torch.manual_seed(seed)
    with Tracker(device, flops=flops) as tracker:
        loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
    B, T = ids.shape
    recompute = tracker.flops["recompute"] if flops else step_flops(cfg, B, T, policy)["recompute"]
    return {"logical": tracker.peak_logical, "physical": tracker.peak_physical, "recompute": recompute}


def measure_torch(model, ids, targets, forward, device, seed):
    """Physical peak, bytes saved for the backward (live at the end of the forward) and total FLOPs of
    forward + backward; forward(ids, targets) -> loss. Two runs: the live bytes, then the FLOPs, each
    measured on its own."""
    def run(**what):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with Tracker(device, **what) as tracker:
            with tracker.phase("forward"):
                loss = forward(ids, targets)
            with tracker.phase("backward"):
                loss.backward()
            for p in model.parameters():
                tracker.mark(p.grad, "gradients")
        return tracker
    memory = run(flops=False)
    saved = [entry["physical"] for entry in memory.timeline if entry["phase"] == "forward"][-1]
    return {"physical": memory.peak_physical, "saved": saved, "flops": sum(run(physical=False).flops.values())}


def backward_order(graphs):
    """Where the partitioned backward graph recomputes: its recomputed matmuls (forward nodes, which keep
    their names in both graphs) and how many of them run in the graph's first tenth, long before the
    layer backwards that use them; and whether it rebuilds x0 (recomputes the embedding lookup)."""
    forward = {node.name for node in graphs["forward"].nodes if node.op == "call_function"}
    nodes = [node for node in graphs["backward"].nodes if node.op == "call_function"]
    matmuls = [i for i, node in enumerate(nodes) if node.name in forward
               and node.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)]
    return {"recomputed_matmuls": len(matmuls), "early": sum(i < len(nodes) / 10 for i in matmuls),
            "from_x0": any(node.target == torch.ops.aten.embedding.default for node in nodes)}


def torch_peers(cfg, params, ids, targets, seq, todo, device, seed):
    model = ReferenceLlama(cfg, params).to(device)
    runs = {"autograd": run_plain, "torch checkpoint per layer": per_layer}
    if todo["peers"]:
        runs.update({"torch selective checkpoint": selective(seq),
                     "torch checkpoint saving matmuls": save_matmuls(seq)})
    runs.update({f"torch checkpoint_sequential({n})": sequential(n) for n in todo["segments"]})
    rows = {name: measure_torch(model, ids, targets, lambda i, t, run=run: model(i, t, run_layers=run), device, seed)
            for name, run in runs.items()}
    for budget in todo["min_cut"]:
        graphs = {}
        compiled = min_cut(model, budget, graphs)
        model.zero_grad(set_to_none=True)
        compiled(ids, targets).backward()  # trace and partition once, untracked
        row = measure_torch(model, ids, targets, compiled, device, seed)
        model.zero_grad(set_to_none=True)
        row.update(budget=budget, **backward_order(graphs))
        rows[f"min-cut partitioner, budget {budget}"] = row
    base = rows["autograd"]["flops"]
    for row in rows.values():
        row["recompute"] = row["flops"] - base
    return rows


# %%
args = lesson_args()
cfg, batch, seq = shape(args.mode)
device, seed, todo = args.device, args.seed, extent(args.mode, cfg)
fast = args.mode == "fast"
print(f"lesson 12, the budget planner: {shape_line(cfg, batch, seq, device)}")
params = init_params(cfg, seed=seed, device=device)
ids, targets = make_batch(cfg, batch, seq, device, seed)
forward_flops = step_flops(cfg, batch, seq)["forward"]

front = planner_frontier(cfg, batch, seq)
picks = np.unique(np.linspace(0, len(front) - 1, min(todo["dots"], len(front))).round().astype(int))
counted = set(picks[1::max(1, len(picks) // 3)][:3])  # a few with measured FLOPs too
measured_plans = {front[i][2]: measure_picockpt(cfg, params, ids, targets, front[i][2], device, seed,
                                                flops=i in counted) for i in picks}
print(f"\nplanner: {len(front)} Pareto-optimal plans from {mib(front[0][0]):.2f} MiB down to the least "
      f"feasible {mib(front[-1][0]):.2f} MiB; {len(measured_plans)} of them run:")
print(f"{'policy':<28}{'store MiB':>11}{'predicted':>11}{'live MiB':>10}{'recompute GFLOP':>17}{'predicted':>11}")
exact = True
i_of = {front[i][2]: i for i in picks}
for (peak, flops, policy) in (front[i] for i in picks):
    row = measured_plans[policy]
    exact &= row["logical"] == peak and row["recompute"] == flops
    note = "  (FLOPs measured)" if i_of[policy] in counted else ""
    print(f"{policy:<28}{mib(row['logical']):>11.3f}{mib(peak):>11.3f}{mib(row['physical']):>10.2f}"
          f"{row['recompute'] / 1e9:>17.4f}{flops / 1e9:>11.4f}{note}")
print(f"measured store peaks (all) and recompute FLOPs (where measured) equal the planner's: {exact}")

# %% [markdown]
# Every measured store peak equals the planner's prediction, and so does every measured recompute
# count. Next, every fixed policy against the planner at that policy's own peak: the planner may never
# need more recompute there.

# %%
fixed = {p: {"logical": predicted_peak_bytes(cfg, batch, seq, p), "physical": None,
             "recompute": step_flops(cfg, batch, seq, p)["recompute"]} for p in todo["every"]}
for policy in todo["run"]:  # the store's peak is measured too, and must equal the closed form
    row = measure_picockpt(cfg, params, ids, targets, policy, device, seed)
    assert row["logical"] == fixed[policy]["logical"], policy
    fixed[policy] = row
print(f"\n{'fixed policy':<22}{'store MiB':>11}{'live MiB':>10}{'recompute GFLOP':>17}"
      f"{'planner at that budget':>24}")
beaten_logical = []
for policy, row in fixed.items():
    best = min((p for p in front if p[0] <= row["logical"]), key=lambda p: p[1])  # the planner at that budget
    if best[1] > row["recompute"]:
        beaten_logical.append(policy)
    live = f"{mib(row['physical']):>10.2f}" if row["physical"] else f"{'-':>10}"
    print(f"{policy:<22}{mib(row['logical']):>11.3f}{live}{row['recompute'] / 1e9:>17.4f}"
          f"{best[1] / 1e9:>17.4f}  {best[2]}")
print(f"fixed policies below the planner's frontier (logical): {beaten_logical or 'none'}")

# %% [markdown]
# ## PyTorch's recomputation, and the physical view
#
# The PyTorch peers have no store: only their live bytes can be compared. For each rival, the
# planner's best chance is its plan of least store among those recomputing no more than the rival;
# `physical_view` runs it and prints any rival with fewer live bytes. Two things decide it. PyTorch's
# non-reentrant checkpoint stops recomputing at the last tensor a backward needs, so each recomputed
# segment skips its last layer's down projection; the planner's sweeps stop at the same place (the fixed
# policies `full` and `every:C` recompute whole layers, one extra forward exactly). And the working
# memory (live - stored), which a budget does not limit: picockpt's backward frees each tensor at its
# last use, which keeps it to a layer's transient products.

# %%
peers = torch_peers(cfg, params, ids, targets, seq, todo, device, seed)
sweep = {name: row for name, row in peers.items() if "budget" in row}  # the min-cut partitioner: a section below
checkpointing = {name: row for name, row in peers.items() if name not in sweep}
print(f"\n{'PyTorch peer':<40}{'live MiB':>10}{'recompute GFLOP':>17}")
for name, row in checkpointing.items():
    print(f"{name:<40}{mib(row['physical']):>10.2f}{row['recompute'] / 1e9:>17.4f}")

# %%
def physical_view(plans, rivals, front, measure):
    """The claim in live bytes. For every rival (measured), the planner's best chance is its plan of
    least store among those recomputing no more than the rival: run it if it was not, and compare.
    Returns the rivals that beat it (less live memory for no more recompute)."""
    beaten = []
    for name, rival in rivals.items():
        index = min(range(len(front)), key=lambda i: (front[i][1] > rival["recompute"], front[i][0]))
        policy = front[index][2]
        if policy not in plans:
            plans[policy] = measure(policy)
        if plans[policy]["physical"] > rival["physical"]:
            beaten.append(name)
            after = front[min(index + 1, len(front) - 1)]  # the next point: less store, more recompute
            if after[2] not in plans:
                plans[after[2]] = measure(after[2])
            print(f"physical view: {name} ({mib(rival['physical']):.2f} MiB live, {rival['recompute'] / 1e9:.4f} "
                  f"GFLOP) beats {policy} ({mib(plans[policy]['physical']):.2f} MiB, {front[index][1] / 1e9:.4f} "
                  f"GFLOP); the planner's next point: {mib(plans[after[2]]['physical']):.2f} MiB live for "
                  f"{after[1] / 1e9:.4f} GFLOP")
    working = [row["physical"] - row["logical"] for row in plans.values()]
    print(f"rivals that beat the planner in the physical view: {beaten or 'none'} (of {len(rivals)}); "
          f"{len(plans)} plans run in all")
    print(f"working memory on top of the store (live - stored) at the planner's points: "
          f"{mib(min(working)):.2f} .. {mib(max(working)):.2f} MiB: a budget limits the store, not this")
    return beaten


rivals = {**{p: r for p, r in fixed.items() if r["physical"]}, **peers}
beaten_physical = physical_view(measured_plans, rivals, front,
                                lambda policy: measure_picockpt(cfg, params, ids, targets, policy, device, seed))
runs = [benchmark(cfg, batch, seq, seed, layers=todo["benchmark_layers"]) for _ in range(todo["plan_repeats"])]
timing = {name: Spread(tuple(run[name]["seconds"] for run in runs)) for name in runs[0]}
for name, spread in timing.items():
    print(f"planning time, {name}, {runs[0][name]['slots']} slots: "
          + (FAST_TIMING if fast else f"{spread.text('{:.0f}', scale=1e3)} ms (median [min..max] of {len(runs)})"))

# %% [markdown]
# ## The figure
#
# Left, the logical view: the planner's exact frontier (the line), its measured points, and every fixed
# policy (circles: layer level only, diamonds: `+selective`, squares: `+cheap`). Middle and right, the
# physical view beside picockpt's fixed policies and beside PyTorch's checkpointing (the min-cut
# partitioner has its own figure, next); crowded points are named from a column of labels.

# %%
def plot(fixed, measured_plans, front, peers):
    """Three panels: the store's peak (what a budget limits), then live bytes beside picockpt's
    fixed policies and beside PyTorch's checkpointing. Every point is named: the crowded ones from
    a column of labels to their right, tied to them by thin lines."""
    fig, (logical, mine, theirs) = plt.subplots(1, 3, figsize=(19, 6.6), sharex=True)
    gflop = lambda flops: np.asarray(flops) / 1e9  # noqa: E731
    plans, column = list(measured_plans.values()), {logical: [], mine: [], theirs: []}
    for ax, view in ((logical, "logical"), (mine, "physical"), (theirs, "physical")):
        ax.scatter(gflop([r["recompute"] for r in plans]), mib([r[view] for r in plans]), s=22, zorder=4,
                   color=PLANNER_COLOR, label="planner, measured (budget:SIZE)")
    logical.step(gflop([p[1] for p in front]), mib([p[0] for p in front]), where="post", color=PLANNER_COLOR,
                 lw=1.2, label="planner frontier (every Pareto-optimal plan)", zorder=2)
    for ax, view in ((logical, "logical"), (mine, "physical")):
        for policy, row in fixed.items():
            if row[view] is None:
                continue
            op = "cheap" if policy.endswith("+cheap") or policy == "cheap" else \
                "selective" if "selective" in policy else None
            x, y = float(gflop(row["recompute"])), mib(row[view])
            ax.scatter(x, y, marker={"cheap": "s", "selective": "D", None: "o"}[op], s=28, zorder=3,
                       color=policy_color(policy), edgecolor="black", linewidth=0.4)
            if x < 0.2 * ax.get_xlim()[1] or op is None:  # apart from the others: named beside the point
                left = op is None and x > 0.2 * ax.get_xlim()[1]  # every:C's circles: named on their left
                ax.annotate(policy, (x, y), fontsize=6, va="center", ha="right" if left else "left",
                            xytext=(-5 if left else 5, 0), textcoords="offset points")
            else:  # a column of +selective / +cheap points at one recompute cost: named from the column
                column[ax].append((policy.replace("+selective", "+sel"), (x, y), "black"))
    for peer, row in peers.items():
        x, y = float(gflop(row["recompute"])), mib(row["physical"])
        theirs.scatter(x, y, marker="^", s=40, color=TORCH_COLOR, zorder=3)
        column[theirs].append((peer.replace("torch checkpoint_sequential", "checkpoint_sequential")
                               .replace("torch ", ""), (x, y), TORCH_COLOR))
    for marker, text in (("o", "layer level only"), ("D", "+selective (+sel)"), ("s", "+cheap / cheap")):
        for ax in (logical, mine):
            ax.scatter([], [], marker=marker, color="white", edgecolor="black", label=f"fixed policy, {text}")
    for policy, text in (("none", "none"), ("selective", "selective, cheap"), ("full", "full"), ("every:2", "every:C")):
        logical.scatter([], [], marker="o", color=policy_color(policy), label=f"colour: {text}")
    theirs.scatter([], [], marker="^", color=TORCH_COLOR, label="PyTorch checkpointing (autograd reference)")
    logical.set_title("logical: the activation store's peak\n(what a budget limits)")
    mine.set_title("physical: every live tensor (store + working memory)\nbeside picockpt's fixed policies")
    theirs.set_title("physical: every live tensor (store + working memory)\nbeside PyTorch's checkpointing")
    for ax in (logical, mine, theirs):
        ax.set_xlabel("recompute per step (GFLOP, matmuls)")
        ax.set_ylabel("peak (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.tight_layout()
    right = theirs.get_xlim()[1]
    for ax, items in column.items():
        callouts(ax, items, x=0.42 * right)
    return fig


fig = plot(fixed, measured_plans, front, checkpointing)
fig.suptitle(f"Peak memory against recompute, one training step: {shape_line(cfg, batch, seq, device)}; "
             f"one forward = {forward_flops / 1e9:.2f} GFLOP", fontsize=9, y=1.03)
path = save_figure(fig, "12_budget_planner")
wrote(path)

# %% [markdown]
# ## The min-cut partitioner over its whole budget range
#
# `torch.compile` traces forward and backward into one joint graph and cuts it in two: what crosses
# the cut is saved, everything else the backward graph recomputes
# (`torch._functorch.partitioners.min_cut_rematerialization_partition`). Below budget 1 it picks the
# saved set by a knapsack over the graph's tensors: the lower the budget, the fewer bytes it may save.
# The table sweeps that budget from 1 to 0 on this lesson's shape; **saved** is what is alive at the end
# of the forward (what the backward graph receives), **live** the peak of every tensor of the step.
#
# The budget limits what is saved, not what is alive. The backward graph is one graph: what it
# recomputes is not rebuilt segment by segment, one layer's worth just before that layer's backward (as
# a checkpoint per layer or picockpt's sweeps do), but wherever the graph's order puts it, and every
# recomputed tensor then stays alive until its last use. **above saved** is the live peak less the saved
# bytes: what the backward holds on top of what it was given (recomputed tensors, gradients in flight;
# autograd's is about 1 MiB). **early** counts the recomputed matmuls that run in the backward graph's
# first tenth, long before the layer backwards that use them. Where many do, the live peak climbs back
# towards autograd's while the saved bytes keep falling; at budget 0 the backward graph recomputes the
# whole forward, the head included, and holds nearly all of it at once. So the live peak is not monotone
# in the budget. Every budget below 1 also recomputes the embedding lookup: the partitioner rebuilds
# $x_0$ from the ids, which picockpt's planner (whose chain starts at $x_0$) never does.

# %%
def sweep_table(sweep, autograd):
    print(f"\n{'activation_memory_budget':<26}{'saved MiB':>11}{'live MiB':>10}{'above saved':>13}"
          f"{'recompute GFLOP':>17}{'forwards':>10}{'early':>12}  rebuilds x0")
    for row in sweep.values():
        print(f"{row['budget']:<26}{mib(row['saved']):>11.2f}{mib(row['physical']):>10.2f}"
              f"{mib(row['physical'] - row['saved']):>13.2f}{row['recompute'] / 1e9:>17.3f}"
              f"{row['recompute'] / forward_flops:>10.2f}{row['early']:>6} of {row['recomputed_matmuls']:<3}  "
              f"{'yes' if row['from_x0'] else 'no'}")
    print(f"{'autograd (no recomputation)':<26}{mib(autograd['saved']):>11.2f}{mib(autograd['physical']):>10.2f}"
          f"{mib(autograd['physical'] - autograd['saved']):>13.2f}{0:>17.3f}")
    lives = [row["physical"] for row in sweep.values()]  # budgets in decreasing order
    falls = all(a >= b for a, b in zip(lives, lives[1:]))
    print(f"live peak falls with every lower budget: {falls}; saved bytes fall with every lower budget: "
          f"{all(a['saved'] >= b['saved'] for a, b in zip(sweep.values(), list(sweep.values())[1:]))}")


def against_planner(best, plans, front):
    """The planner's answer to the partitioner's best budget, both ways, among the plans run."""
    run = [(front_row, plans[front_row[2]]) for front_row in front if front_row[2] in plans]
    reach = [(f, r) for f, r in run if r["physical"] <= best["physical"]]
    within = [(f, r) for f, r in run if f[1] <= best["recompute"]]
    if reach:
        f, r = min(reach, key=lambda fr: fr[0][1])
        print(f"the planner reaches the partitioner's best live peak ({mib(best['physical']):.2f} MiB, budget "
              f"{best['budget']}, {best['recompute'] / 1e9:.3f} GFLOP recomputed) at {mib(r['physical']):.2f} MiB live "
              f"for {f[1] / 1e9:.3f} GFLOP ({f[2]}; least recompute of the {len(run)} plans run)")
    else:
        print(f"none of the {len(run)} planner plans run reaches {mib(best['physical']):.2f} MiB live")
    f, r = min(within, key=lambda fr: fr[1]["physical"])
    print(f"within the partitioner's {best['recompute'] / 1e9:.3f} GFLOP the planner's least live peak is "
          f"{mib(r['physical']):.2f} MiB ({f[2]}, {f[1] / 1e9:.3f} GFLOP)")


best_cut = min(sweep.values(), key=lambda row: row["physical"])
sweep_table(sweep, peers["autograd"])
against_planner(best_cut, measured_plans, front)

# %%
def plot_sweep(sweep, autograd, plans, front):
    """Left: saved and live bytes against the budget; right: live bytes against recompute, the
    partitioner's sweep beside the planner's measured plans."""
    fig, (by_budget, by_flops) = plt.subplots(1, 2, figsize=(13, 5))
    budgets = [row["budget"] for row in sweep.values()]
    by_budget.plot(budgets, mib([row["physical"] for row in sweep.values()]), "^-", color=MINCUT_COLOR,
                   label="min-cut: live peak (every tensor)")
    by_budget.plot(budgets, mib([row["saved"] for row in sweep.values()]), "s--", color=MINCUT_COLOR, alpha=0.6,
                   label="min-cut: saved for the backward (live at the forward's end)")
    by_budget.axhline(mib(autograd["physical"]), color=TORCH_COLOR, ls=":", label="autograd: live peak")
    least = min(plans.values(), key=lambda row: row["physical"])
    by_budget.axhline(mib(least["physical"]), color=PLANNER_COLOR, ls="-.",
                      label="picockpt planner: least live peak of its plans run")
    by_budget.set_xlabel("torch._functorch.config.activation_memory_budget")
    by_budget.invert_xaxis()
    by_budget.set_title("the budget limits what is saved, not what is alive")
    run = [(f, plans[f[2]]) for f in front if f[2] in plans]
    by_flops.plot([f[1] / 1e9 for f, _ in run], mib([r["physical"] for _, r in run]), "o", ms=4,
                  color=PLANNER_COLOR, label="picockpt planner (budget:SIZE), measured")
    x = [row["recompute"] / 1e9 for row in sweep.values()]
    by_flops.plot(x, mib([row["physical"] for row in sweep.values()]), "^-", color=MINCUT_COLOR, lw=0.8,
                  label="min-cut partitioner, in budget order")
    for row, gflop in zip(sweep.values(), x):
        by_flops.annotate(f"{row['budget']:g}", (gflop, mib(row["physical"])), fontsize=7, xytext=(4, 3),
                          textcoords="offset points", color=MINCUT_COLOR)
    by_flops.plot([0], [mib(autograd["physical"])], "^", color=TORCH_COLOR, label="autograd")
    by_flops.set_xlabel("recompute per step (GFLOP, matmuls)")
    by_flops.set_title("live peak against recompute")
    for ax in (by_budget, by_flops):
        ax.set_ylabel("peak (MiB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left" if ax is by_budget else "upper right")
    fig.suptitle(f"torch.compile's min-cut partitioner over its budget range: {shape_line(cfg, batch, seq, device)}",
                 fontsize=9)
    fig.tight_layout()
    return fig


sweep_path = save_figure(plot_sweep(sweep, peers["autograd"], measured_plans, front), "12_min_cut_budget_sweep")
wrote(sweep_path)

# %% [markdown]
# ## Exercises
#
# Both for the `small` model at batch 4 × 128 tokens, fp32.
#
# **1.** The least feasible budget of the planner's chain. The planner's unit is the layer: a layer's
# backward runs with that layer stored whole (its input and every tensor its op level keeps), and the
# chain starts at the first layer's input $x_0$, which the planner keeps until the very end. Both are
# properties of that granularity, not laws: $x_0$ is an embedding lookup that the ids and the embedding
# weight could rebuild (the min-cut partitioner's backward graph does, above), and a checkpoint around
# each block inside a layer (attention, MLP) would need less than a whole layer at once. Within the
# planner's chain, with the sizes printed below, what is the least budget, in bytes, that any of its
# schedules fits in?

# %%
exercise = small()
X8, _, _ = chain_sizes(exercise, 4, 128)
layer_bytes = {level: chain_sizes(exercise, 4, 128, OP_LEVEL.get(level, frozenset()))[1]
               for level in ("none", "selective", "cheap")}
print(f"X = {X8:,} bytes; one layer stored whole (input included): " +
      ", ".join(f"{level} {nbytes:,}" for level, nbytes in layer_bytes.items()) + " bytes")

# %%
answer = 3_411_968  # bytes

# %%
least = least_budget(model_chain(exercise, 4, 128))
check("the least feasible budget of the planner's chain (small, 4 x 128), in bytes", answer, least, rel=0,
      why=f"x0 ({X8:,}) beside a later layer stored whole at the cheapest op level, all:cheap "
          f"({layer_bytes['cheap']:,}, its own input included): {X8 + layer_bytes['cheap']:,}; "
          f"planner.least_budget says {least:,}")

# %% [markdown]
# **2.** Give the planner exactly what `full` needs. How many GFLOP of recompute does its plan save
# against `full`'s one extra forward?

# %%
answer = 0.654  # GFLOP

# %%
full_budget = predicted_peak_bytes(exercise, 4, 128, "full")
plan = plan_model(exercise, 4, 128, full_budget)
full_recompute = step_flops(exercise, 4, 128, "full")["recompute"]
check("GFLOP the planner saves against full at full's budget (small, 4 x 128)", answer,
      (full_recompute - plan.recompute_flops) / 1e9, rel=0.01,
      why=f"full recomputes {full_recompute / 1e9:.3f} GFLOP; the plan {plan.recompute_flops / 1e9:.3f}: it keeps "
          f"the last layer whole ({plan.schedule.forward[-1]}), since full's peak comes in the backward and leaves "
          f"room at the end of the forward, and each sweep stops before the down projection nobody needs")

# %%
RESULT = {"figures": [str(path), str(sweep_path)], "summary": {
    "Pareto-optimal plans": len(front), "plans measured": len(measured_plans),
    "measured == predicted": exact, "fixed policies beating the planner (logical)": len(beaten_logical),
    "rivals beating the planner (physical)": f"{len(beaten_physical)} of {len(rivals)}",
    "min-cut best budget": best_cut["budget"], "min-cut best live MiB": round(mib(best_cut["physical"]), 2),
    **{f"planning ms, {name}": FAST_TIMING if fast else spread.text("{:.0f}", scale=1e3)
       for name, spread in timing.items()}}}

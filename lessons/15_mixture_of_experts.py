# %% [markdown]
# # Lesson 15: mixture-of-experts layers: memory by routing and top-k, what to recompute, RNG and routing replay
#
# A Mixtral-style layer (`picockpt/model/moe.py`) sends each token to $k$ of its $E$ experts. What it stores
# is one set of tensors per expert, sized by the tokens the router sent there: data-dependent. Three
# questions, each answered by a measurement held to the closed form (`picockpt/planning/step_forms.py`):
#
# 1. **Routing imbalance and top-k.** Routers set by the weights (`routing.route_by_token`) give balanced,
#    skewed and all-to-one routing. The store holds every token $k$ times whichever experts it goes to:
#    the layer's total is the same for all three, only its split among the experts moves (what an
#    expert-parallel rank holding one expert would keep: up to $E/k$ times the balanced share). The
#    working memory of the backward is not the same: it runs one expert's tokens at a time, so it grows
#    with the largest group. Top-k multiplies the experts' part: stored bytes are linear in $k$.
# 2. **Which op-level choice saves the most bytes per extra FLOP:** `selective` (attention
#    probabilities), `moe_act` (the experts' SwiGLU products, elementwise), `cheap`, `moe` (whole experts:
#    only the router output and the routing decision stay), `full` (the whole layer). picockpt's `moe` is
#    not Megatron-LM's `--recompute-modules moe`, which checkpoints the whole MoE layer and so runs the
#    router, the dispatch and combine all-to-alls and the shared experts again
#    (`megatron/core/transformer/moe/moe_layer.py`, `MoELayer.forward`); picockpt's keeps the router's
#    output and the routing and recomputes the experts alone. Predicted for a
#    Mixtral 8x7B layer ($h = 4096$, $f = 14336$, $E = 8$, $k = 2$, 32 heads, 8 kv heads, bf16, 4096
#    tokens) with eager and with fused attention; measured on a small one.
# 3. **RNG replay and routing replay.** With router jitter (0.01 as in Switch Transformer, and 0.1), a
#    layer recomputed whole (`full` here, in one process) runs its router again. Without restoring the
#    random generator it draws other noise, and some tokens go to other experts: the backward
#    differentiates a different network (lesson 09 shows the same for dropout masks). picockpt's engine
#    replays the generator (RNG replay): the same noise, the same logits, the same experts, bitwise on
#    this CPU. That holds only while the router's kernels give the same bits twice; a kernel that does
#    not (a different reduction order), with two experts' bf16 scores a rounding apart, can send a token
#    elsewhere even with the noise replayed. Megatron-LM's routing replay (`moe_enable_routing_replay`,
#    `megatron/core/transformer/moe/router_replay.py`, called from `topk_routing_with_score_function` in
#    `moe_utils.py`) gives each router a `RouterReplay` whose action the caller sets. `RECORD` only stores the
#    top-k the router computed (`recorded_topk_idx`), for the caller to read; nothing replays it by itself.
#    A recomputation replays with `REPLAY_BACKWARD`, which takes its indices from a list that only
#    `set_target_indices` fills: the `REPLAY_FORWARD` path, the indices handed over through `set_replay_data`
#    (recorded in another run, or loaded from a file). Replaying, the router still computes its logits and
#    scores and gathers the scores at the given indices: only the choice of experts is fixed, at $8 N k$ bytes
#    a layer held for the backward (int64, $N$ tokens), the same experts under any kernel (the fused router,
#    `moe_router_fusion`, returns before the replay is consulted). picockpt's expert-parallel `full`
#    (lesson 17) fixes more, keeping `moe.expert_index` and never routing again; its single-process `full`
#    reroutes with the generator replayed. Recomputing only inside the layer (`moe`) reuses the stored
#    routing and draws nothing: exact with or without RNG replay.
#
# **Run it** as a script, `python lessons/15_mixture_of_experts.py` (the CPU run, the `small` preset with
# 8 experts; `--fast` for seconds, `--large --device cuda` for a bigger shape on a GPU), or step through
# this notebook, where the same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset:
# the CPU run).

# %%
import contextlib
from unittest import mock

import matplotlib.pyplot as plt
import torch

from _check import check
from _lesson import choose, large, lesson_args, shape_line, small, wrote
from picockpt import Config, init_params, loss_and_grads
from picockpt.model import moe
from picockpt.recompute import engine
from picockpt.planning.step_forms import expert_bytes, layer_flops, layer_inventory, predicted_peak_bytes, rebuild_flops, total
from picockpt.measurement.measure import PutRecorder, make_batch
from picockpt.model.routing import route_by_token, step_routing
from picockpt.teaching.plotting import mib, save_figure
from picockpt.recompute.policy import parse_policy
from picockpt.measurement.tracker import Tracker

ROUTINGS = ("balanced", "skewed", "all to one")
CHOICES = ("selective", "moe_act", "cheap", "router", "moe", "cheap+moe", "full")
JITTERS = (0.01, 0.1)  # Switch Transformer's router jitter, and ten times it
TOP_KS = (1, 2, 3, 4)

# %% [markdown]
# ## Routing and top-k
#
# `token_ids` makes batches whose tokens the weights route in a chosen way (balanced, half to one expert,
# all to one); `by_routing` measures one step of each and compares every stored name of every layer with
# the closed form; `by_top_k` measures one stored layer at $k$ = 1..4.

# %%
def shape(mode):
    """(Config, batch, seq) of each run mode: 8 experts, top-2."""
    moe_fields = dict(experts=8, experts_per_token=2)
    return choose(mode, fast=(small(layers=2, hidden=64, ffn=256, **moe_fields), 2, 32),
                  cpu=(small(layers=4, **moe_fields), 4, 128),
                  large=(large(layers=4, ffn=1408, **moe_fields), 2, 1024))


def mixtral_layer(attention):
    return Config.from_preset("mixtral-8x7b", dtype="bfloat16", attention=attention)


def token_ids(routing, cfg, batch, seq, device):
    """Token ids whose class (id mod E) is every expert alike, half of them class 0, or all class 0:
    under route_by_token the class is the first expert (the others are the next k-1)."""
    N, E = batch * seq, cfg.experts
    classes = {"balanced": torch.arange(N) % E,
               "skewed": torch.where(torch.arange(N) < N // 2, 0, torch.arange(N) % E),
               "all to one": torch.zeros(N, dtype=torch.long)}[routing]
    spread = torch.randint(0, cfg.vocab // E, (N,), generator=torch.Generator().manual_seed(0))
    return (classes + E * spread).view(batch, seq).to(device)


def step_peaks(params, cfg, ids, policy="none"):
    """(stored peak, live peak) bytes of one step, and the store's puts of it."""
    recorder = PutRecorder()
    with Tracker(ids.device, flops=False) as tracker:
        loss_and_grads(params, cfg, ids, torch.roll(ids, 1, dims=1), policy, tracker=tracker)
    loss_and_grads(params, cfg, ids, torch.roll(ids, 1, dims=1), policy, tracker=recorder)
    return tracker.peak_logical, tracker.peak_physical, recorder.puts


def by_routing(cfg, batch, seq, device, seed):
    """routing -> counts of layer 0, stored and live peaks, whether the store equals the closed form."""
    params = route_by_token(init_params(cfg, seed=seed, device=device), cfg)
    rows = {}
    for routing in ROUTINGS:
        ids = token_ids(routing, cfg, batch, seq, device)
        counts = step_routing(params, cfg, ids)
        stored, live, puts = step_peaks(params, cfg, ids)
        exact = all({n: b for (lay, n), b in puts.items() if lay == i} ==  # every name of every layer
                    {n: b for n, (_, _, b) in layer_inventory(cfg, batch, seq, counts=counts[i]).items()}
                    for i in range(cfg.layers)) and stored == predicted_peak_bytes(cfg, batch, seq, "none", counts)
        rows[routing] = dict(counts=counts[0], stored=stored, live=live, exact=exact,
                             experts=expert_bytes(cfg, batch, seq, counts[0]))
    return rows


def by_top_k(cfg, batch, seq, device, seed):
    """k -> (stored bytes of one layer measured, closed form, live peak of the step)."""
    rows = {}
    for k in TOP_KS:
        shaped = cfg.replace(experts_per_token=k)
        params = init_params(shaped, seed=seed, device=device)
        ids, _ = make_batch(shaped, batch, seq, device, seed)
        _, live, puts = step_peaks(params, shaped, ids)
        measured = sum(b for (lay, _), b in puts.items() if lay == 0)
        rows[k] = (measured, total(layer_inventory(shaped, batch, seq)), live)
    return rows


# %% [markdown]
# ## Op-level choices, and RNG replay
#
# `predicted_choices` takes the bytes a choice saves and the matmul FLOPs it adds from the closed forms;
# `measured_choices` measures the same with the store's puts of the first forward and the tracker's
# recompute FLOPs. `replay_experiment` runs `full` with and without the generator replayed, and `moe`
# without it, recording which experts each token goes to in the first forward and in the recomputation.

# %%
def predicted_choices(cfg, batch, seq):
    """choice -> (bytes one layer saves, matmul FLOPs it adds), from the closed forms."""
    whole = layer_inventory(cfg, batch, seq)
    rows = {}
    for choice in CHOICES:
        if choice == "full":  # keep only the input; recompute the whole layer once
            rows[choice] = (total(whole) - whole["input"][2], sum(layer_flops(cfg, batch, seq).values()))
            continue
        unstored = parse_policy(choice).unstored
        kept = total(layer_inventory(cfg, batch, seq, unstored))
        rows[choice] = (total(whole) - kept, rebuild_flops(cfg, batch, seq, unstored))
    return rows


class ForwardPuts(PutRecorder):
    """(layer, name) -> bytes of every put of the first forward (a recompute sweep puts a layer again)."""

    def __init__(self):
        super().__init__()
        self.current = "outside"

    @contextlib.contextmanager
    def phase(self, name):
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    def on_event(self, event):
        if self.current == "forward":
            super().on_event(event)


def measured_choices(cfg, batch, seq, device, seed):
    """The same, measured: bytes the store took for layer 0 in the forward, recompute FLOPs the tracker
    counted, per layer."""
    params = init_params(cfg, seed=seed, device=device)
    ids, targets = make_batch(cfg, batch, seq, device, seed)
    per_layer = {}
    for policy in ("none",) + CHOICES:
        recorder = ForwardPuts()
        loss_and_grads(params, cfg, ids, targets, policy, tracker=recorder)
        with Tracker(device, physical=False) as tracker:
            loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
        per_layer[policy] = (sum(b for (lay, _), b in recorder.puts.items() if lay == 0),
                             tracker.flops["recompute"] // cfg.layers)
    return {c: (per_layer["none"][0] - per_layer[c][0], per_layer[c][1]) for c in CHOICES}


def recorded_routing():
    """A context that records every routing decision the MoE blocks make, in order: [index (N, k)]."""
    calls, original = [], moe.router_forward

    def recording(*args):
        probs, index, weights = original(*args)
        calls.append(index.sort(dim=-1).values)  # (N, k) the set of experts of each token
        return probs, index, weights
    return calls, mock.patch.object(moe, "router_forward", recording)


def replay_experiment(cfg, batch, seq, device, seed):
    """(jitter, policy, replay) -> (max |g - g_none|, ||g - g_none|| / ||g_none||, [fraction of tokens routed
    differently in each layer's recomputation])."""
    runs = [(j, "full", r) for j in JITTERS for r in (True, False)] + [(JITTERS[-1], "moe", False)]
    return {(j, policy, r): replay_run(cfg.replace(router_jitter=j), batch, seq, device, seed, policy, r)
            for j, policy, r in runs}


def replay_run(cfg, batch, seq, device, seed, policy, replay):
    params = init_params(cfg, seed=seed, device=device)
    ids, targets = make_batch(cfg, batch, seq, device, seed)
    torch.manual_seed(seed)
    _, reference = loss_and_grads(params, cfg, ids, targets, "none")
    calls, recording = recorded_routing()
    no_replay = mock.patch.object(engine, "replay_rng", lambda generator, state: contextlib.nullcontext())
    torch.manual_seed(seed)  # the same first forward as the reference
    with recording, (contextlib.nullcontext() if replay else no_replay):
        _, grads = loss_and_grads(params, cfg, ids, targets, policy)
    L = cfg.layers
    first, again = calls[:L], calls[L:][::-1]  # the backward recomputes layers L-1 .. 0 (none under moe)
    rerouted = [(a != b).any(dim=-1).float().mean().item() for a, b in zip(first, again)] or [0.0] * L
    error = max((grads[k] - reference[k]).abs().max().item() for k in reference)
    relative = (sum((grads[k].double() - reference[k].double()).pow(2).sum() for k in reference).sqrt() /
                sum(reference[k].double().pow(2).sum() for k in reference).sqrt()).item()
    return error, relative, rerouted


# %%
args = lesson_args()
cfg, batch, seq = shape(args.mode)
print(f"lesson 15, E={cfg.experts} experts, top-{cfg.experts_per_token}: "
      f"{shape_line(cfg, batch, seq, args.device)}")
routing = by_routing(cfg, batch, seq, args.device, args.seed)
top_k = by_top_k(cfg, batch, seq, args.device, args.seed)
mixtral = {attention: predicted_choices(mixtral_layer(attention), 1, 4096) for attention in ("eager", "fused")}
small_predicted = predicted_choices(cfg, batch, seq)
small_measured = measured_choices(cfg, batch, seq, args.device, args.seed)
replay = replay_experiment(cfg, batch, seq, args.device, args.seed)

# %%
print("\n1. routing (set by the weights), policy none:")
print(f"{'routing':<12}{'tokens per expert (layer 0)':<34}{'stored':>12}{'largest expert':>16}{'live peak':>12}")
for name, row in routing.items():
    print(f"{name:<12}{str(row['counts']):<34}{mib(row['stored']):>8.2f} MiB{mib(max(row['experts'])):>12.2f} MiB"
          f"{mib(row['live']):>8.2f} MiB")
stored_same = len({row["stored"] for row in routing.values()}) == 1
growth = routing["all to one"]["live"] - routing["balanced"]["live"]
print(f"stored: the same for every routing ({stored_same}); the largest expert's share grows "
      f"{max(routing['all to one']['experts']) / max(routing['balanced']['experts']):.1f}x from balanced to all to "
      f"one; the live peak by {mib(growth):.2f} MiB (the backward works through one expert's tokens at a time)")
print("\ntop-k, one stored layer: " + ", ".join(f"k={k}: {mib(m):.2f} MiB (closed form {mib(c):.2f})"
                                                 for k, (m, c, _) in top_k.items()))

# %% [markdown]
# The store is blind to routing: the same total for every routing, one token stored $k$ times whichever
# experts it goes to. The split among experts moves, and so does the live peak: the backward works
# through one expert's tokens at a time.

# %%
print("\n2. op-level choices, bytes saved per layer and matmul FLOPs added per layer:")
for title, rows, (unit, scale) in [(f"Mixtral 8x7B layer, {a} attention, bf16, 1 x 4096 tokens (predicted)",
                                     mixtral[a], ("GFLOP", 1e9)) for a in ("eager", "fused")] + \
                                   [("this model (measured)", small_measured, ("MFLOP", 1e6))]:
    print(f"  {title}")
    for choice, (saved, flops) in rows.items():
        rate = ("nothing to drop" if saved == 0 else "free in matmul FLOPs (rebuilt elementwise)") if flops == 0 \
            else f"{mib(saved) / (flops / 1e9):.3g} MiB per GFLOP"
        print(f"    {choice:<10}{mib(saved):>10.3f} MiB{flops / scale:>10.1f} {unit}   {rate}")
measured_exact = small_measured == small_predicted
ranking = {name: sorted((c for c in CHOICES if rows[c][1]), key=lambda c: -rows[c][0] / rows[c][1])
           for name, rows in (("Mixtral, eager", mixtral["eager"]), ("Mixtral, fused", mixtral["fused"]),
                              ("this model", small_measured))}
for name, order in ranking.items():
    print(f"  bytes per matmul FLOP, best first ({name}): {' > '.join(order)}")

# %% [markdown]
# With eager attention the $T \times T$ probabilities are the best buy (`selective`, `cheap`); with fused
# attention there is nothing to drop there, and `moe_act` and `cheap` are free in matmul FLOPs (rebuilt
# elementwise). Among choices that cost matmuls, recomputing the experts' projections (`moe`) buys fewer
# bytes per FLOP than the attention core; against recomputing the whole layer it depends on the
# attention: with eager attention `full` buys more per FLOP (it also drops the $T \times T$
# probabilities), with fused attention, or on the small model, `moe` does. Read the three rankings.
# `router` is small at both ends: it drops E probabilities per token (0.125 MiB for the Mixtral layer)
# for one $h \to E$ linear; nobody would recompute it alone, but a budget planner takes it where those
# few bytes tip a layer under the budget (`tests/test_moe_inventory.py` shows the planner doing so).

# %%
print("\n3. router jitter, recomputation with and without the generator replayed:")
for (jitter, policy, replayed), (error, relative, rerouted) in replay.items():
    print(f"  jitter {jitter:<5} {policy:<5} {'replay' if replayed else 'no replay':<10} "
          f"max |g - g_none| {error:.3g}"
          f" (relative {relative:.2g}); tokens routed to other experts when recomputed, by layer: "
          f"{', '.join(f'{r:.1%}' for r in rerouted)}")
bitwise = all(error == 0.0 for (_, _, replayed), (error, _, _) in replay.items() if replayed)
if not bitwise:
    print("  the replayed run is not exact: the engine must save the generator state with each checkpoint "
          "whenever a step draws random numbers (Config.draws_random), router jitter alone included")
index_bytes = layer_inventory(mixtral_layer("fused"), 1, 4096)["moe.expert_index"][2]
input_bytes = layer_inventory(mixtral_layer("fused"), 1, 4096)["input"][2]
print(f"  routing replay (Megatron's REPLAY_BACKWARD, from indices given by set_target_indices) would hold the "
      f"top-k indices instead: a Mixtral 8x7B layer at 4096 tokens, 8·N·k = {index_bytes:,} B, "
      f"{index_bytes / input_bytes:.2%} of the layer input that full keeps ({input_bytes / 2**20:.0f} MiB): the "
      f"recomputation's experts are then the given ones whatever the kernels compute")

# %% [markdown]
# ## The figure
#
# Top: the experts' share of one layer by routing (the same total, split differently); stored and
# working memory by routing; top-k. Bottom: bytes saved against matmul FLOPs added per layer, for Mixtral
# (predicted) and for this model (measured); and the share of tokens routed to other experts when a layer
# is recomputed without the generator replayed.

# %%
def routing_label(name, cfg):
    """'all to one' sends every token's first choice to expert 0: with k > 1 its other choices go to the next
    experts, so the bars show k of them."""
    k = cfg.experts_per_token
    if name != "all to one" or k == 1:
        return name
    return f"all to one first choice\n(k={k}: experts 0..{k - 1})"


def plot_routing(left, middle, routing, cfg):
    names = list(routing)
    bottom = [0.0] * len(names)
    colors = plt.cm.viridis([e / max(1, cfg.experts - 1) for e in range(cfg.experts)])
    for e in range(cfg.experts):
        values = [mib(routing[n]["experts"][e]) for n in names]
        left.bar(range(len(names)), values, bottom=bottom, color=colors[e], label=f"expert {e}", edgecolor="white",
                 lw=0.5)
        bottom = [b + v for b, v in zip(bottom, values)]
    left.set_xticks(range(len(names)), [routing_label(n, cfg) for n in names], fontsize=8)
    left.set_ylim(0, max(bottom) * 1.35)
    left.set_ylabel("MiB in one stored layer (the experts' tensors)")
    left.set_title("the experts' share of one layer, by routing:\nthe same total, split differently")
    left.legend(fontsize=7, ncol=4, loc="upper center")
    x = list(range(len(names)))
    stored = [mib(routing[n]["stored"]) for n in names]
    working = [mib(routing[n]["live"] - routing[n]["stored"]) for n in names]
    middle.bar(x, stored, 0.6, label="stored (the store's peak)", color="#4C72B0")
    bars = middle.bar(x, working, 0.6, bottom=stored, label="working memory on top (live peak - stored)",
                      color="#C44E52")
    for bar, s, w in zip(bars, stored, working):
        middle.annotate(f"{s:.2f} + {w:.2f} MiB", (bar.get_x() + 0.3, s + w), ha="center", va="bottom", fontsize=8)
    middle.set_xticks(x, [f"{routing_label(n, cfg)}\nlargest expert: {max(routing[n]['counts'])} rows" for n in names],
                      fontsize=7)
    middle.set_ylim(0, max(s + w for s, w in zip(stored, working)) * 1.25)
    middle.set_ylabel("MiB, one step, policy none")
    middle.set_title("the store is blind to routing;\nthe backward's working memory is not")
    middle.legend(fontsize=8, loc="upper left")


def plot_top_k(ax, top_k):
    """One stored layer (left axis) and the whole step's live peak (right axis): two quantities, two axes."""
    ks = list(top_k)
    ax.plot(ks, [mib(c) for _, c, _ in top_k.values()], "-", color="0.5", label="one layer stored: closed form")
    ax.plot(ks, [mib(m) for m, _, _ in top_k.values()], "o", color="#4C72B0", label="one layer stored: measured")
    step = ax.twinx()
    step.plot(ks, [mib(v) for _, _, v in top_k.values()], "s--", color="#C44E52", label="live peak of one step")
    ax.set_xticks(ks)
    ax.set_xlabel("experts per token k")
    ax.set_ylabel("MiB stored in one layer", color="#4C72B0")
    step.set_ylabel("MiB, live peak of the whole step (right axis)", color="#C44E52")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)
    step.set_ylim(0, step.get_ylim()[1] * 1.3)
    ax.set_title("top-k: every token stored k times\n(linear in k)")
    handles = ax.get_legend_handles_labels()[0] + step.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)


def plot_choices(ax, rows, title, size, work, marker="o"):
    """Bytes saved (y) against matmul FLOPs added (x) per layer, one point per choice."""
    (size_unit, size_scale), (work_unit, work_scale) = size, work
    points = {choice: (flops / work_scale, saved / size_scale) for choice, (saved, flops) in rows.items()}
    span = [max(abs(v[i]) for v in points.values()) or 1.0 for i in (0, 1)]
    groups = []  # choices whose points lie within 6% of the axes of each other share one label
    for choice, (x, y) in points.items():
        near = next((g for g in groups if abs(points[g[0]][0] - x) <= 0.06 * span[0]
                     and abs(points[g[0]][1] - y) <= 0.06 * span[1]), None)
        near.append(choice) if near else groups.append([choice])
    for group in groups:
        for choice in group:
            ax.plot(*points[choice], marker, color="#C44E52" if choice == "full" else "#4C72B0",
                    fillstyle="full" if marker == "o" else "none")
        ax.annotate(" = ".join(group) if len(group) > 1 and all(points[c] == points[group[0]] for c in group)
                    else ", ".join(group), points[group[0]], fontsize=7, ha="left" if marker == "o" else "right",
                    xytext=(5, 3) if marker == "o" else (-5, -9), textcoords="offset points")
    ax.margins(x=0.15, y=0.1)
    ax.set_xlabel(f"matmul {work_unit} added per layer (0: rebuilt elementwise)")
    ax.set_ylabel(f"{size_unit} saved per layer")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)


def plot_replay(ax, replay, cfg):
    layers = list(range(cfg.layers))
    runs = list(replay)
    width = 0.8 / len(runs)
    colors = {("full", False): ["#E8A3A5", "#C44E52"], ("full", True): ["#9DB4D6", "#4C72B0"],
              ("moe", False): ["#55A868"]}
    for n, run in enumerate(runs):
        jitter, policy, replayed = run
        _, relative, rerouted = replay[run]
        shades = colors[policy, replayed]
        color = shades[min(JITTERS.index(jitter), len(shades) - 1)]
        ax.bar([i - 0.4 + (n + 0.5) * width for i in layers], [100 * r for r in rerouted], width, color=color,
               label=f"j={jitter} {policy}, {'replay' if replayed else 'no replay'}: grad. error {relative:.1e}")
    ax.set_xticks(layers)
    ax.set_xlabel("layer")
    ax.set_ylabel("% of tokens routed to other experts when recomputed")
    ax.set_title("router jitter j and recomputation:\nwithout the generator replayed, other experts run", fontsize=10)
    ax.set_ylim(0, max(1.0, ax.get_ylim()[1]) * 1.6)  # room for the legend above the bars
    ax.legend(fontsize=6.5, title="relative gradient error vs none", title_fontsize=7, loc="upper left")


fig = plt.figure(figsize=(15, 9.5))
axes = [fig.add_subplot(2, 3, i + 1) for i in range(6)]
plot_routing(axes[0], axes[1], routing, cfg)
plot_top_k(axes[2], top_k)
plot_choices(axes[3], mixtral["eager"], "Mixtral 8x7B layer, bf16, 1 x 4096 tokens (predicted)\n"
             "circles: eager attention, squares: fused", ("GiB", 2**30), ("TFLOP", 1e12))
plot_choices(axes[3], mixtral["fused"], None, ("GiB", 2**30), ("TFLOP", 1e12), marker="s")
plot_choices(axes[4], small_measured, f"this model, measured (= closed form: {measured_exact})",
             ("MiB", 2**20), ("MFLOP", 1e6))
plot_replay(axes[5], replay, cfg)
fig.suptitle(f"Mixture of experts: E={cfg.experts}, top-{cfg.experts_per_token}, L={cfg.layers}, h={cfg.hidden}, "
             f"f={cfg.ffn}, batch {batch} x {seq}, {cfg.dtype}")
fig.tight_layout()
path = save_figure(fig, "15_mixture_of_experts")
wrote(path)

# %% [markdown]
# ## Exercises
#
# Exercises 1 and 3 are for a Mixtral 8x7B layer ($h = 4096$, $f = 14336$, $E = 8$, $k = 2$) in bf16.
#
# **1.** The experts' tensors keep, for every (token, expert) pair, the gate and up projections and their
# SwiGLU product, each $f$ wide. How many bytes per token is that?

# %%
answer = 172_032  # bytes per token

# %%
mixtral = mixtral_layer("fused")
experts_total = sum(expert_bytes(mixtral, 1, 4096))
check("bytes per token of a Mixtral 8x7B layer's experts, bf16", answer, experts_total / 4096, rel=0,
      why=f"k·3·f·2 = 2·3·{mixtral.ffn}·2 bytes: every token is stored once per expert it goes to "
          f"(expert_bytes: {experts_total:,} bytes for 4096 tokens, whatever the routing)")

# %% [markdown]
# **2.** With router jitter and no replay of the generator, which policy measured above still gives the
# gradients of `none` exactly: `full` or `moe`?

# %%
answer = "moe"

# %%
exact = [policy for (jitter, policy, replayed), (error, _, _) in replay.items() if not replayed and error == 0.0]
check("the policy exact without replay under router jitter", answer, ", ".join(sorted(set(exact))),
      why="moe recomputes inside the layer from the stored routing decision: no new draw. full reruns the "
          "router with fresh noise: " + ", ".join(f"jitter {j}: {max(r for r in replay[j, 'full', False][2]):.1%} "
                                                  f"of tokens rerouted" for j in JITTERS))

# %% [markdown]
# **3.** Megatron-LM's routing replay holds each layer's top-k indices (int64, given by `set_target_indices`)
# for the backward, so that a layer recomputed under `REPLAY_BACKWARD` runs the same experts under any kernel.
# How many bytes per layer is that for a Mixtral layer at 4096 tokens?
# (picockpt keeps the same tensor, `moe.expert_index`, under every policy that stores the layer.)

# %%
answer = 65_536  # bytes per layer

# %%
index = layer_inventory(mixtral, 1, 4096)["moe.expert_index"]
check("bytes per layer of the recorded top-k indices (Mixtral 8x7B, 4096 tokens)", answer, index[2], rel=0,
      why=f"8·N·k = 8·4096·2 = {index[2]:,} bytes (moe.expert_index {index[0]}, {index[1]}): against "
          f"{layer_inventory(mixtral, 1, 4096)['input'][2]:,} for the layer input full keeps, the price of a "
          f"recomputation that routes exactly as the first forward did")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"stored = closed form, 3 routings": all(r["exact"] for r in routing.values()),
                      "stored per layer = closed form, every top-k": all(m == c for m, c, _ in top_k.values()),
                      "stored, balanced = skewed = all to one": stored_same,
                      "measured choices = closed form": measured_exact,
                      "with RNG replay, gradients = none's (bitwise)": bitwise,
                      "live peak growth, balanced -> all to one (MiB)": round(mib(growth), 2),
                      "Mixtral, most bytes per matmul FLOP (eager / fused)":
                          f"{ranking['Mixtral, eager'][0]} / {ranking['Mixtral, fused'][0]}",
                      "moe without replay, gradients = none's (bitwise)": replay[JITTERS[-1], "moe", False][0] == 0,
                      "tokens rerouted without replay, full, jitter 0.01 / 0.1":
                          " / ".join(f"{max(replay[j, 'full', False][2]):.1%}" for j in JITTERS)}}

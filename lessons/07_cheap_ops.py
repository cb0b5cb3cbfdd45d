# %% [markdown]
# # Lesson 07: recomputing the cheap ops (norms, the SwiGLU product), as llm.c does
#
# Some stored tensors are one elementwise line away from tensors that are stored anyway:
#
# | tensor | rebuilt as | from |
# |---|---|---|
# | `attn_norm.output` | `w * (input * rstd)` | the kept layer input and its `rstd` |
# | `mlp_norm.output` | `w * (mlp_norm.input * rstd)` | the kept residual stream and its `rstd` |
# | `mlp.act` | `silu(gate) * up` | the kept gate and up projections |
#
# llm.c trains GPT-2 with `-r 1` by default (rebuild the GELU output in the backward instead of storing
# it) and `-r 2` (also the LayerNorm outputs). picockpt's `cheap` is the same idea for a Llama layer, on
# top of `selective`: it drops those tensors and the backward rebuilds each with the line above
# (`picockpt/model/layer.py`, the `take(..., rebuild=...)` calls). The rebuild has no matmul in it, so the
# recompute FLOPs that `FlopCounterMode` counts (matmuls) do not move from `selective` to `cheap`; what
# it costs is a few elementwise passes.
#
# This lesson prints one layer's stored tensors by name under `none` / `selective` / `cheap` (closed
# form, checked against what the engine stored), then measures the whole step's peak stored and live
# bytes, the recompute FLOPs and the time (interleaved repeats) under `none`, `selective`, `cheap`,
# `full` and `full+cheap`.
#
# **Run it** as a script, `python lessons/07_cheap_ops.py` (the CPU run, well under a minute; `--fast`
# for seconds, `--large --device cuda` for a bigger shape on a GPU), or step through this notebook, where
# the same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset: the CPU run).

# %%
import matplotlib.pyplot as plt

from _check import check
from _lesson import (FAST_TIMING, choose, device_name, interleaved_seconds, large, lesson_args, paired_ratios,
                     shape_line, small, timed_claim, wrote)
from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import layer_inventory, predicted_peak_bytes, step_flops, total
from picockpt.measurement.measure import make_batch, measured_inventory
from picockpt.teaching.plotting import label_bars, mib, policy_color, save_figure
from picockpt.recompute.policy import OP_LEVEL
from picockpt.measurement.tracker import Tracker

OP_LEVELS = ("none", "selective", "cheap")
POLICIES = ("none", "selective", "cheap", "full", "full+cheap")
GROUPS = {  # how the stored names are coloured: what kind of op made them
    "layer input and residual stream": (("input", "mlp_norm.input"), "#2F4858"),
    "matmul outputs (q, k, v, context, gate, up)": (("attn.q", "attn.k", "attn.v", "attn.context", "mlp.gate",
                                                     "mlp.up"), "#8C8C8C"),
    "attention probabilities (T×T)": (("attn.probs", "attn.probs_mask", "attn.probs_dropped"),
                                      policy_color("selective")),
    "norm outputs": (("attn_norm.output", "mlp_norm.output"), "#DD8452"),
    "SwiGLU product": (("mlp.act",), "#C44E52"),
    "norm statistics (rstd) and dropout masks": (("attn_norm.rstd", "mlp_norm.rstd", "attn.dropout_mask",
                                                  "mlp.dropout_mask"), "#CCB974"),
}

# %% [markdown]
# ## One layer's stored tensors, by name
#
# The closed form (`layer_inventory`, with the names each op level drops) beside what the engine put in
# the store for layer 0 (`measured_inventory`): the two must be the same dictionary.

# %%
def shape(mode):
    """(Config, batch, seq, timed repeats) of each run mode."""
    return choose(mode, fast=(small(layers=2), 2, 32, 1), cpu=(small(), 4, 128, 7), large=(large(), 4, 1024, 5))


# %%
args = lesson_args()
cfg, batch, seq, repeats = shape(args.mode)
fast = args.mode == "fast"
print(f"lesson 07, cheap ops: {shape_line(cfg, batch, seq, args.device)}")

closed_form = {level: {name: nbytes for name, (_, _, nbytes) in
                       layer_inventory(cfg, batch, seq, OP_LEVEL.get(level, frozenset())).items()}
               for level in OP_LEVELS}  # name -> bytes of one stored layer
engine = {level: {name: nbytes for (layer, name), nbytes in
                  measured_inventory(cfg, batch, seq, level, args.device, args.seed).items() if layer == 0}
          for level in OP_LEVELS}  # what the engine put in the store for layer 0
inventory_matches = closed_form == engine
print(f"\none layer's stored tensors (bytes; closed form, {'equal to' if inventory_matches else 'DIFFERENT FROM'} "
      f"what the engine stored):")
print(f"{'name':<20}" + "".join(f"{level:>12}" for level in OP_LEVELS))
for name in closed_form["none"]:
    print(f"{name:<20}" + "".join(f"{closed_form[level][name]:>12,}" if name in closed_form[level]
                                  else f"{'-':>12}" for level in OP_LEVELS))
per_layer = {level: sum(closed_form[level].values()) for level in OP_LEVELS}
print(f"{'total':<20}" + "".join(f"{per_layer[level]:>12,}" for level in OP_LEVELS))
print(f"cheap keeps {per_layer['cheap'] / per_layer['selective']:.1%} of selective's bytes per layer and "
      f"{per_layer['cheap'] / per_layer['none']:.1%} of none's")

# %% [markdown]
# From `selective` to `cheap` the norm outputs and the SwiGLU product go: $2 B T h + B T f$ elements
# per layer. The SwiGLU product is $f$ wide, so in a Llama layer (where $f \approx 3.5h$) it is the
# biggest of the three.
#
# ## The whole step: bytes, recompute FLOPs, time
#
# Each policy runs once under a tracker (stored and live peaks, FLOPs), then all of them are timed in
# interleaved repeats: each repeat runs every policy once, in turn, so a slow moment of a shared machine
# slows them all alike. Each time is the median [min..max] of the repeats, and each ratio to `none` is
# taken within a repeat.

# %%
def measure(cfg, batch, seq, policies, device="cpu", seed=0, repeats=5):
    """policy -> {stored, live (peak bytes), recompute_flops, timing (a Spread of seconds)} of one
    forward + backward."""
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)
    rows = {}
    for policy in policies:
        with Tracker(device) as tracker:
            loss_and_grads(params, cfg, input_ids, targets, policy, tracker=tracker)
        rows[policy] = {"stored": tracker.peak_logical, "live": tracker.peak_physical,
                        "recompute_flops": tracker.flops["recompute"]}
    steps = {p: (lambda p=p: loss_and_grads(params, cfg, input_ids, targets, p)) for p in policies}
    for policy, timing in interleaved_seconds(steps, device, repeats).items():
        rows[policy]["timing"] = timing
    return rows


rows = measure(cfg, batch, seq, POLICIES, args.device, args.seed, repeats)
predicted = {p: predicted_peak_bytes(cfg, batch, seq, p) for p in POLICIES}
ratio = {p: paired_ratios(rows[p]["timing"], rows["none"]["timing"]) for p in POLICIES}  # time / none's
print(f"{'policy':<12}{'stored MiB':>11}{'formula':>9}{'live MiB':>10}{'recompute GFLOP':>17}"
      f"{'ms':>26}{'time / none':>22}")
for p, row in rows.items():
    print(f"{p:<12}{mib(row['stored']):>11.3f}{'equal' if row['stored'] == predicted[p] else 'DIFF':>9}"
          f"{mib(row['live']):>10.3f}{row['recompute_flops'] / 1e9:>17.4f}"
          f"{row['timing'].text('{:.1f}', scale=1e3):>26}{ratio[p].text('{:.3f}'):>22}")
print(f"(times: median [min..max] of {repeats} interleaved forward + backward steps on {device_name(args.device)})")

# %% [markdown]
# The recompute FLOPs of `cheap` equal those of `selective`: its rebuilds are elementwise, and the
# counter counts matmuls. What they cost can show only in the time. Before reading it, the lesson
# checks what must hold: every policy does at least none's work, so its time over none's must be above
# 1 in every repeat, and `cheap` does selective's work plus its rebuilds, so cheap / selective must be
# above 1 too (`timed_claim`). Where the repeats do not agree (or more work came out faster), the
# timing was inconclusive on this machine, and the FLOP ratio is the figure to read (at `--fast` no
# time is read at all: those steps take milliseconds).

# %%
def time_claims(mode, ratio, cheap_vs_selective, work):
    """{name: Claim}: each policy's time over none's (work: its FLOPs over none's) and cheap's over selective's
    (the same FLOPs: its rebuilds are elementwise), each expected above 1 in every interleaved repeat."""
    claims = {p: timed_claim(mode, ratio[p], f"{p} / none, step time", ">1", work[p]) for p in ratio if p != "none"}
    claims["cheap / selective"] = timed_claim(mode, cheap_vs_selective, "cheap / selective, step time", ">1", 1.0)
    return claims


def explain(mode, claims, cheap_vs_selective):
    """Print every claim, then what cheap's rebuilds cost in time: only where its claim holds."""
    for claim in claims.values():
        print(claim.text)
    if claims["cheap / selective"].conclusive:
        print(f"cheap's elementwise rebuilds cost {cheap_vs_selective.median - 1:+.1%} of selective's step time here "
              f"(median), a price no FLOP count shows")
    elif mode != "fast":
        print("cheap against selective: the timing was inconclusive on this machine; by FLOPs the two are equal "
              "(1.000), and what the rebuilds cost is memory traffic (exercise 3 counts its bytes)")


cheap_vs_selective = paired_ratios(rows["cheap"]["timing"], rows["selective"]["timing"])
work = {p: sum(step_flops(cfg, batch, seq, p).values()) / sum(step_flops(cfg, batch, seq, "none").values())
        for p in POLICIES}  # FLOPs over none's, exact
claims = time_claims(args.mode, ratio, cheap_vs_selective, work)
explain(args.mode, claims, cheap_vs_selective)

# %% [markdown]
# ## The figure
#
# Left, one layer's stored tensors grouped by the kind of op that made them: the bars that vanish from
# `selective` to `cheap` are the norm outputs and the SwiGLU product. Right, the whole step's peak
# stored (solid) and live (light) bytes, with each policy's time against `none`.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 1.3]})
for x, level in enumerate(OP_LEVELS):
    bottom = 0.0
    for group, (members, color) in GROUPS.items():
        size = mib(sum(closed_form[level].get(name, 0) for name in members))
        left.bar(x, size, bottom=bottom, color=color, label=group if x == 0 else None, width=0.6)
        bottom += size
    left.annotate(f"{mib(per_layer[level]):.2f} MiB", (x, bottom), ha="center", va="bottom", fontsize=9)
left.set_xticks(range(len(OP_LEVELS)), OP_LEVELS)
left.set_ylabel("MiB stored per layer")
left.set_title("one layer's stored tensors, by what made them")
left.set_ylim(0, mib(per_layer["none"]) * 1.5)  # room for the legend above the bars
left.legend(fontsize=7, loc="upper right")

width = 0.38
xs = range(len(POLICIES))
stored = right.bar([x - width / 2 for x in xs], mib([rows[p]["stored"] for p in POLICIES]), width,
                   color=[policy_color(p) for p in POLICIES], label="peak stored")
live = right.bar([x + width / 2 for x in xs], mib([rows[p]["live"] for p in POLICIES]), width,
                 color=[policy_color(p) for p in POLICIES], alpha=0.45, label="peak live")
label_bars(right, stored, [f"{mib(rows[p]['stored']):.1f}" for p in POLICIES])
label_bars(right, live, ["time: --fast" if fast else f"{ratio[p].median:.2f}× time\n"
                         f"[{ratio[p].low:.2f}..{ratio[p].high:.2f}]" for p in POLICIES], fontsize=7)
right.set_xticks(list(xs), POLICIES)
right.set_ylim(0, mib(max(rows[p]["live"] for p in POLICIES)) * 1.22)  # room for the two-line time labels
right.set_ylabel("MiB over one forward + backward")
right.set_title("the whole step: peak stored (solid) and live (light),\ntime vs none: median [min..max] of "
                f"{repeats} interleaved repeats")
fig.suptitle(f"Cheap ops rebuilt elementwise (llm.c -r 2 style): L={cfg.layers}, h={cfg.hidden}, f={cfg.ffn}, "
             f"batch {batch} x {seq}, {cfg.dtype}, on {device_name(args.device)}"
             + (f" ({FAST_TIMING})" if fast else "" if all(c.conclusive for c in claims.values()) else
                "\ntiming inconclusive on this machine for "
                + ", ".join(name for name, c in claims.items() if not c.conclusive) + ": the bytes are exact"))
fig.tight_layout()
path = save_figure(fig, "07_cheap_ops")
wrote(path)

# %% [markdown]
# ## Exercises
#
# **1.** For the `small` model ($h = 128$, $f = 448$) at batch 4 × 128 tokens in fp32, how many bytes
# per layer does `cheap` store less than `selective`?

# %%
answer = 1_441_792  # bytes per layer

# %%
exercise = small()
saved = total(layer_inventory(exercise, 4, 128, OP_LEVEL["selective"])) - \
    total(layer_inventory(exercise, 4, 128, OP_LEVEL["cheap"]))
check("bytes per layer cheap saves over selective (small, 4 x 128, fp32)", answer, saved, rel=0,
      why=f"two norm outputs of B·T·h and the SwiGLU product of B·T·f, 4 bytes each: "
          f"(2·512·{exercise.hidden} + 512·{exercise.ffn})·4 = {saved:,} bytes")

# %% [markdown]
# **2.** For a Llama 3 8B layer in bf16 at $s = 4096$ ($h = 4096$, $f = 14336$, no dropout), what
# fraction of the bytes that `selective` stores does `cheap` drop on top? (`selective` keeps $34 s h$
# bytes plus the norms' statistics, $8 s$.)

# %%
answer = 0.3235

# %%
llama8 = Config.from_preset("llama3-8b", dtype="bf16")
kept = {level: total(layer_inventory(llama8, 1, 4096, OP_LEVEL[level])) for level in ("selective", "cheap")}
check("the share of a selective Llama 3 8B layer that cheap drops", answer, 1 - kept["cheap"] / kept["selective"],
      why=f"per token 2·2h + 2f = {4 * llama8.hidden + 2 * llama8.ffn:,} bytes of "
          f"34h + 8 = {34 * llama8.hidden + 8:,}: selective keeps {kept['selective']:,} bytes, cheap {kept['cheap']:,}")

# %% [markdown]
# **3.** `cheap`'s rebuilds add no matmul (step_flops finds the same recompute FLOPs as `selective`), but
# they are not free: each reads its inputs and writes its output once more, so they cost memory traffic,
# the limit of any elementwise op. For the same `small` shape, one layer, fp32: how many bytes do the three
# rebuilds of `picockpt/model/layer.py` read and write at least (`rmsnorm_apply(x, rstd, w)` twice, each over
# $B T \times h$ with one statistic per token and $h$ weights; `swiglu_forward(gate, up)` over $B T \times f$)?

# %%
answer = 3_806_208  # bytes per layer

# %%
N, h, f, e = 4 * 128, exercise.hidden, exercise.ffn, 4
norm_traffic = N * h * e + N * 4 + h * e + N * h * e  # read x, rstd, w; write the output
swiglu_traffic = 2 * N * f * e + N * f * e  # read gate and up; write the product
more = step_flops(exercise, 4, 128, "cheap")["recompute"] - step_flops(exercise, 4, 128, "selective")["recompute"]
check("bytes the cheap rebuilds read and write per layer (small, 4 x 128, fp32)", answer,
      2 * norm_traffic + swiglu_traffic, rel=0,
      why=f"two norms, (2·N·h + N + h)·4 = {norm_traffic:,} each, and the SwiGLU product, 3·N·f·4 = "
          f"{swiglu_traffic:,}: {(2 * norm_traffic + swiglu_traffic) / saved:.1f} bytes moved per byte it saves "
          f"({saved:,}), for {more} more matmul FLOPs; divide by the device's memory bandwidth for the least "
          f"time they take (the cheap / selective claim above says whether this machine's timing resolved it)")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"MiB/layer none/selective/cheap": "/".join(f"{mib(per_layer[l]):.2f}" for l in OP_LEVELS),
                      "time cheap/selective": claims["cheap / selective"].short,
                      "stored = formula": all(rows[p]["stored"] == predicted[p] for p in POLICIES),
                      "inventory = engine": inventory_matches}}

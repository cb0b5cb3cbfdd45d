# %% [markdown]
# # Lesson 10: the same choices through torch.utils.checkpoint, measured side by side
#
# What most people use is PyTorch's own recomputation, wrapped around an ordinary autograd model. This
# lesson runs picockpt's policies beside their PyTorch equivalents on the same weights and batch
# (`picockpt/measurement/compare.py`; the PyTorch runs are in `picockpt/measurement/peers.py`), beside the bridge
# (`picockpt/recompute/bridge.py`: picockpt's segment loop driving autograd, no `torch.utils.checkpoint`) and,
# when `transformers` is installed, Hugging Face's `LlamaForCausalLM` with eager and sdpa attention, with
# and without its gradient checkpointing (`picockpt/measurement/peers_hf.py`):
#
# | picockpt | PyTorch |
# |---|---|
# | `none` | plain autograd |
# | `full` | `checkpoint(layer, x, use_reentrant=False)` around every layer |
# | `every:C` | `checkpoint_sequential(layers, L/C segments)` |
# | `selective` | a selective checkpoint policy (`create_selective_checkpoint_contexts`) that recomputes only the ops making a T×T tensor |
# | `cheap` | the policy PyTorch's documentation shows: save the matmul outputs |
#
# **Run it** as a script, `python lessons/10_torch_checkpoint_side_by_side.py` (the CPU run, well under a
# minute; `--fast` for seconds, `--large --device cuda` for a bigger shape on a GPU), or step through
# this notebook, where the same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset:
# the CPU run).

# %%
import math

import matplotlib
import matplotlib.patches
import matplotlib.pyplot as plt

from _check import check
from _lesson import (FAST_TIMING, choose, device_name, interleaved_seconds, large, lesson_args, paired_ratios,
                     shape_line, small, timed_claim, wrote)
from picockpt import init_params, loss_and_grads
from picockpt.measurement import peers
from picockpt.measurement.compare import compare
from picockpt.planning.step_forms import layer_flops, step_flops, tail_flops
from picockpt.measurement.measure import make_batch
from picockpt.teaching.plotting import mib, save_figure
from picockpt.measurement.reference import ReferenceLlama

KIND_COLORS = {"picockpt": "#C44E52", "torch": "#4C72B0", "bridge": "#DD8452", "hf": "#55A868"}
SEGMENT = 2  # C of every:C, and checkpoint_sequential(L / C)

# %%
def shape(mode):
    """(Config, batch, seq, timed repeats) of each run mode."""
    return choose(mode, fast=(small(layers=4), 2, 32, 1), cpu=(small(), 4, 128, 7), large=(large(), 4, 1024, 5))


# %% [markdown]
# ## Every contender, one run
#
# Each row is one forward + backward. Peak live counts every tensor created during the step (weight
# gradients excluded); recompute FLOPs of an autograd run are its total minus plain autograd's. Times
# are median [min..max] over interleaved repeats, and each picockpt row is compared with its PyTorch
# equivalent within each repeat.

# %%
args = lesson_args()
cfg, batch, seq, repeats = shape(args.mode)
print(f"lesson 10, beside torch.utils.checkpoint: {shape_line(cfg, batch, seq, args.device)}")
fast = args.mode == "fast"
rows = compare(cfg, batch, seq, args.device, SEGMENT, repeats, args.seed, log=None)
by_name = {row["name"]: row for row in rows}

def ms(row):  # a step's time: median [min..max] over the interleaved repeats
    low, high = row["step_seconds_min_max"]
    return f"{row['step_seconds'] * 1e3:.1f} [{low * 1e3:.1f}..{high * 1e3:.1f}]"

print(f"\n{'run':<34}{'peak live MiB':>14}{'recompute GFLOP':>17}{'ms':>26}"
      f"   equivalent (memory ratio, time ratio)")
for row in rows:
    pair = ""
    if row["equivalent"]:
        low, high = row["time_vs_equivalent_min_max"]
        pair = (f"   {row['equivalent']} ({row['memory_vs_equivalent']:.2f}, "
                f"{row['time_vs_equivalent']:.2f} [{low:.2f}..{high:.2f}])")
    print(f"{row['name']:<34}{mib(row['peak_live_bytes']):>14.2f}{row['recompute_flops'] / 1e9:>17.3f}"
          f"{ms(row):>26}{pair}")
print(f"(one forward + backward each; peak live = every tensor created during the step, weight gradients "
      f"excluded; times: median [min..max] of {repeats} interleaved repeats on {device_name(args.device)}, "
      f"time ratios taken within each repeat)")

# %% [markdown]
# ## Why the numbers differ where they do
#
# * **Recompute FLOPs.** Non-reentrant checkpoint stops recomputing a layer as soon as the last tensor
#   its backward needs is back, so it never reruns the layer's down projection: its recompute is one
#   forward minus $L$ down projections (checked to the FLOP below).
# * **`checkpoint_sequential`** does not checkpoint its last segment (its backward comes first), so that
#   segment is stored whole and never recomputed.
# * **Selective checkpointing** caches the output of every op its policy marks "save", needed by the
#   backward or not, so the literal "recompute only the T×T ops" policy holds more than plain autograd.
# * **Hugging Face's sdpa rows** show recompute FLOPs without any checkpointing: their attention is torch's
#   fused kernel, whose backward rebuilds the T×T scores from q and k (FlashAttention's recomputation,
#   lesson 13), work that plain autograd over eager attention, the baseline of the count, does not do.
# * **Time.** Two implementations can differ in time for reasons no FLOP count sees (autograd's graph and
#   its saved-tensor hooks, Python per op), so a time ratio between them has no side of 1 fixed in
#   advance. What must hold is inside one implementation: recomputation does more work than none, so
#   `picockpt full` must take longer than `picockpt none`, and `torch checkpoint per layer` longer than
#   `autograd`, in every interleaved repeat. The lesson times those two pairs first (`timed_claim`); only
#   when both hold does it read the ratios between implementations, and then a ratio whose repeats
#   straddle 1 is reported as noise. When either fails, the timing was inconclusive on this machine
#   and each pair's FLOP ratio stands in. At `--fast` (steps of milliseconds) no time is read at all.

# %%
one_forward = by_name["picockpt full"]["recompute_flops"]
down = cfg.layers * 2 * batch * seq * cfg.ffn * cfg.hidden  # the L down projections: 2·B·T·f·h each
torch_full = by_name["torch checkpoint per layer"]["recompute_flops"]
skips_down = one_forward - torch_full == down
print(f"\npicockpt full recomputes exactly one forward of the layers: {one_forward / 1e9:.3f} GFLOP "
      f"(inventory.step_flops: {step_flops(cfg, batch, seq, 'full')['recompute'] / 1e9:.3f}); the bridge too "
      f"({by_name['bridge full']['recompute_flops'] / 1e9:.3f}).")
print(f"torch checkpoint per layer recomputes {torch_full / 1e9:.3f} GFLOP: one forward minus the {cfg.layers} "
      f"down projections ({down / 1e9:.3f} GFLOP) {'exactly' if skips_down else '- NOT exactly'}: it stops once "
      f"the last tensor the backward needs is back.")
segments = math.ceil(cfg.layers / SEGMENT)
sequential = by_name[f"torch checkpoint_sequential({segments})"]["recompute_flops"]
layer = one_forward // cfg.layers  # one layer's forward FLOPs
expected = (segments - 1) * ((SEGMENT - 1) * layer + layer - down // cfg.layers)
print(f"checkpoint_sequential({segments}) recomputes {sequential / 1e9:.3f} GFLOP: its last segment is never "
      f"checkpointed, so {segments - 1} of {segments} segments come back, each stopping before its last down "
      f"projection ({expected / 1e9:.3f} GFLOP: {'exactly' if sequential == expected else 'DIFFERENT'}).")
selective = by_name["torch selective checkpoint"]
ratio = selective["peak_live_bytes"] / by_name["autograd"]["peak_live_bytes"]
print(f"torch selective checkpoint holds {mib(selective['peak_live_bytes']):.2f} MiB, {ratio:.2f}x plain autograd"
      + (": it caches the output of every op marked 'save', needed by the backward or not" if ratio > 1 else "")
      + f"; picockpt selective holds {mib(by_name['picockpt selective']['peak_live_bytes']):.2f} MiB.")

# %% [markdown]
# ## Can this machine's timing rank them?
#
# Before any time ratio between implementations is read, the two checks inside one implementation:
# each pair timed again, interleaved (`sanity_ratios`), against its exact FLOP ratio.

# %%
SANITY = {"picockpt full / picockpt none": ("picockpt full", "picockpt none"),
          "torch checkpoint per layer / autograd": ("torch checkpoint per layer", "autograd")}


def sanity_ratios(cfg, batch, seq, device, seed, repeats):
    """{name of SANITY: Spread of contender / baseline step time}, the four steps interleaved repeat by repeat."""
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)
    model = ReferenceLlama(cfg, params).to(device)

    def torch_step(run_layers):  # one forward + backward of the autograd model
        def run():
            model.zero_grad(set_to_none=True)
            model(input_ids, targets, run_layers=run_layers).backward()
            model.release_weights()
        return run
    steps = {"picockpt none": lambda: loss_and_grads(params, cfg, input_ids, targets, "none"),
             "picockpt full": lambda: loss_and_grads(params, cfg, input_ids, targets, "full"),
             "autograd": torch_step(peers.autograd), "torch checkpoint per layer": torch_step(peers.per_layer)}
    seconds = interleaved_seconds(steps, device, repeats)
    return {name: paired_ratios(seconds[a], seconds[b]) for name, (a, b) in SANITY.items()}


def sanity_claims(mode, checks, by_name):
    """{name of SANITY: Claim}: each pair's time ratio (sanity_ratios) must lie above 1 in every repeat, as its
    exact FLOP ratio (from compare's rows, by name) does."""
    return {name: timed_claim(mode, checks[name], f"{name}, step time", ">1",
                              by_name[a]["total_flops"] / by_name[b]["total_flops"]) for name, (a, b) in SANITY.items()}


def pair_lines(mode, rows, trusted):
    """One line per picockpt row with a PyTorch equivalent: its memory ratio (exact) and, only when the
    timing checks held (trusted), its time ratio read against 1; else the pair's FLOP ratio instead."""
    by_name = {row["name"]: row for row in rows}
    for row in rows:
        if row["kind"] != "picockpt" or not row["equivalent"]:
            continue
        peer = by_name[row["equivalent"]]
        more = "less" if row["memory_vs_equivalent"] < 1 else "more"
        low, high = row["time_vs_equivalent_min_max"]
        measured = f"{row['time_vs_equivalent']:.2f}x [{low:.3f}..{high:.3f}] its time"  # 3 places: 0.996 is not 1
        work = row["total_flops"] / peer["total_flops"]  # exact
        if mode == "fast":
            time_text = FAST_TIMING
        elif not trusted:
            time_text = (f"time inconclusive on this machine ({measured}, unread: the checks above failed); "
                         f"by FLOPs {work:.3f}x its work")
        elif low > 1 or high < 1:
            time_text = f"{measured}: {'slower' if low > 1 else 'faster'} in every repeat, for {work:.3f}x its FLOPs"
        else:
            time_text = f"{measured} (the repeats straddle 1: within the noise), for {work:.3f}x its FLOPs"
        print(f"  {row['name']:<20} {row['memory_vs_equivalent']:.2f}x the peak live bytes of "
              f"{row['equivalent']} ({more}); {time_text}")


# %%
checks = sanity_ratios(cfg, batch, seq, args.device, args.seed, repeats)
claims = sanity_claims(args.mode, checks, by_name)
print("\nthe checks before any time is read: recomputation is never faster than none, inside one implementation")
for claim in claims.values():
    print(f"  {claim.text}")
trusted = all(claim.conclusive for claim in claims.values())
pair_lines(args.mode, rows, trusted)

# %% [markdown]
# ## The figure
#
# Three panels, one bar per run in table order: peak live bytes, recompute GFLOP and step time (with
# the spread of the repeats; the grey line is plain autograd's median; its title says when the checks
# above found the timing inconclusive).

# %%
names = [row["name"] for row in rows][::-1]  # top to bottom in table order
colors = [KIND_COLORS[by_name[n]["kind"]] for n in names]
fig, axes = plt.subplots(1, 3, figsize=(15, 6), sharey=True)
panels = [("peak live (MiB)", lambda r: mib(r["peak_live_bytes"]), "{:.1f}"),
          ("recompute GFLOP", lambda r: r["recompute_flops"] / 1e9, "{:.3f}"),
          (f"step time (ms, measured: median, bar min..max of {repeats})" + (f"\n{FAST_TIMING}" if fast else "" if
                                                                              trusted else "\ninconclusive on this machine"),
           lambda r: r["step_seconds"] * 1e3, "{:.1f}")]
for ax, (title, value, fmt) in zip(axes, panels):
    values = [value(by_name[n]) for n in names]
    ax.barh(range(len(names)), values, color=colors)
    ends = values
    if ax is axes[2]:  # the spread of each time over the repeats
        spreads = [[1e3 * t for t in by_name[n]["step_seconds_min_max"]] for n in names]
        ax.errorbar(values, range(len(names)), fmt="none", ecolor="black", capsize=2, lw=0.8,
                    xerr=[[v - low for v, (low, _) in zip(values, spreads)],
                          [high - v for v, (_, high) in zip(values, spreads)]])
        ends = [high for _, high in spreads]
    for y, (v, end) in enumerate(zip(values, ends)):
        ax.annotate(fmt.format(v), (end, y), va="center", fontsize=7, xytext=(3, 0), textcoords="offset points")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, max(ends) * 1.2 if max(ends) > 0 else 1)
    ax.grid(axis="x", alpha=0.3)
axes[2].axvline(by_name["autograd"]["step_seconds"] * 1e3, color="0.4", lw=0.8)  # plain autograd's median
axes[0].set_yticks(range(len(names)), names, fontsize=8)
kinds = {row["kind"] for row in rows}  # Hugging Face's rows only where transformers runs this shape
handles = [matplotlib.patches.Patch(color=color, label="Hugging Face" if kind == "hf" else kind)
           for kind, color in KIND_COLORS.items() if kind in kinds]
axes[0].legend(handles=handles, fontsize=8, loc="lower right")
peers = "torch.utils.checkpoint" + (" and Hugging Face" if "hf" in kinds else "")
fig.suptitle(f"picockpt beside {peers}: L={cfg.layers}, h={cfg.hidden}, batch {batch} x {seq}, "
             f"{cfg.dtype}, on {device_name(args.device)}")
fig.tight_layout()
path = save_figure(fig, "10_torch_checkpoint_side_by_side")
wrote(path)

# %% [markdown]
# ## Exercises
#
# Both for the `small` model ($L = 8$, $h = 128$, $f = 448$) at batch 4 × 128 tokens.
#
# **1.** How many GFLOP of recompute does `torch.utils.checkpoint` per layer skip against picockpt's
# `full`? (One down projection is a $B T \times f$ by $f \times h$ matmul, at 2 FLOPs per multiply-add.)

# %%
answer = 0.4698  # GFLOP

# %%
exercise = small()
down = tail_flops(exercise, 4, 128)  # one layer's down projection
check("GFLOP that torch's per-layer checkpoint does not recompute (small, 4 x 128)", answer,
      exercise.layers * down / 1e9, rel=0.001,
      why=f"L·2·B·T·f·h = {exercise.layers}·2·512·{exercise.ffn}·{exercise.hidden} = {exercise.layers * down:,} FLOPs: "
          f"the last tensor each recomputed layer's backward needs is the down projection's input")

# %% [markdown]
# **2.** `checkpoint_sequential(layers, 4)` on the same 8 layers: how many GFLOP does it recompute?
# Its last segment is never checkpointed, and each recomputed segment stops before its last layer's
# down projection.

# %%
answer = 1.384  # GFLOP

# %%
one_layer = sum(layer_flops(exercise, 4, 128).values())
sequential_recompute = 3 * (2 * one_layer - down)
check("GFLOP recomputed by checkpoint_sequential(4) (small, 4 x 128)", answer, sequential_recompute / 1e9,
      rel=0.001, why=f"3 of 4 segments come back, each 2 layers minus one down projection: 3·(2·{one_layer:,} - "
                     f"{down:,}) = {sequential_recompute:,} FLOPs (picockpt's every:2 recomputes "
                     f"{step_flops(exercise, 4, 128, 'every:2')['recompute']:,}: every layer, whole)")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"peak live MiB picockpt full / torch per layer":
                      f"{mib(by_name['picockpt full']['peak_live_bytes']):.1f}/"
                      f"{mib(by_name['torch checkpoint per layer']['peak_live_bytes']):.1f}",
                      "time picockpt full / torch per layer": FAST_TIMING if fast else
                      f"{by_name['picockpt full']['time_vs_equivalent']:.2f} "
                      f"[{by_name['picockpt full']['time_vs_equivalent_min_max'][0]:.2f}.."
                      f"{by_name['picockpt full']['time_vs_equivalent_min_max'][1]:.2f}]"
                      + ("" if trusted else " (inconclusive: the timing checks failed)"),
                      "timing check: full / none": claims["picockpt full / picockpt none"].short,
                      "torch skips the down projections": skips_down}}

# %% [markdown]
# # Lesson 24: tensor-parallel dropout masks, and shared experts
#
# **Dropout under tensor parallelism.** A tensor-parallel rank holds part of a layer: its heads of the
# attention, its columns of the MLP, and, under sequence parallelism, its tokens of the residual stream.
# Two kinds of dropout mask follow:
#
# - on a **replicated** tensor (the residual branch after the all-reduce, without sequence parallelism)
#   every rank holds the same values, and the masks **must agree**: different masks would make the
#   replicas drift apart;
# - on a **split** tensor (the attention probabilities of a rank's heads; with sequence parallelism, a
#   rank's tokens of the residual branch) each rank holds different elements, and the masks **must
#   differ**: one mask reused by every rank would drop the same positions in head $j$ and head
#   $j + H/t$, correlating what should be independent.
#
# Megatron-LM does it with two generators (`megatron/core/tensor_parallel/random.py`):
# `model_parallel_cuda_manual_seed(seed)` seeds the default CUDA generator with `seed` on every
# tensor-parallel rank, and registers in `CudaRNGStatesTracker` a generator seeded
# `seed + 2718 + tensor_model_parallel_rank`. The attention dropout runs inside
# `get_cuda_rng_tracker().fork()` (`DotProductAttention.forward`, when sequence parallelism is off); with
# sequence parallelism the whole `TransformerBlock.forward` runs inside the fork, so the sequence-split
# residual dropout differs per rank too. Its recomputation (`CheckpointFunction`) saves the CPU state,
# the default CUDA state **and** every tracker state before the forward and restores all three before
# recomputing: a recomputed mask is the first one only if each generator it was drawn from is replayed.
#
# picockpt chooses otherwise (`picockpt/parallel`, the tensor-parallel RNG): every rank starts from the
# caller's generator state and draws the **whole** mask the single process would draw, keeping its
# slice. Replicated masks agree, split masks are different slices of one draw, and every mask equals the
# single process's, so the gradients equal the single process's (up to the order of the all-reduce's
# sums). One generator, replayed by the engine, is all recomputation needs; the price is that each rank
# draws $t$ times the random numbers it keeps.
#
# **Shared experts.** A mixture of experts may add a shared expert every token goes through
# (`Config.shared_expert_ffn`, an ungated SwiGLU MLP as in DeepSeek-V2/V3). It stores its two projections
# and its product, $3 \cdot N \cdot f_s$ elements a layer for $N$ tokens; the `shared_experts` policy drops
# them and projects again in the backward (Megatron-LM's `--recompute-modules shared_experts` recomputes
# the shared experts too, by a normal checkpoint of the module). Measured below against the closed form.
#
# **Run it** as a script, `python lessons/24_tensor_parallel_rng_and_shared_experts.py` (the CPU run: 2
# gloo ranks, under a minute; `--fast` for seconds, `--large --device cuda` for a bigger shape on a GPU),
# or step through this notebook, where the same flags come from the environment variable
# `PICOCKPT_LESSON_ARGS` (unset: the CPU run).

# %%
import multiprocessing

import matplotlib.pyplot as plt
import torch

from _check import check
from _lesson import (FAST_TIMING, choose, clock_words, compute_clock, interleaved_seconds, large, lesson_args,
                     paired_ratios, shape_line, small, spawning_ranks, timed_claim, timing_verdict, wrote)
from picockpt import Config, init_params, loss_and_grads, parallel
from picockpt.planning.step_forms import layer_inventory, predicted_peak_bytes, rebuild_flops, step_flops
from picockpt.measurement.measure import PutRecorder, make_batch
from picockpt.ops import dropout_mask
from picockpt.teaching.plotting import mib, save_figure
from picockpt.measurement.tracker import Tracker
from picockpt.parallel import Layout

DROPOUT = 0.1
MEGATRON_OFFSET = 2718  # model_parallel_cuda_manual_seed: the tensor-parallel seed is seed + 2718 + rank
START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
SCHEMES = ("one generator, slice-sized draws", "Megatron: tracker seeded per rank", "picockpt: whole mask, sliced")
SHARED = frozenset({"moe.shared_gate", "moe.shared_up", "moe.shared_act"})
STEPS_PER_SAMPLE = 2  # steps in one timed sample: a moment another program takes weighs half as much

# %% [markdown]
# ## Two ranks' masks, three ways
#
# `rank_masks` draws what rank 0 and rank 1 of $t = 2$ would draw for one mask of `shape`, split along
# `dim` (None: a replicated tensor), under each scheme: both ranks drawing their slice's size from the
# same generator state (what happens with no tracker at all), Megatron's per-rank seed, and picockpt's
# whole-then-slice. The generator is put back afterwards.

# %%
def rank_masks(scheme, shape, dim, seed, t=2):
    """[mask of rank r for r < t] of one dropout mask of `shape` split along dim (None: replicated)."""
    state = torch.get_rng_state()
    part = list(shape)
    if dim is not None:
        part[dim] //= t
    masks = []
    for r in range(t):
        if scheme == SCHEMES[0] or dim is None and scheme == SCHEMES[1]:  # the default generator, same state
            torch.manual_seed(seed)
            masks.append(dropout_mask(tuple(part), DROPOUT, "cpu"))
        elif scheme == SCHEMES[1]:  # the tracker's generator: seed + 2718 + rank
            torch.manual_seed(seed + MEGATRON_OFFSET + r)
            masks.append(dropout_mask(tuple(part), DROPOUT, "cpu"))
        else:  # the single process's whole mask, this rank's slice
            torch.manual_seed(seed)
            whole = dropout_mask(tuple(shape), DROPOUT, "cpu")
            masks.append(whole if dim is None else whole.narrow(dim, r * part[dim], part[dim]))
    torch.set_rng_state(state)
    return masks


def single_mask(shape, seed):
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    mask = dropout_mask(tuple(shape), DROPOUT, "cpu")
    torch.set_rng_state(state)
    return mask


def agreement(a, b):
    return (a == b).float().mean().item()


def regions(cfg, batch, seq):
    """(label, the whole tensor's shape, the dim a rank's share is cut along) of each dropout site."""
    return (("residual branch, no sp (replicated)", (batch, seq, cfg.hidden), None),
            ("residual branch, sp (tokens split)", (batch, seq, cfg.hidden), 1),
            ("attention probs (heads split)", (batch, cfg.heads, seq, seq), 1))


# %%
args = lesson_args()
print(f"lesson 24, dropout p={DROPOUT}, t = 2")
mask_shape = choose(args.mode, fast=(2, 32), cpu=(4, 128), large=(4, 1024))
mask_cfg = small()
table = {}
for label, whole, dim in regions(mask_cfg, *mask_shape):
    for scheme in SCHEMES:
        r0, r1 = rank_masks(scheme, whole, dim, args.seed)
        single = single_mask(whole, args.seed)
        joined = r0 if dim is None else torch.cat([r0, r1], dim)  # the whole mask the two ranks applied
        as_single = torch.equal(joined, single) and (dim is not None or torch.equal(r1, single))
        table[label, scheme] = (agreement(r0, r1), as_single)
print(f"{'dropout site':<38}{'scheme':<36}{'rank 0 = rank 1 on':>20}{'= single process':>18}")
for (label, scheme), (agree, as_single) in table.items():
    print(f"{label:<38}{scheme:<36}{agree:>20.1%}{str(as_single):>18}")
print(f"two independent masks agree on 1 - 2p(1-p) = {1 - 2 * DROPOUT * (1 - DROPOUT):.0%} of the elements")

# %% [markdown]
# Slice-sized draws from one generator state give every rank the same mask: right for the replicated
# branch, wrong for split tensors (100% agreement, heads $j$ and $j + H/t$ dropped alike). Megatron's
# tracker makes the split masks independent (about $1 - 2p(1-p)$ agreement, as two independent masks) and
# keeps the replicated ones on the shared default generator; its masks are not the single process's.
# picockpt's slices agree where they must, differ as independent draws where they must, and put
# together they *are* the single process's mask.
#
# ## Measured: tensor-parallel gradients with dropout, against one process
#
# `parallel.loss_and_grads` runs the step on 2 gloo ranks under `full` (every layer recomputed, every
# mask drawn twice), from the same generator state as the single process. The comparison row is the
# single process with another seed: what a wrong mask costs.

# %%
def tp_shape(mode):
    """(Config, batch, seq): heads, kv heads, ffn and seq divisible by 2; eager attention with dropout. The
    ranks run on the CPU (gloo) in every mode: a GPU run would need one GPU per rank."""
    return choose(mode,
                  fast=(Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=64,
                               dropout=DROPOUT), 2, 16),
                  cpu=(Config(vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, ffn=176, max_seq=128,
                              dropout=DROPOUT), 2, 64),
                  large=(Config(vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, ffn=176, max_seq=128,
                                dropout=DROPOUT), 2, 64))


def max_difference(grads, reference):
    """max |g - g_ref| / max |g_ref| over all parameters."""
    scale = max(reference[k].abs().max().item() for k in reference)
    return max((grads[k].double() - reference[k].double()).abs().max().item() for k in reference) / scale


def tensor_parallel_against_one(cfg, batch, seq, device, seed, sps):
    """{sp: max relative gradient difference, tp=2 against one process}, and one process against one
    process with other masks."""
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)
    torch.manual_seed(seed)
    _, single = loss_and_grads(params, cfg, input_ids, targets, "full")
    torch.manual_seed(seed + 1)
    _, other = loss_and_grads(params, cfg, input_ids, targets, "full")
    out = {}
    for sp in sps:
        torch.manual_seed(seed)
        with spawning_ranks():  # the ranks need picockpt, not this lesson's cells
            _, grads, _ = parallel.loss_and_grads(params, cfg, input_ids, targets, "full", Layout(tp=2, sp=sp),
                                                  device=device.type, start_method=START)
        out[sp] = max_difference(grads, single)
    return out, max_difference(other, single)


# %%
tcfg, tbatch, tseq = tp_shape(args.mode)
print(f"tensor parallel, t = 2 gloo ranks, policy full: {shape_line(tcfg, tbatch, tseq, torch.device('cpu'))}")
sps = choose(args.mode, fast=(True,), cpu=(False, True), large=(False, True))
tp_diff, other_masks = tensor_parallel_against_one(tcfg, tbatch, tseq, torch.device("cpu"), args.seed, sps)
for sp, diff in tp_diff.items():
    print(f"  tp=2{', sp' if sp else '    '}: max |g - g_single| / max |g_single| = {diff:.2e}")
print(f"  one process, other dropout seed:         {other_masks:.2e}")
tp_matches = all(diff < 1e-5 for diff in tp_diff.values()) and other_masks > 1e-2

# %% [markdown]
# The tensor-parallel gradients sit at fp32 roundoff from the single process's (the all-reduce adds the
# ranks' partial sums in another order), four or more orders of magnitude below what other masks
# change. Megatron's tracker could not pass this comparison, and is not meant to: its split masks are
# right, but they are not the single process's (the table above), and other masks move the gradients by
# the last row's amount.
#
# ## Shared experts: what they store, and what dropping them costs
#
# `shared_rows` measures, in one step, the bytes every layer put in the store for the shared expert
# (`PutRecorder` sees every put), and, under the `shared_experts` policy, the store's peak and the FLOPs
# the backward recomputes (the tracker's "recompute" phase), each beside its closed form.

# %%
def moe_shape(mode):
    return choose(mode, fast=(small(layers=2, experts=4), 2, 32), cpu=(small(experts=4), 4, 128),
                  large=(large(layers=4, experts=8), 1, 1024))


def shared_rows(cfg, batch, seq, device, seed, widths):
    """{f_s: dict of measured and predicted bytes and FLOPs} for each shared-expert width."""
    out = {}
    for fs in widths:
        c = cfg.replace(shared_expert_ffn=fs)
        params = init_params(c, seed=seed, device=device)
        input_ids, targets = make_batch(c, batch, seq, device, seed)
        recorder = PutRecorder()
        _, stored = loss_and_grads(params, c, input_ids, targets, "none", tracker=recorder)
        measured = sum(n for (layer, name), n in recorder.puts.items() if layer == 0 and name in SHARED)
        predicted = sum(row[2] for name, row in layer_inventory(c, batch, seq).items() if name in SHARED)
        row = dict(measured=measured, predicted=predicted)
        if fs:
            with Tracker(device) as tracker:
                _, dropped = loss_and_grads(params, c, input_ids, targets, "shared_experts", tracker=tracker)
            row.update(peak=tracker.peak_logical, peak_predicted=predicted_peak_bytes(c, batch, seq, "shared_experts"),
                       saved=predicted_peak_bytes(c, batch, seq, "none") - tracker.peak_logical,
                       recompute=tracker.flops["recompute"],
                       recompute_predicted=step_flops(c, batch, seq, "shared_experts")["recompute"],
                       forward=step_flops(c, batch, seq)["forward"],
                       bitwise=all(torch.equal(dropped[k], stored[k]) for k in stored))
        out[fs] = row
    return out


# %%
mcfg, mbatch, mseq = moe_shape(args.mode)
widths = (0, mcfg.ffn // 4, mcfg.ffn // 2, mcfg.ffn)
print(f"shared expert, {mcfg.experts} experts top-{mcfg.experts_per_token}: "
      f"{shape_line(mcfg, mbatch, mseq, args.device)}")
shared = shared_rows(mcfg, mbatch, mseq, args.device, args.seed, widths)
print(f"{'f_s':>6}{'stored/layer':>14}{'closed form':>13}{'saved (peak)':>14}{'recompute MFLOP':>17}{'closed form':>13}"
      f"{'% of fwd':>10}{'grads bitwise':>15}")
for fs, row in shared.items():
    line = f"{fs:>6}{row['measured']:>14,}{row['predicted']:>13,}"
    if fs:
        line += (f"{row['saved']:>14,}{row['recompute'] / 1e6:>17.2f}{row['recompute_predicted'] / 1e6:>13.2f}"
                 f"{row['recompute'] / row['forward']:>10.1%}{str(row['bitwise']):>15}")
    print(line)
shared_exact = all(r["measured"] == r["predicted"] for r in shared.values()) and all(
    r["peak"] == r["peak_predicted"] and r["recompute"] == r["recompute_predicted"]
    for r in shared.values() if "peak" in r)

# %% [markdown]
# The store holds exactly $3 N f_s$ elements a layer for the shared expert, linear in its width. The
# `shared_experts` policy takes them out of the peak and pays two of the shared expert's three
# projections again ($2 \cdot N \cdot h \cdot 2 f_s$ FLOPs a layer, `rebuild_flops`); its down projection
# needs no rerun, since its input (the product) is rebuilt elementwise. Gradients stay bitwise.

# %% [markdown]
# ## Timed: the experts' rebuild against the shared expert's, at the same FLOPs and bytes
#
# Counting says what a rebuild costs in FLOPs; the clock says what it costs here. Two policies drop the
# same bytes for the same FLOPs when the shared expert is $k$ experts wide ($f_s = k f$): `moe` drops every
# expert's gate/up projections and product ($3 N k f$ elements a layer) and runs the experts' gate/up
# projections again ($2 N k \cdot h \cdot 2 f$ FLOPs), `shared_experts` drops the shared expert's ($3 N f_s$)
# and runs its projections again ($2 N h \cdot 2 f_s$). The FLOPs and the stored peak are checked equal
# below (`step_flops`, `predicted_peak_bytes`, and the tracker). What differs is how the work is cut: the
# experts' rebuild gathers each expert's tokens and runs $E$ smaller matmuls; the shared expert's runs one
# over every token. Attention is `fused` here, so that the MLP, where the two rebuilds differ, is most of
# the step. The three steps (`none`, `moe`, `shared_experts`) are timed in interleaved repeats and
# each ratio is taken within a repeat (each sample two steps long); on the CPU with one thread the clock is
# the CPU time of this thread (`compute_clock`), which leaves out the moments a shared machine gives the core
# to another program.

# %%
def rebuild_timing(cfg, batch, seq, device, seed, repeats):
    """({policy: Spread of step seconds}, {policy: (recompute FLOPs, stored peak bytes)}) of one training step
    under none, moe and shared_experts, with a shared expert k experts wide (the two rebuilds equal in work)."""
    c = cfg.replace(shared_expert_ffn=cfg.experts_per_token * cfg.ffn)
    params = init_params(c, seed=seed, device=device)
    input_ids, targets = make_batch(c, batch, seq, device, seed)
    facts = {}
    for policy in ("none", "moe", "shared_experts"):
        with Tracker(device) as tracker:
            loss_and_grads(params, c, input_ids, targets, policy, tracker=tracker)
        facts[policy] = (tracker.flops["recompute"], tracker.peak_logical)
    steps = {policy: (lambda policy=policy: [loss_and_grads(params, c, input_ids, targets, policy)
                                             for _ in range(STEPS_PER_SAMPLE)])
             for policy in ("none", "moe", "shared_experts")}
    return interleaved_seconds(steps, device, repeats, clock=compute_clock(device)), facts, c


# %%
timed_repeats = choose(args.mode, fast=1, cpu=9, large=7)
step_time, rebuild_facts, tcfg_shared = rebuild_timing(mcfg.replace(attention="fused"), mbatch, mseq, args.device,
                                                       args.seed, timed_repeats)
total = {p: sum(step_flops(tcfg_shared, mbatch, mseq, p).values()) for p in rebuild_facts}
print(f"f_s = k f = {tcfg_shared.shared_expert_ffn}, {tcfg_shared.attention} attention: {timed_repeats} interleaved "
      f"samples of {STEPS_PER_SAMPLE} steps, {clock_words(compute_clock(args.device))}, median [min..max]")
print(f"{'policy':<16}{f'{STEPS_PER_SAMPLE} steps, ms':>26}{'recompute GFLOP':>17}{'stored peak':>14}{'predicted':>14}")
for policy, (flops, peak) in rebuild_facts.items():
    print(f"{policy:<16}{step_time[policy].text('{:.1f}', 1e3):>26}{flops / 1e9:>17.3f}{peak:>14,}"
          f"{predicted_peak_bytes(tcfg_shared, mbatch, mseq, policy):>14,}")
same_work = rebuild_facts["moe"] == rebuild_facts["shared_experts"] and total["moe"] == total["shared_experts"]
print(f"the two rebuilds recompute the same FLOPs and leave the same stored peak: {same_work}")
moe_claim = timed_claim(args.mode, paired_ratios(step_time["moe"], step_time["none"]), "moe / none, step time",
                        ">1", work=total["moe"] / total["none"])
print(moe_claim.text)
if moe_claim.conclusive:
    print(f"  recomputing the experts' projections made the step slower in every repeat, "
          f"{paired_ratios(step_time['moe'], step_time['none']).median - 1:+.1%} (median) for "
          f"{total['moe'] / total['none'] - 1:+.1%} FLOPs")
shared_claim = timed_claim(args.mode, paired_ratios(step_time["shared_experts"], step_time["none"]),
                           "shared_experts / none, step time", ">1", work=total["shared_experts"] / total["none"])
print(shared_claim.text)
if shared_claim.conclusive:
    print(f"  recomputing the shared expert made the step slower in every repeat, "
          f"{paired_ratios(step_time['shared_experts'], step_time['none']).median - 1:+.1%} (median) for "
          f"{total['shared_experts'] / total['none'] - 1:+.1%} FLOPs")
cut_ratio = paired_ratios(step_time["moe"], step_time["shared_experts"])
print(timing_verdict(args.mode, cut_ratio, "moe / shared_experts, step time (the same FLOPs and bytes)"))
if args.mode != "fast" and cut_ratio.excludes(1.0):
    print(f"  at the same FLOPs and bytes, the step that rebuilds the experts took {cut_ratio.median:.3f}x the one "
          f"that rebuilds the shared expert (median), "
          f"{'more' if cut_ratio.low > 1 else 'less'} in every repeat: how the rebuild is cut "
          f"({mcfg.experts} experts' gathers and smaller matmuls, or one matmul over every token) shows on this "
          f"machine's clock")

# %% [markdown]
# ## The figure

# %%
fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.8))
labels = [label for label, _, _ in regions(mask_cfg, *mask_shape)]
width = 0.26
colors = ("#937860", "#4C72B0", "#C44E52")
for j, scheme in enumerate(SCHEMES):
    values = [table[label, scheme][0] for label in labels]
    bars = left.bar([i + (j - 1) * width for i in range(len(labels))], values, width, color=colors[j], label=scheme)
    for bar, label in zip(bars, labels):
        if table[label, scheme][1]:
            left.annotate("= single", (bar.get_x() + width / 2, bar.get_height()), ha="center", va="bottom",
                          fontsize=6)
left.axhline(1 - 2 * DROPOUT * (1 - DROPOUT), color="0.2", ls=":", lw=1, label="independent masks: 1 − 2p(1−p)")
left.set_xticks(range(len(labels)), [label.replace(" (", "\n(") for label in labels], fontsize=7)
left.set_ylim(0.7, 1.08)
left.set_ylabel("elements where rank 0's and rank 1's masks agree")
left.set_title("must agree (replicated) or differ (split)", fontsize=10)
left.legend(fontsize=7, loc="lower right")
names = [f"tp=2{', sp' if sp else ''}\nvs one process" for sp in tp_diff] + ["one process,\nother masks"]
values = list(tp_diff.values()) + [other_masks]
bars = middle.bar(names, values, color=["#C44E52"] * len(tp_diff) + ["0.6"], log=True)
for bar, value in zip(bars, values):
    middle.annotate(f"{value:.1e}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=8)
middle.set_ylim(min(values) / 10, 10)
middle.set_ylabel("max |g − g_single| / max |g_single|")
middle.set_title("measured: full recompute with dropout, 2 gloo ranks", fontsize=10)
fss = list(shared)
right.plot(fss, [mib(shared[f]["predicted"]) for f in fss], "-", color="0.5", label="closed form 3·N·f_s·e")
right.plot(fss, [mib(shared[f]["measured"]) for f in fss], "o", color="#4C72B0", label="measured (store puts)")
right.set_xlabel("shared expert width f_s")
right.set_ylabel("MiB the shared expert stores, per layer")
twin = right.twinx()
twin.plot(fss[1:], [shared[f]["recompute"] / 1e9 for f in fss[1:]], "s--", color="#DD8452",
          label="recomputed under shared_experts (GFLOP/step)")
twin.set_ylabel("GFLOP recomputed per step", color="#DD8452")
twin.set_ylim(bottom=0)
handles = right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
right.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper left")
right.set_title("shared expert: stored bytes, and their price", fontsize=10)
right.grid(alpha=0.3)
fig.suptitle(f"Tensor-parallel dropout (p={DROPOUT}, t=2) and shared experts ({mcfg.experts} experts, top-"
             f"{mcfg.experts_per_token}, batch {mbatch} x {mseq}, {mcfg.dtype})")
fig.tight_layout()
path = save_figure(fig, "24_tensor_parallel_rng_and_shared_experts")
wrote(path)

# %% [markdown]
# ## Exercises
#
# **1.** Under Megatron's tracker, on what fraction of the elements do rank 0's and rank 1's attention
# dropout masks agree, with $p = 0.1$?

# %%
answer = 0.82

# %%
r0, r1 = rank_masks(SCHEMES[1], (4, 8, 128, 128), 1, seed=0)
check("agreement of two ranks' attention masks under per-rank seeds", answer, agreement(r0, r1),
      why=f"independent draws: P(both keep) + P(both drop) = (1-p)² + p² = {1 - 2 * DROPOUT * (1 - DROPOUT):.2f}; "
          f"measured on two (4, 4, 128, 128) masks seeded 0 + 2718 + rank: {agreement(r0, r1):.4f}")

# %% [markdown]
# **2.** The `small` model with 4 experts (top-2) and a shared expert of width $f_s = 224$, fp32, batch
# 4 × 128: how many bytes does the shared expert store per layer?

# %%
answer = 1_376_256  # bytes

# %%
exercise = small(experts=4, shared_expert_ffn=224)
rows = {name: row for name, row in layer_inventory(exercise, 4, 128).items() if name in SHARED}
check("bytes the shared expert stores per layer", answer, sum(r[2] for r in rows.values()), rel=0,
      why=f"{', '.join(rows)}: 3 tensors of N·f_s = 512·224 fp32 elements (layer_inventory)")

# %% [markdown]
# **3.** And how many FLOPs a layer does the `shared_experts` policy spend in the backward to project
# them again? (The gate and up projections, $h \to f_s$ each, for every token.)

# %%
answer = 58_720_256  # FLOPs per layer

# %%
check("FLOPs per layer to rebuild the shared expert", answer, rebuild_flops(exercise, 4, 128, SHARED), rel=0,
      why=f"2·N·h·2f_s = 2·512·{exercise.hidden}·2·224 (rebuild_flops); the down projection is not rerun")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"tp=2 grads = single process (fp32 roundoff)": tp_matches,
                      "picockpt masks = single process's": all(table[label, SCHEMES[2]][1] for label in labels),
                      "shared expert stored and recomputed = closed form": shared_exact,
                      "tp=2 max rel diff": f"{max(tp_diff.values()):.1e}",
                      "moe, shared_experts: same recompute FLOPs and peak": same_work,
                      "moe / none step time": moe_claim.short,
                      "shared_experts / none step time": shared_claim.short,
                      "moe / shared_experts step time":
                          FAST_TIMING if args.mode == "fast" else cut_ratio.text("{:.3f}")}}

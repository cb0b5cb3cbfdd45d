# %% [markdown]
# # Lesson 19: ZeRO and recomputation: sharded model state, and the gathers a recomputed layer needs
#
# Data parallelism keeps a whole copy of the model state on every rank. ZeRO (Rajbhandari et al. 2020,
# "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 5) shards it over the $N_d$
# data-parallel ranks in three stages. For $\Psi$ parameters trained with Adam in mixed precision they count
# $2\Psi$ bytes of fp16 parameters, $2\Psi$ of fp16 gradients and $K\Psi$ of optimizer state ($K = 12$: an
# fp32 copy of the parameters, the momentum, the variance). Per rank:
#
# | stage | shards | bytes per rank | their 7.5B example, $N_d = 64$ |
# |---|---|---|---|
# | 0 (data parallel) | nothing | $(2 + 2 + K)\Psi$ | 120 GB |
# | 1 | optimizer state | $2\Psi + 2\Psi + K\Psi/N_d$ | 31.4 GB |
# | 2 | and gradients (reduce-scatter instead of all-reduce) | $2\Psi + (2 + K)\Psi/N_d$ | 16.6 GB |
# | 3 | and parameters (all-gathered around each use) | $(2 + 2 + K)\Psi/N_d$ | 1.9 GB |
#
# picockpt shards flat units (the embedding, each layer, the head), padded to a multiple of $N_d$, as FSDP1's
# FlatParameter and DeepSpeed do (`picockpt/parallel/data_parallel/zero_params.py`), and steps the single
# process's AdamW (`picockpt/measurement/train.py`) on each rank's shards. ZeRO runs inside the one rank step of every
# layout (`picockpt/parallel/rank.py`; `data_parallel/zero_shards.py` takes the place of the gradient buckets and
# the whole weights), so it stacks on tensor, pipeline, context and expert parallelism: a rank shards what it
# holds of its stage (its tensor-parallel slices too) over its data-parallel group, the dp x ep x cp ranks (an
# expert over the dp x cp ranks that hold it). This lesson runs it over dp alone, and then once beside tp and pp.
#
# Under stage 3 a layer's parameters exist whole only around their uses: gathered before its forward, freed
# after, gathered again for its backward, and, if the policy recomputes it, once more for the recompute sweep,
# unless the sweep keeps them for the backward (`keep_gathered`): one gather fewer per recomputed layer, for
# holding a whole sweep's layers at once (C of them under `every:C`). torch's FSDP2 gives that saving without a
# flag, whichever way the checkpoint and the FSDP unit nest; the mechanism differs:
#
# * **torchtitan's nesting, `fully_shard(checkpoint_wrapper(block))`**: `torchtitan/models/llama3/parallelize.py`
#   applies activation checkpointing first (`torchtitan/distributed/activation_checkpoint.py` wraps each block in
#   torch's `checkpoint_wrapper`), then `torchtitan/distributed/fsdp.py`'s `apply_fsdp_to_decoder` calls
#   `fully_shard` on each wrapped block. The unit is the wrapper; its recompute runs only the block inside, so
#   FSDP's forward hooks never fire during it. The backward's one gather comes from the pre-backward hook that
#   FSDP registered on the unit's outputs in the forward (torch 2.13, `_fsdp_state.py`:
#   `_register_pre_backward_hook`): autograd runs it when the output's gradient arrives, before any of the
#   block's nodes unpacks the checkpoint's saved tensors, which is what starts the recompute.
# * **the opposite nesting, `checkpoint(fully_shard(block))`**: the recompute reruns the unit's forward, FSDP's
#   hooks included, inside the backward. The same pre-backward hook has gathered the unit by then;
#   `_fsdp_state.py`'s `_pre_forward` and `_post_forward` see the `PRE_BACKWARD` state and leave it gathered,
#   and `_fsdp_param_group.py`'s `post_forward` carries the guard written for this nesting (`if not is_bw()`,
#   commented "for AC(fully_shard(model))"): a recompute that reaches it neither reshards the unit nor adds it
#   to the order the backward prefetches by.
#
# `picockpt/parallel/data_parallel/fsdp_peer.py` builds both on the reference model, and the section "torch's
# FSDP2 beside it" counts their gathers. FSDP2's `reshard_after_forward=False` is the same trade one step
# earlier: keep the forward's gather until the backward.
#
# What to look at (measured on 2 gloo ranks, and 8 in the stacked section, every number equal to the closed
# forms of `picockpt/parallel/data_parallel/zero_forms.py` to the byte):
#
# * **model state**: a rank's parameter, gradient and optimizer bytes under each stage.
# * **gathers**: stage 3's all-gather bytes per phase under `none`, `full` and `every:2`, with and without
#   `keep_gathered`, and the most gathered bytes alive at once (without prefetch).
# * **FSDP2's gathers**: torch's `fully_shard` under both nestings, per phase, beside picockpt's.
# * **training**: a few steps of ZeRO-3 training, a new batch each step, against one process's training.
# * **beside tp and pp**: ZeRO-3 on $dp \times tp \times pp = 2 \times 2 \times 2$ ranks, every rank's bytes
#   against its closed form, and what more pipeline micro-batches cost in gathers.
#
# **Run it** as a script, `python lessons/19_zero_and_recomputation.py` (the CPU run: 2 gloo ranks, then 8,
# about a minute; `--fast` for less, what the tests run), or step through this notebook, where the same flags
# come from the environment variable `PICOCKPT_LESSON_ARGS` (unset: the CPU run).

# %%
import multiprocessing

import matplotlib.pyplot as plt
import numpy as np
import torch

from _check import check
from _lesson import choose, large, lesson_args, ranks_device, shape_line, small, spawning_ranks, wrote
from picockpt import Config, init_params, loss_and_grads
from picockpt.measurement.measure import make_batch, max_relative_diff
from picockpt.parallel import Layout, ParallelJob, run_jobs, run_ranks
from picockpt.parallel.training import zero_train
from picockpt.parallel.data_parallel.fsdp_peer import fsdp2_rank_steps
from picockpt.parallel.data_parallel.zero_forms import gather_uses, model_state_bytes, zero_paper_bytes
from picockpt.parallel.pipeline_parallel.pp_forms import ChunkForms
from picockpt.parallel.report_forms import zero_stage_forms
from picockpt.teaching.plotting import PHASE_COLORS, mib, save_figure
from picockpt.recompute.policy import parse_policy
from picockpt.measurement.train import MarkovTask, make_optimizer, train_step

DP = 2
CHOICES = (  # (label, stage, policy, keep_gathered)
    ("1", 1, "full", False), ("2", 2, "full", False), ("3 none", 3, "none", False),
    ("3 full", 3, "full", False), ("3 full keep", 3, "full", True),
    ("3 every:2", 3, "every:2", False), ("3 every:2 keep", 3, "every:2", True),
)
PHASES = ("forward", "recompute", "backward", "optimizer")
START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


# %% [markdown]
# ## The shapes
#
# The `small` preset (or smaller at `--fast`), fp32, $B/2$ sequences per rank.

# %%
def shape(mode):
    return choose(mode, fast=(small(layers=2, hidden=64, ffn=128), 2, 16), cpu=(small(), 4, 64),
                  large=(large(layers=8), 2, 512))


# %% [markdown]
# ## One launch of 2 ranks, every choice
#
# Each job is a `picockpt.parallel.ParallelJob` with `zero=` (the job that takes `tp=`, `pp=`, `cp=`, `ep=` beside
# it), one training step (forward, backward, AdamW) on the same batch, and `run_jobs` runs them all in one launch;
# stage 3 without prefetch, so the gathered bytes alive at once are those of the units in use or kept (stages 1 and
# 2 gather no parameters). A report's `zero_bytes_by_kind` is ZeRO's own traffic (its all-gathers and reductions)
# per phase; `comm_bytes` stays the layers' own collectives (none here).

# %%
def measure(cfg, batch, seq, device):
    params = init_params(cfg, seed=0)
    input_ids, targets = make_batch(cfg, batch, seq, "cpu", seed=0)
    state = torch.manual_seed(0).get_state()
    jobs = [ParallelJob(params, cfg, input_ids, targets, policy,
                        Layout(dp=DP, zero=stage, keep_gathered=keep, prefetch=stage != 3), steps=1, rng_state=state)
            for _, stage, policy, keep in CHOICES]
    with spawning_ranks():  # the ranks need picockpt, not this lesson's cells
        results = run_jobs(jobs, device=device.type, start_method=START, timeout_s=300)
    return {label: reports for (label, *_), (_, _, reports) in zip(CHOICES, results)}


def moved(report, phase):
    """Bytes ZeRO's collectives moved on a rank in one phase, every kind together."""
    return sum(report["zero_bytes_by_kind"][phase].values())


# %%
args = lesson_args()
cfg, batch, seq = shape(args.mode)
print(f"lesson 19, ZeRO on {DP} ranks: {shape_line(cfg, batch, seq, args.device)}")
reports = measure(cfg, batch, seq, ranks_device(args.device, DP))
keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "peak_activation_bytes")
exact = all(r[key] == r[f"predicted_{key.replace('peak_', '')}"] for ranks in reports.values() for r in ranks
            for key in keys) and all(r["zero_bytes_by_kind"] == r["predicted_zero_bytes_by_kind"] and
                                     r["gathered_peak_bytes"] == r["predicted_gathered_peak_bytes"]
                                     for ranks in reports.values() for r in ranks)
print(f"\nrank 0, bytes (every one equal to its closed form on both ranks: {exact}):")
print(f"{'stage, policy':<17}{'params':>10}{'grads':>10}{'optimizer':>11}{'stored peak':>13}{'gathered peak':>15}"
      + "".join(f"{phase:>11}" for phase in PHASES))
for label, (r, _) in reports.items():
    print(f"{label:<17}{r['param_bytes']:>10,}{r['grad_bytes']:>10,}{r['optimizer_bytes']:>11,}"
          f"{r['peak_activation_bytes']:>13,}{max(r['gathered_peak_bytes'].values()):>15,}"
          + "".join(f"{moved(r, phase):>11,}" for phase in PHASES))
layer_bytes = reports["3 full"][0]["zero_bytes_by_kind"]["recompute"]["all_gather"] // cfg.layers
print(f"one layer gathered: {layer_bytes:,} bytes; under full the backward gathers every layer again "
      f"({reports['3 full'][0]['zero_bytes_by_kind']['backward']['all_gather']:,} bytes), with keep_gathered "
      f"not at all ({reports['3 full keep'][0]['zero_bytes_by_kind']['backward'].get('all_gather', 0):,})")

# %% [markdown]
# Left: a rank's model state per stage. Right: stage 3's bytes per phase (gathers, and the backward's
# reduce-scatter of every gradient), and the most gathered bytes alive at once (black marks, right axis).

# %%
def plot(cfg, batch, seq, reports):
    fig, (state_ax, comm_ax) = plt.subplots(1, 2, figsize=(14, 5))
    stages = ("1", "2", "3 full")
    bottom = np.zeros(len(stages))
    for key, color in (("param_bytes", "#4C72B0"), ("grad_bytes", "#DD8452"), ("optimizer_bytes", "#55A868")):
        values = np.array([mib(reports[label][0][key]) for label in stages])
        state_ax.bar(range(len(stages)), values, 0.6, bottom=bottom, color=color, label=key.replace("_", " "))
        bottom += values
    state_ax.set_xticks(range(len(stages)), [f"stage {label[0]}" for label in stages])
    state_ax.set_ylabel("MiB per rank")
    state_ax.set_title("model state per rank (fp32: 4 + 4 + 8 bytes a parameter, sharded by stage)", fontsize=10)
    labels = [label for label, stage, *_ in CHOICES if stage == 3]
    x, bottom = np.arange(len(labels)), np.zeros(len(labels))
    for phase in ("forward", "recompute", "backward"):
        values = np.array([mib(moved(reports[label][0], phase)) for label in labels])
        comm_ax.bar(x, values, 0.6, bottom=bottom, color=PHASE_COLORS[phase], label=phase)
        bottom += values
    peak_ax = comm_ax.twinx()
    peak_ax.plot(x, [mib(max(reports[label][0]["gathered_peak_bytes"].values())) for label in labels], "_",
                 color="black", markersize=22, mew=3, label="gathered bytes alive at once")
    peak_ax.set_ylim(0, peak_ax.get_ylim()[1] * 1.3)
    peak_ax.set_ylabel("MiB gathered at once")
    comm_ax.set_xticks(x, labels, fontsize=8)
    comm_ax.set_ylabel("MiB one rank's collectives move")
    comm_ax.set_title("stage 3: all-gathers and the gradients' reduce-scatter per phase", fontsize=10)
    for ax in (state_ax, comm_ax):
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="upper left")
    peak_ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"ZeRO on {DP} gloo ranks: L={cfg.layers}, h={cfg.hidden}, f={cfg.ffn}, V={cfg.vocab}, batch "
                 f"{batch} x {seq} ({batch // DP} per rank), {cfg.dtype}; every bar equal to its closed form",
                 fontsize=10)
    fig.tight_layout()
    return save_figure(fig, "19_zero_and_recomputation")


paths = [plot(cfg, batch, seq, reports)]
wrote(paths[-1])

# %% [markdown]
# ## torch's FSDP2 beside it
#
# The same shape, weights and batch on the autograd reference model (`picockpt/measurement/reference.py`), each decoder layer
# an FSDP unit and the root unit the rest (embedding, final norm, head), torch's default `reshard_after_forward`
# (the layers resharded after their forward, the root kept), every layer recomputed, in each nesting. FSDP2 has
# no recompute phase of its own: its recompute runs inside the backward, so the table adds picockpt's recompute
# and backward gathers into one column (picockpt's backward also makes one reduce-scatter per unit, left out
# here). No dimension needs padding at 2 ranks, so the bytes compare. The last two columns say which mechanism
# ran: how often a layer's FSDP unit ran its forward (and FSDP's hooks with it) during the backward, and how many
# recomputes began with their layer's weights already gathered.

# %%
NESTINGS = (("FSDP2 fully_shard(checkpoint_wrapper(layer))", "fsdp(ac(layer))"),  # torchtitan's
            ("FSDP2 checkpoint(fully_shard(layer))", "ac(fsdp(layer))"))


def measure_fsdp2(cfg, batch, seq, device):
    """{label: rank 0's counts} for both nestings: fsdp_peer.py's forward and backward gathers."""
    params = init_params(cfg, seed=0)  # what measure() gave picockpt's ranks
    input_ids, targets = make_batch(cfg, batch, seq, "cpu", seed=0)
    variants = [(None, True, nesting) for _, nesting in NESTINGS]
    with spawning_ranks():
        results = run_ranks(fsdp2_rank_steps, DP, params, cfg, input_ids, targets, variants, device=device.type,
                            start_method=START, timeout_s=300)
    return {label: run for (label, _), run in zip(NESTINGS, results[0])}


def picockpt_gathers(report):
    """(forward calls, bytes), (recompute + backward calls, bytes) of one of picockpt's ZeRO-3 reports' all-gathers
    (the backward's reduce-scatters left out)."""
    calls, nbytes = ({phase: table[phase].get("all_gather", 0) for phase in PHASES}
                     for table in (report["zero_calls_by_kind"], report["zero_bytes_by_kind"]))
    return ((calls["forward"], nbytes["forward"]),
            (calls["recompute"] + calls["backward"], nbytes["recompute"] + nbytes["backward"]))


fsdp2 = measure_fsdp2(cfg, batch, seq, ranks_device(args.device, DP))
gathers = {f"picockpt 3 full{' keep' if keep else ''}": picockpt_gathers(reports[f"3 full{' keep' if keep else ''}"][0])
           for keep in (False, True)}
gathers.update({label: tuple((run[phase]["calls"], run[phase]["bytes"]) for phase in ("forward", "backward"))
                for label, run in fsdp2.items()})
print(f"rank 0's all-gathers, {cfg.layers} layers, every one recomputed:")
print(f"{'':<46}{'forward':>8}{'bytes':>12}{'backward':>10}{'bytes':>12}{'unit forwards':>15}{'found gathered':>16}")
for label, ((f_calls, f_bytes), (b_calls, b_bytes)) in gathers.items():
    run = fsdp2.get(label)
    found = f"{run['backward']['recomputes_found_gathered']} of {run['backward']['recomputes']}" if run else ""
    extra = f"{run['backward']['unit_forwards']:>15}{found:>16}" if run else ""
    print(f"{label:<46}{f_calls:>8}{f_bytes:>12,}{b_calls:>10}{b_bytes:>12,}{extra}")
fsdp2_is_keep = all(gathers[label][1][1] == gathers["picockpt 3 full keep"][1][1] for label in fsdp2)
print(f"FSDP2's backward gathers, both nestings, equal picockpt's with keep_gathered: {fsdp2_is_keep}")

# %% [markdown]
# Both nestings gather each layer once in the backward, as picockpt does with `keep_gathered` (its forward has
# one call more: the embedding and the head are two units there, one root unit in FSDP2). Under torchtitan's
# nesting no layer unit ran its forward during the backward; under the opposite nesting every recompute ran it,
# and each time found the weights the pre-backward hook had gathered.

# %% [markdown]
# ## Training with ZeRO is training
#
# `zero_train` (`picockpt/parallel/training.py`, and `python -m picockpt train --dp 2 --zero 3`) keeps the same
# ranks for every step and gives them a new batch each time; each rank steps AdamW on its shards only (any layout
# beside it: `tp=`, `pp=`, `cp=`, `ep=`; on the command line `--tp`, `--pp`, `--cp`, `--ep`). Against
# `picockpt/measurement/train.py`'s training in one process, on the same batches from the same weights, only the order of
# additions differs: each rank sums the gradient over its half of the batch and
# the reduce-scatter adds the two halves, where one process sums every row at once. Three steps at the
# `--fast` shape, in fp64 and in fp32. In fp32 the parameters can drift further apart than the losses do:
# AdamW divides each gradient element by the root of its own running square, so an element whose gradient
# is near zero (a rare token's embedding row, a sum that nearly cancels) takes a step of a sizeable part of
# the learning rate in whichever direction its last bits say.

# %%
def train_both(cfg, batch, seq, device, steps=3):
    """(largest relative loss difference, largest relative difference of any parameter) after `steps` steps of
    ZeRO-3 (full, keep_gathered) on DP ranks against one process."""
    task = MarkovTask(cfg.vocab, seed=0)
    batches = [task.batch(batch, seq) for _ in range(steps)]
    params = init_params(cfg, seed=0)
    with spawning_ranks():
        losses, trained, _ = zero_train(params, cfg, batches, "full", Layout(dp=DP, zero=3, keep_gathered=True),
                                        device=device.type, start_method=START, timeout_s=300)
    single = {name: tensor.clone() for name, tensor in params.items()}
    optimizer = make_optimizer(single)
    single_losses = [train_step(single, optimizer, cfg, ids, targets) for ids, targets in batches]
    return (max(abs(a - b) / b for a, b in zip(losses, single_losses)),
            max(max_relative_diff(trained[name], single[name]) for name in single))


fast_cfg, fast_batch, fast_seq = shape("fast")
trained_diff = {dtype: train_both(fast_cfg.replace(dtype=dtype), fast_batch, fast_seq, ranks_device(args.device, DP))
                for dtype in ("float64", "float32")}
for dtype, (loss_diff, param_diff) in trained_diff.items():
    print(f"{dtype}: 3 steps of ZeRO-3 training on {DP} ranks against one process: losses within {loss_diff:.1e}, "
          f"parameters within {param_diff:.1e} (relative)")

# %% [markdown]
# ## ZeRO beside tensor and pipeline parallelism, measured
#
# ZeRO runs inside the one rank step of every layout, so it stacks: one job on 8 gloo ranks, $dp = 2$,
# $tp = 2$, $pp = 2$ with 2 micro-batches (1F1B), ZeRO-3 under `full`, one AdamW step. A rank shards what it
# holds, its pipeline stage's units of its tensor-parallel slices (stage 0: the embedding and layers 0 and 1;
# stage 1: layers 2 and 3, the final norm and the head), over its 2 data-parallel ranks, and under $pp$ every
# micro-batch's forward, recompute and backward gather its stage's units again, in the schedule's order. The
# model is a tiny one (4 layers, $h = 32$, fp32) so that the 8 ranks fit on a few cores: 4 sequences of 16
# tokens, one sequence per micro-batch and data-parallel rank. Beside each measured number stands its closed
# form, `zero_stage_forms` (`picockpt/parallel/report_forms.py`) on the rank's `ChunkForms`
# (`picockpt/parallel/pipeline_parallel/pp_forms.py`), computed here without any rank; the loss and
# gradients are held to the single process's within a relative $10^{-5}$ (fp32).

# %%
def stacked_cfg():
    """The tiny model of this section, fp32: 4 layers over 2 pipeline stages, every width split by tp = 2."""
    return Config(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=24, max_seq=64)


def stacked_forms(cfg, batch, seq, stage, microbatches, dp=2, tp=2, pp=2, keep=False):
    """ZeRO-3's closed forms on a rank of pipeline stage `stage` (full, 1F1B, sequence parallel, one AdamW step),
    no rank launched; keep: keep_gathered (True, "step" or False)."""
    layout = Layout(dp=dp, pp=pp, tp=tp, zero=3, keep_gathered=keep, microbatches=microbatches)
    return zero_stage_forms(cfg, ChunkForms(cfg, batch, seq, "full", layout, stage), layout, steps=1)


def measure_stacked(cfg, batch, seq, device):
    """(loss, grads, reports) of one ZeRO-3 step on dp x tp x pp = 2 x 2 x 2 ranks, 2 micro-batches."""
    params = init_params(cfg, seed=1)
    input_ids, targets = make_batch(cfg, batch, seq, "cpu", seed=1)
    job = ParallelJob(params, cfg, input_ids, targets, "full", Layout(dp=2, pp=2, tp=2, zero=3, microbatches=2),
                      steps=1)
    with spawning_ranks():  # the ranks need picockpt, not this lesson's cells
        [result] = run_jobs([job], device=device.type, start_method=START, timeout_s=300)
    return result


tiny = stacked_cfg()
tiny_batch, tiny_seq = 4, 16
stacked_loss, stacked_grads, stacked = measure_stacked(tiny, tiny_batch, tiny_seq, ranks_device(args.device, 8))
tiny_params = init_params(tiny, seed=1)
tiny_ids, tiny_targets = make_batch(tiny, tiny_batch, tiny_seq, "cpu", seed=1)
single_loss, single_grads = loss_and_grads(tiny_params, tiny, tiny_ids, tiny_targets, "none")
loss_diff = abs(stacked_loss.item() - single_loss.item()) / abs(single_loss.item())
grad_diff = max(max_relative_diff(stacked_grads[name], single_grads[name]) for name in single_grads)
assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (loss_diff, grad_diff)
state_keys = ("param_bytes", "grad_bytes", "optimizer_bytes")
stacked_exact = True
print("ZeRO-3 on dp x tp x pp = 2 x 2 x 2 ranks, 2 micro-batches, full, one AdamW step; bytes, measured | closed "
      "form (per phase every kind: the gathers, and in the backward the gradients' reduce-scatter too):")
print(f"{'rank':>4}{'stage':>6}{'tp':>3}{'dp':>3}{'params':>16}{'grads':>16}{'AdamW':>16}{'gathered peak':>16}"
      + "".join(f"{phase:>20}" for phase in PHASES[:3]))
for r in stacked:
    form = stacked_forms(tiny, tiny_batch, tiny_seq, r["stage"], 2)
    pairs = [(r[key], form[key]) for key in state_keys]
    pairs.append((max(r["gathered_peak_bytes"].values()), max(form["gathered_peak_bytes"].values())))
    pairs += [(sum(r["zero_bytes_by_kind"][phase].values()), sum(form["zero_bytes_by_kind"][phase].values()))
              for phase in PHASES[:3]]
    print(f"{r['rank']:>4}{r['stage']:>6}{r['tp_rank']:>3}{r['dp_rank']:>3}"
          + "".join(f"{f'{measured:,} | {closed:,}':>{16 if n < 4 else 20}}" for n, (measured, closed)
                    in enumerate(pairs)))
    same = all(r[key] == form[key] for key in state_keys + ("gathered_peak_bytes", "zero_bytes_by_kind"))
    twins = all(r[f"predicted_{key}"] == form[key] for key in state_keys + ("gathered_peak_bytes",
                                                                             "zero_bytes_by_kind"))
    assert same and twins, r["rank"]
    stacked_exact = stacked_exact and same
print(f"every rank equals its closed form (model state, gathered peak per phase, ZeRO's bytes per phase and kind): "
      f"{stacked_exact}; loss and gradients against one process (policy none): within {loss_diff:.1e} and "
      f"{grad_diff:.1e} (relative)")

# %% [markdown]
# What the micro-batches cost ZeRO-3, from the closed forms alone: the same model on the same per-rank shapes
# (one sequence of 16 tokens per micro-batch and data-parallel rank, so the step's batch is $2M$ sequences),
# $pp = 2$, at $M = 1, 2, 4, 8$ micro-batches. Every micro-batch's forward, recompute and backward gathers the
# stage's units again, so a rank's all-gathered bytes per step grow with $M$, while its parameter bytes, the
# shards it stores, do not change. That growth is the reason torchtitan and `torch.distributed.pipelining`
# keep a stage's parameters gathered across its micro-batches (torchtitan does not reshard after the forward
# beside pp; pipelining reshards after the last backward only), trading the stage's whole parameters held
# through the step for one gather of each unit. picockpt runs it as `keep_gathered="step"` (`parallel
# --keep-gathered step`): the last two columns, the bytes it gathers per step and the most it holds gathered.

# %%
by_microbatches = {(stage, M): stacked_forms(tiny, 2 * M, tiny_seq, stage, M)
                   for stage in (0, 1) for M in (1, 2, 4, 8)}
print("ZeRO-3 per step on one rank of each stage, closed forms, bytes: the shards of parameters it stores, and "
      "what it all-gathers in each phase")
kept_step = {key: stacked_forms(tiny, 2 * key[1], tiny_seq, *key, keep="step") for key in by_microbatches}
print(f"{'':<16}{'params':>8}" + "".join(f"{phase:>11}" for phase in PHASES[:3]) + f"{'gathered':>11}"
      f"{'step: gathered':>16}{'step: peak':>12}")
for (stage, M), form in by_microbatches.items():
    gathered = {phase: form["zero_bytes_by_kind"][phase].get("all_gather", 0) for phase in PHASES[:3]}
    step = kept_step[stage, M]
    step_gathered = sum(step["zero_bytes_by_kind"][phase].get("all_gather", 0) for phase in PHASES[:3])
    print(f"{f'stage {stage}, M = {M}':<16}{form['param_bytes']:>8,}" + "".join(f"{n:>11,}" for n in gathered.values())
          + f"{sum(gathered.values()):>11,}{step_gathered:>16,}{max(step['gathered_peak_bytes'].values()):>12,}")
for stage in (0, 1):
    one = by_microbatches[stage, 1]
    for M in (2, 4, 8):
        form = by_microbatches[stage, M]
        assert form["param_bytes"] == one["param_bytes"]  # the shards it stores do not grow
        forward, once = (f["zero_bytes_by_kind"]["forward"]["all_gather"] for f in (form, one))
        assert forward == M * once  # every micro-batch's forward gathers every unit of the stage
        assert kept_step[stage, M]["zero_bytes_by_kind"]["forward"] == {"all_gather": once}  # step: each unit once
        assert "all_gather" not in kept_step[stage, M]["zero_bytes_by_kind"]["backward"]
    assert by_microbatches[stage, 2] == stacked_forms(tiny, tiny_batch, tiny_seq, stage, 2)  # the measured job's

# %% [markdown]
# ## Exercises
#
# **1.** The ZeRO paper's 7.5B model with $K = 12$ at $N_d = 64$: how many GB does a rank hold under stage 2?

# %%
answer = 16.6  # GB

# %%
paper = zero_paper_bytes(7.5e9, K=12, N_d=64)
check("GB of model state per rank, 7.5B, stage 2, N_d = 64", answer, paper[2] / 1e9,
      why="2 Psi of fp16 parameters stay whole; (2 + K) Psi of gradients and optimizer state split 64 ways: "
          f"15 + 14 x 7.5 / 64 = {paper[2] / 1e9:.2f} GB")

# %% [markdown]
# **2.** Under stage 3 with `full` recomputation, how many times is layer 0's unit all-gathered in one step,
# without `keep_gathered`? (Count its forward, its recompute and its backward.)

# %%
answer = 3

# %%
uses = gather_uses(cfg, parse_policy("full", cfg).schedule(cfg, batch // DP, seq))
check("all-gathers of layer 0 per step, stage 3, full, without keep_gathered", answer,
      sum(1 for _, unit in uses if unit == 0), rel=0,
      why="forward, recompute sweep, backward: each a use that finds the unit freed; keep_gathered holds the "
          "recompute's gather for the backward, 2")

# %% [markdown]
# **3.** What does a rank hold of model state under stage 3 of the CPU shape above, in bytes? (Parameters,
# gradients and AdamW's state, its shards only: the table's first three columns.)

# %%
answer = 14_697_512  # bytes

# %%
cpu_cfg, *_ = shape("cpu")
state = model_state_bytes(cpu_cfg, 3, DP)
check("bytes of model state per rank, small preset, stage 3, 2 ranks", answer, sum(state.values()), rel=0,
      why=f"4 + 4 + 8 bytes for each of the rank's {state['param_bytes'] // 4:,} shard elements (padded units), "
          f"plus a 4-byte AdamW step count per unit: {state}")

# %%
RESULT = {"figures": paths, "summary": {"closed forms exact": exact, "layer gathered bytes": layer_bytes,
                                       "FSDP2 backward gathers (both nestings) = picockpt keep_gathered": fsdp2_is_keep,
                                       "ZeRO-3 training = one process in fp64 (rel <= 1e-10)":
                                           trained_diff["float64"][1] <= 1e-10,
                                       "fp32 trained parameters max rel diff": trained_diff["float32"][1],
                                       "ZeRO-3 beside tp and pp (8 ranks) = closed forms": stacked_exact}}

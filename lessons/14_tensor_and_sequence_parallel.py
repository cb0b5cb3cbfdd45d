# %% [markdown]
# # Lesson 14: tensor and sequence parallelism with recomputation, measured rank by rank
#
# Korthikanti et al. (2022), Table 2, gives the bytes one transformer layer keeps on each of $t$
# tensor-parallel devices:
#
# | | no recomputation | selective |
# |---|---|---|
# | tensor parallel | $s b h\,(10 + 24/t + 5 a s/(h t))$ | $s b h\,(10 + 24/t)$ |
# | tensor + sequence parallel | $s b h\,(34/t + 5 a s/(h t))$ | $s b h \cdot 34/t$ |
# | full recomputation | $2 s b h$ | |
#
# Tensor parallelism (Megatron) splits the heads and the MLP's width over the ranks, so every tensor
# inside the attention and the MLP divides by $t$ (the 24 and the attention core); the $10 s b h$ outside
# them (the norms' inputs and outputs, the residual dropout masks) stays whole on every rank. Sequence
# parallelism splits those along the sequence, so all 34 divide by $t$. Its forward moves no more than
# plain tensor parallelism: the all-reduce at the end of each block becomes a reduce-scatter and the
# identity at its start an all-gather, the same bytes on a ring. Its backward moves more: a rank keeps
# only its shard of each norm output, so the projections' weight gradients need it all-gathered again
# (as Megatron-LM does, rather than keeping the gathered copy), and the norms' weight gradients are
# all-reduced. How much more depends on how bytes are counted. By buffer size (nccl-tests' convention,
# the table below: an all-reduce, all-gather or reduce-scatter of an $S$-byte tensor counts $S$), three
# times the plain backward's. On the wire, where a ring all-gather or reduce-scatter sends $(t-1)/t$ of
# its buffer and a ring all-reduce $2(t-1)/t$, half as many bytes count per collective: 1.5 times the plain
# backward's, about 1.25 times over the whole step, whose forwards send the same. Both are printed below
# from the measured collectives, and the figure plots the wire bytes with the buffer sizes beside them.
#
# Here those rows are per-rank measurements: picockpt's own layer (GQA, SwiGLU, RMSNorm, dropout) runs
# on $t$ = 1, 2 and 4 gloo ranks through the engine's own loop, and every rank's tracker counts its
# stored bytes and the bytes its collectives move, per phase.
#
# **Run it** as a script, `python lessons/14_tensor_and_sequence_parallel.py` (the CPU run: 1, 2 and 4
# gloo ranks, under a minute; `--fast` for seconds, `--large --device cuda` for NCCL with one GPU per
# rank), or step through this notebook, where the same flags come from the environment variable
# `PICOCKPT_LESSON_ARGS` (unset: the CPU run).

# %%
import multiprocessing

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator

from _check import check
from _lesson import choose, large, lesson_args, ranks_device, shape_line, spawning_ranks, wrote
from picockpt import Config, init_params
from picockpt.planning.published import GIB, korthikanti_layer_bytes
from picockpt.measurement.measure import make_batch
from picockpt.parallel import Layout, ParallelJob, run_jobs
from picockpt.parallel.tensor_parallel.tp_forms import rank_comm_bytes, rank_layer_inventory, replicated_and_split
from picockpt.teaching.plotting import PHASE_COLORS, mib, policy_color, save_figure
from picockpt.recompute.policy import SELECTIVE

ROWS = (  # (label, policy, sp, distributed saved activations): Table 2's rows, and Megatron's option
    ("no recompute", "none", False, False),
    ("no recompute, sp", "none", True, False),
    ("selective", "selective", False, False),
    ("selective, sp", "selective", True, False),
    ("full", "full", False, False),
    ("full, sp", "full", True, False),
    ("full, distributed saved", "full", False, True),
)
PHASES = ("forward", "recompute", "backward")

# %% [markdown]
# ## Ranks, and the closed forms per rank
#
# The rows above are Table 2's, plus Megatron's `--distribute-saved-activations` (each rank keeps $1/t$
# of every full-recompute checkpoint). `measure` launches $t$ ranks once per $t$ and runs every row;
# every rank must store and move the same bytes. `layer_line` is picockpt's closed form for one stored
# layer on one rank, at any $t$: the part kept whole plus the part split by $t$
# (`picockpt/parallel/tensor_parallel/tp_forms.py`).

# %%
def shape(mode):
    """(Config, batch, seq) of each run mode: heads, kv heads, ffn, vocab and seq divisible by 4."""
    return choose(mode,
                  fast=(Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=4, ffn=64, max_seq=64, dropout=0.1),
                        1, 16),
                  cpu=(Config(vocab=256, hidden=128, layers=4, heads=8, kv_heads=4, ffn=448, max_seq=256,
                              dropout=0.1), 2, 128),
                  large=(large(layers=4, dropout=0.1), 1, 1024))


def sizes(mode, device):
    return (1, 2, 4)  # with fewer GPUs than 4, ranks_device runs them on the CPU over gloo, and says so


def measure(cfg, batch, seq, ts, device):
    """{(row label, t): rank 0's report}, every row run on t ranks, one launch per t."""
    params = init_params(cfg, seed=0, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed=0)
    torch.manual_seed(0)
    state = torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)
    start = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    reports = {}
    for t in ts:
        jobs = [ParallelJob(params, cfg, input_ids, targets, policy, Layout(tp=t, sp=sp, distribute_saved=distributed),
                            rng_state=state) for _, policy, sp, distributed in ROWS]
        with spawning_ranks():  # the ranks need picockpt, not this lesson's cells
            results = run_jobs(jobs, t, device.type, start_method=start)
        for (label, *_), (_, _, ranks) in zip(ROWS, results):
            same = ("peak_activation_bytes", "layer_stored_bytes", "comm_bytes", "flops")
            for report in ranks:  # every rank stores and moves the same bytes (its live peak may differ a little)
                assert [report[key] for key in same] == [ranks[0][key] for key in same], (label, t)
            reports[label, t] = ranks[0]
    return reports


def layer_line(cfg, batch, seq, policy, sp, distributed, t):
    """picockpt's closed form for one stored layer on one rank, at any t: whole + split / t."""
    if policy == "full":
        X = rank_layer_inventory(cfg, batch, seq)["input"][2]  # the layer input, on one rank of 1
        return X / t if sp or distributed else X
    whole, split = replicated_and_split(cfg, batch, seq, 1, sp, SELECTIVE if policy == "selective" else frozenset())
    return whole + split / t


def table2_70b(t=8, seq=8192, batch=1):
    """Table 2's rows for a Llama 3 70B shape at t: (label, published bytes, picockpt's per rank)."""
    from picockpt.parallel.tensor_parallel.tp_forms import rank_sizes
    cfg = Config.from_preset("llama3-70b", dtype="bf16")
    s, b, h, a = seq, batch, cfg.hidden, cfg.heads
    rows = []
    for label, policy, sp, distributed in ROWS:
        if policy == "full":
            published = 2 * s * b * h / (t if sp or distributed else 1)
            own = rank_sizes(cfg, b, s, t, sp, distributed)[1]
        else:
            published = korthikanti_layer_bytes(s, b, h, a, t, sp, policy)
            unstored = SELECTIVE if policy == "selective" else frozenset()
            own = sum(v[2] for v in rank_layer_inventory(cfg, b, s, t, sp, unstored).values())
        rows.append((label, published, own))
    return cfg, rows


def wire_bytes(by_kind, t):
    """What one rank sends with ring algorithms (nccl-tests' bus bytes): 2(t-1)/t of an all-reduce's
    size, (t-1)/t of an all-gather's or a reduce-scatter's."""
    factor = {"all_reduce": 2 * (t - 1) / t, "all_gather": (t - 1) / t, "reduce_scatter": (t - 1) / t}
    return sum(factor[kind] * nbytes for phase in by_kind.values() for kind, nbytes in phase.items())


def phase_wire_bytes(by_kind, t, phase):
    """wire_bytes of one phase."""
    return wire_bytes({phase: by_kind.get(phase, {})}, t)


# %%
args = lesson_args()
cfg, batch, seq = shape(args.mode)
ts = sizes(args.mode, args.device)
print(f"lesson 14, tensor-parallel sizes t = {', '.join(map(str, ts))}: {shape_line(cfg, batch, seq, args.device)}")
reports = measure(cfg, batch, seq, ts, ranks_device(args.device, max(ts)))

print("\none layer's stored bytes and the step's store peak, per rank (measured | closed form):")
print(f"{'row':<26}{'t':>3}{'layer measured':>16}{'closed form':>13}{'peak measured':>15}{'closed form':>13}"
      f"{'  comm forward':>15}{'recompute':>11}{'backward':>11}")
exact_layer = exact_peak = exact_comm = True
for label, policy, sp, distributed in ROWS:
    for t in ts:
        r = reports[label, t]
        exact_layer &= r["layer_stored_bytes"] == r["predicted_layer_stored_bytes"]
        exact_layer &= r["layer_stored_bytes"] == layer_line(cfg, batch, seq, policy, sp, distributed, t)
        exact_peak &= r["peak_activation_bytes"] == r["predicted_activation_bytes"]
        exact_comm &= r["comm_bytes"] == r["predicted_comm_bytes"]
        comm = r["comm_bytes"]
        print(f"{label:<26}{t:>3}{r['layer_stored_bytes']:>16,}{r['predicted_layer_stored_bytes']:>13,}"
              f"{r['peak_activation_bytes']:>15,}{r['predicted_activation_bytes']:>13,}"
              f"{comm['forward']:>15,}{comm['recompute']:>11,}{comm['backward']:>11,}")
print(f"every measured byte equals its closed form: layers {exact_layer}, peaks {exact_peak}, "
      f"communication {exact_comm}")

# %% [markdown]
# Every measured byte equals its closed form: each layer's stored bytes, each rank's store peak, and
# each phase's communication. The rows at $t = 1$ are the single process's own model, head included: a
# vocabulary-parallel head ($t \ge 2$) also keeps its loss's log-sum-exp, $B \cdot T$ statistics, since the
# softmax's denominator spans every rank's columns (`tensor_parallel/vocab.py`); one process has nothing to
# share it with, so its peak is that much lower.
#
# ## Communication: recomputation repeats it
#
# Recomputation runs each recomputed layer's collectives again (its all-reduces, or under sp its
# all-gathers and reduce-scatters), so full recomputation adds about the forward's communication again;
# selective adds none; distributed saved activations add one all-gather per checkpoint.
# That is what Megatron-LM's full recomputation does too (its checkpointed forward runs whole), and it
# is not a lower bound: a recomputed layer's output is the next layer's stored input, so the sweep's
# last collective (LEAVE after the MLP) need not run again, just as a non-reentrant
# `torch.utils.checkpoint` stops early before the last down projection. picockpt's budget planner
# plans its sweeps that way (they skip one LEAVE, $S$ bytes, each: `rank_comm_bytes`); the uniform
# `full` and `every:C` schedules measured here run the whole layer.

# %%
top = ts[-1]
full, full_sp = reports["full", top]["comm_bytes"], reports["full, sp", top]["comm_bytes"]
distributed = reports["full, distributed saved", top]["comm_bytes"]
print(f"\nat t={top}: full recomputation moves {full['recompute'] / full['forward']:.0%} of the forward's bytes "
      f"again ({full_sp['recompute'] / full_sp['forward']:.0%} with sp): every recomputed layer's collectives, "
      f"not the embedding's or the loss's; selective moves "
      f"{reports['selective', top]['comm_bytes']['recompute']} B again. Distributed saved activations add one "
      f"all-gather per checkpoint: {distributed['recompute'] - full['recompute']:,} B more.")
print("(bytes as nccl-tests count them: an all-reduce of S bytes counts S, an all-gather or reduce-scatter of a "
      "whole S-byte tensor S too; on a ring a rank sends 2(t-1)/t S for the first and (t-1)/t S for the others, "
      "so in the forward sp's two collectives put the same bytes on the wire as the all-reduce they replace; "
      "its backward adds one all-gather of each norm output per block)")
plain, with_sp = reports["no recompute", top], reports["no recompute, sp", top]
buffer_ratio = with_sp["comm_bytes"]["backward"] / plain["comm_bytes"]["backward"]
wire_ratio = (phase_wire_bytes(with_sp["comm_bytes_by_kind"], top, "backward") /
              phase_wire_bytes(plain["comm_bytes_by_kind"], top, "backward"))
step_ratio = wire_bytes(with_sp["comm_bytes_by_kind"], top) / wire_bytes(plain["comm_bytes_by_kind"], top)
print(f"sp's backward against the plain one at t={top} (no recompute): {buffer_ratio:.2f}x by buffer size, "
      f"{wire_ratio:.2f}x on the wire; the whole step {step_ratio:.2f}x on the wire")

# %% [markdown]
# ## Table 2 for a 70B shape
#
# The published convention (16-bit activations, 1-byte masks, multi-head attention, $f = 4h$) beside
# picockpt's exact bytes per rank (bf16, GQA 64/8, SwiGLU, no dropout): predicted, not run.

# %%
cfg70, rows70 = table2_70b()
print("\nTable 2 for a Llama 3 70B shape at t=8, s=8192, b=1, one layer per device (predicted): published "
      "(16-bit, 1-byte masks, MHA, f = 4h) | picockpt per rank (bf16, GQA 64/8, SwiGLU, no dropout):")
for label, published, own in rows70:
    print(f"  {label:<26}{published / GIB:>9.3f} GiB{own / GIB:>9.3f} GiB   x {cfg70.layers} layers: "
          f"{cfg70.layers * published / GIB:7.1f} | {cfg70.layers * own / GIB:7.1f} GiB")

# %% [markdown]
# ## The figures
#
# The first: left, one layer's stored bytes per rank against $t$, measured points on the lines
# "whole + split/t" of the closed form (without sp the lines flatten at the replicated part; with sp they
# fall as $1/t$); middle, the whole step's store peak per rank; right, Table 2's rows for the 70B shape.
# The second: what each rank's collectives send on a ring, by phase, at the largest $t$ (bars), with
# their buffer sizes, the count of the table above (markers).

# %%
def plot_memory(cfg, batch, seq, ts, reports, rows70):
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw=dict(width_ratios=(1.1, 1, 1.2)))
    grid = np.linspace(1, ts[-1], 60)
    for label, policy, sp, distributed in ROWS:
        color = policy_color(policy)
        style = ":" if distributed else "--" if sp else "-"
        marker = "s" if distributed else "^" if sp else "o"
        left.plot(grid, mib([layer_line(cfg, batch, seq, policy, sp, distributed, t) for t in grid]), style,
                  color=color, lw=1.2, alpha=0.8)
        left.plot(ts, mib([reports[label, t]["layer_stored_bytes"] for t in ts]), marker, color=color, label=label)
        middle.plot(ts, mib([reports[label, t]["predicted_activation_bytes"] for t in ts]), style, color=color, lw=1.2)
        middle.plot(ts, mib([reports[label, t]["peak_activation_bytes"] for t in ts]), marker, color=color,
                    label=label)
    for ax, title in ((left, "one layer's stored bytes per rank\n(lines: whole + split/t, points: measured)"),
                      (middle, "the step's store peak per rank\n(lines: closed form, points: measured)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ts, [str(t) for t in ts])
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))
        ax.set_xlabel("tensor-parallel size t")
        ax.set_ylabel("MiB")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
    handles = [Line2D([], [], color=policy_color(policy), ls=":" if distributed else "--" if sp else "-",
                      marker="s" if distributed else "^" if sp else "o", label=label)
               for label, policy, sp, distributed in ROWS]
    handles.append(Line2D([], [], color="0.4", lw=1.2, label="lines: closed form; markers: measured"))
    left.legend(handles=handles, fontsize=7, loc="center left")
    middle.legend(handles=handles, fontsize=7, loc="upper right")
    full_sp = reports["full, sp", ts[-1]]["layer_stored_bytes"]
    left.annotate("full, sp = full, distributed saved", (ts[-1], mib(full_sp)), fontsize=7, ha="right",
                  xytext=(-8, -10), textcoords="offset points", color=policy_color("full"))
    labels = [label for label, _, _ in rows70]
    y = np.arange(len(labels))
    right.barh(y - 0.2, [published / GIB for _, published, _ in rows70], 0.4, color="#999999",
               label="Table 2 (16-bit, 1-byte masks)")
    right.barh(y + 0.2, [own / GIB for _, _, own in rows70], 0.4, color=[policy_color(p) for _, p, _, _ in ROWS],
               label="picockpt per rank (bf16, GQA)")
    for yi, (_, published, own) in zip(y, rows70):
        right.annotate(f"{published / GIB:.2f} | {own / GIB:.2f} GiB", (max(published, own) / GIB, yi), fontsize=7,
                       xytext=(3, -3), textcoords="offset points")
    right.set_yticks(y, labels, fontsize=8)
    right.invert_yaxis()
    right.set_xscale("log")
    right.set_xlabel("one layer, per device (GiB)")
    right.set_title("Llama 3 70B shape at t=8, s=8192, b=1 (predicted)", fontsize=10)
    right.legend(fontsize=7, loc="lower right")
    right.grid(alpha=0.3, axis="x")
    fig.suptitle(f"Korthikanti et al.'s Table 2 per rank: L={cfg.layers}, h={cfg.hidden}, H={cfg.heads}, "
                 f"KV={cfg.kv_heads}, f={cfg.ffn}, dropout {cfg.dropout}, batch {batch} x {seq}, {cfg.dtype}")
    fig.tight_layout()
    return save_figure(fig, "14_activation_memory_per_rank")


def plot_communication(cfg, batch, seq, t, reports):
    """Bars: the bytes one rank sends on a ring, by phase; markers: the collectives' buffer sizes S (nccl-tests'
    count), measured and closed form. The two conventions differ by 2(t-1)/t and (t-1)/t per collective."""
    fig, ax = plt.subplots(figsize=(11, 4.8))
    labels = [label for label, *_ in ROWS]
    x = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    for phase in PHASES:
        values = np.array([mib(phase_wire_bytes(reports[label, t]["comm_bytes_by_kind"], t, phase))
                           for label in labels])
        ax.bar(x, values, 0.6, bottom=bottom, color=PHASE_COLORS[phase], label=f"{phase}: sent on a ring")
        bottom += values
    buffer = [mib(sum(reports[label, t]["comm_bytes"].values())) for label in labels]
    predicted = [mib(sum(reports[label, t]["predicted_comm_bytes"].values())) for label in labels]
    ax.plot(x, buffer, "D", color="black", markersize=5, label="buffer sizes S, all phases (measured)")
    ax.plot(x, predicted, "_", color="black", markersize=28, mew=2, label="buffer sizes S, closed form")
    for xi, label in zip(x, labels):
        by_kind = reports[label, t]["comm_bytes_by_kind"]
        forward, recompute = (phase_wire_bytes(by_kind, t, phase) for phase in ("forward", "recompute"))
        ax.annotate(f"recompute +{recompute / forward:.0%}\nof the forward", (xi, max(bottom[xi], buffer[xi])),
                    ha="center", va="bottom", fontsize=7, xytext=(0, 6), textcoords="offset points")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("MiB per rank: sent on a ring (bars),\nbuffer sizes (markers)")
    ax.set_ylim(0, max(bottom.max(), max(buffer)) * 1.25)
    ax.set_title(f"communication per rank and phase at t={t}: recomputation repeats each recomputed layer's "
                 f"collectives", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"L={cfg.layers}, h={cfg.hidden}, batch {batch} x {seq}, {cfg.dtype}; on a ring one rank sends "
                 f"2(t-1)/t S of an all-reduce, (t-1)/t S of an all-gather or reduce-scatter", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, "14_communication_per_phase")


paths = [plot_memory(cfg, batch, seq, ts, reports, rows70), plot_communication(cfg, batch, seq, top, reports)]
for path in paths:
    wrote(path)

# %% [markdown]
# ## Exercises
#
# **1.** Table 2 for the 70B shape ($h = 8192$, $a = 64$) at $s = 8192$, $b = 1$, now with $t = 4$,
# sequence parallelism and selective recomputation: how many GiB does one layer keep on each rank, by
# the published formula?

# %%
answer = 0.531  # GiB

# %%
check("GiB per layer per rank, t = 4, sp, selective (Table 2, 70B shape)", answer,
      korthikanti_layer_bytes(8192, 1, 8192, 64, 4, True, "selective") / GIB,
      why="sbh·34/t = 8192·1·8192·34/4 bytes: with sp every one of the 34 sbh terms divides by t")

# %% [markdown]
# **2.** The same without sequence parallelism: which part stays whole on every rank, and how many GiB
# per layer per rank is it now?

# %%
answer = 1.0  # GiB

# %%
check("GiB per layer per rank, t = 4, no sp, selective (Table 2, 70B shape)", answer,
      korthikanti_layer_bytes(8192, 1, 8192, 64, 4, False, "selective") / GIB,
      why="sbh·(10 + 24/t) = sbh·16 bytes: the 10 sbh outside the attention and the MLP are replicated: the two "
          "norms' inputs (4 sbh, the block inputs), their outputs (4 sbh, the inputs of the QKV and first MLP "
          "projections) and the two residual dropout masks (2 sbh)")

# %% [markdown]
# **3.** Full recomputation without sp, for this lesson's CPU shape at $t = 4$: a rank's recompute
# phase moves how many bytes per layer, in units of $S$ = one whole activation, $B \cdot T \cdot h$ numbers?
# (Count the collectives of one layer's forward.)

# %%
answer = 2  # S per layer

# %%
lesson_shape = shape("cpu")[0]
S = 2 * 128 * lesson_shape.hidden * 4  # batch 2 x 128 tokens, fp32
moved = rank_comm_bytes(lesson_shape, 2, 128, "full", 4)["recompute"]
check("bytes one rank's recompute moves per layer, in S (full, no sp, t = 4)", answer,
      moved / (lesson_shape.layers * S), rel=0,
      why=f"each layer's forward all-reduces twice (after the attention and after the MLP), S bytes each; "
          f"recomputing L = {lesson_shape.layers} layers moves {moved:,} bytes = {moved // S} S")

# %%
sp_selective = dict((label, own) for label, _, own in rows70)["selective, sp"]
RESULT = {"figures": [str(p) for p in paths],
          "summary": {"stored per layer = closed form (every row, every t)": bool(exact_layer),
                      "store peak = closed form": bool(exact_peak),
                      "communication per phase = closed form": bool(exact_comm),
                      f"full recompute / forward communication at t={top}": round(full["recompute"] /
                                                                                 full["forward"], 3),
                      "70B t=8 sp+selective GiB per layer per rank": round(sp_selective / GIB, 3)}}

# %% [markdown]
# # Lesson 23: time from bytes: when communication, recomputed or not, hides behind compute
#
# A small model of a step's time, the one the Ultra-Scale Playbook's appendix A3 ("Math for
# Compute/Communication Overlap") uses: compute takes FLOPs / compute rate, a collective takes the bytes
# it puts on the wire / the link's bandwidth, and a collective *hides* when the compute it overlaps takes
# longer. Ring collectives put $2(n-1)/n$ of an all-reduce's size and $(n-1)/n$ of an all-gather's or
# reduce-scatter's on each rank's wire (nccl-tests' "bus bandwidth" factors, which A3 uses). Two of A3's
# ratios, with $e$ bytes per element written out (A3 counts one byte per element):
#
# - **tensor parallel**, an all-gather of $s \cdot b \cdot h$ elements against the next linear's
#   $2 s b h^2 / t$ FLOPs: $\;\dfrac{t_\text{comm}}{t_\text{compute}} = \dfrac{e\,(t-1)}{2h}\cdot\dfrac{F}{W}$,
#   independent of the batch and the sequence;
# - **data parallel**, the whole gradient's all-reduce against the backward's $4 \cdot \text{tokens}
#   \cdot \Psi$ FLOPs: $\;\dfrac{(d-1)}{d}\cdot\dfrac{e\,F}{2\,\text{tokens}\,W}$. (A3 prints a factor
#   $\Psi / (2\,\text{tokens})$; dividing all the gradient's bytes by the whole backward's time the
#   parameter count $\Psi$ cancels.)
#
# $F$ is the compute rate, $W$ one direction of the link. Recomputation enters both: under `full` the
# backward pass also runs the forward again ($6 \cdot \text{tokens} \cdot \Psi$ instead of 4), which gives a
# data-parallel all-reduce 1.5 times the compute to hide behind; and Megatron-LM's recomputation runs the
# forward's tensor-parallel collectives again, adding communication in the same proportion as compute.
#
# Every number below is labelled **measured** (on this machine, now) or **modelled** (the formulas, with
# datasheet rates from picockpt/planning/hardware.py, which cites each: H100 SXM bf16 989.5 TFLOPS dense, half the
# datasheet's 1,979 with sparsity; one direction of NVLink 4, 450 GB/s of the datasheet's 900 GB/s both
# ways; one direction of PCIe Gen5 x16, 63.0 GB/s once 128b/130b encoding is paid, where NVIDIA's
# 128 GB/s adds both directions' raw signalling; InfiniBand NDR, 400 Gb/s a port, 50 GB/s). A datasheet
# rate is a ceiling: measured bus bandwidths and model FLOP utilisations sit below it.
#
# **Run it** as a script, `python lessons/23_time_from_bytes.py` (the CPU run: 2 gloo ranks, under a
# minute; `--fast` for seconds, `--large --device cuda` to measure a GPU's matmul and copy rates), or
# step through this notebook, where the same flags come from the environment variable
# `PICOCKPT_LESSON_ARGS` (unset: the CPU run).

# %%
import math
import multiprocessing
import statistics

import matplotlib.pyplot as plt
import torch

from _check import check
from _lesson import (FAST_TIMING, Spread, choose, device_name, interleaved_seconds, lesson_args, shape_line, spawning_ranks,
                     wrote)
from _allreduce_timing import all_reduce_seconds
from picockpt import Config, init_params, loss_and_grads, parallel
from picockpt.planning.hardware import H100_SXM_BF16, INFINIBAND_NDR, NVLINK_4, PCIE_GEN5_X16
from picockpt.planning.step_forms import layer_flops, step_flops
from picockpt.measurement.measure import make_batch
from picockpt.teaching.plotting import PHASE_COLORS, save_figure
from picockpt.parallel import Layout

H100_BF16 = H100_SXM_BF16  # FLOP/s, dense bf16 tensor cores (picockpt/planning/hardware.py)
LINKS = {"NVLink 4": NVLINK_4, "PCIe Gen5 x16": PCIE_GEN5_X16, "InfiniBand NDR": INFINIBAND_NDR}  # bytes/s, one way
WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}
START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"

# %% [markdown]
# ## The model
#
# `tp_layer_seconds` is one decoder layer on one of $t$ tensor-parallel ranks (Megatron's layout without
# sequence parallelism: two all-reduces of $s b h$ elements in the forward, two in the backward), by
# phase, with picockpt's exact FLOPs of the layer (`inventory.layer_flops`). Under `full` the recompute
# phase repeats the forward, collectives included, as Megatron does. `fit_latency_bandwidth` fits
# $\text{time} = \alpha + \text{bytes} / \beta$ to measured all-reduces (least squares of the relative error).

# %%
def tp_layer_seconds(cfg, batch, seq, t, rate, bandwidth, policy="none"):
    """{phase: (compute seconds, communication seconds)} of one layer on one of t ranks (modelled)."""
    e = torch.finfo(cfg.torch_dtype).bits // 8
    forward = sum(layer_flops(cfg, batch, seq).values()) / t / rate
    all_reduce = WIRE["all_reduce"](t) * batch * seq * cfg.hidden * e / bandwidth  # one, on the wire
    out = {"forward": (forward, 2 * all_reduce)}
    if policy == "full":  # the forward again, collectives included
        out["recompute"] = out["forward"]
    out["backward"] = (2 * forward, 2 * all_reduce)
    return out


def tp_overlap_ratio(h, t, rate, bandwidth, e=2):
    """A3: an all-gather of s b h elements over the next linear's 2 s b h^2 / t FLOPs."""
    return e * (t - 1) / (2 * h) * rate / bandwidth


def dp_overlap_ratio(tokens, d, rate, bandwidth, e=2, policy="none"):
    """The gradient's all-reduce over d replicas against the backward pass (4 tokens Psi FLOPs, 6 with
    full recomputation, whose backward pass runs the forward again)."""
    backward = 6 if policy == "full" else 4
    return (d - 1) / d * 2 * e * rate / (backward * tokens * bandwidth)


def hiding_tokens(d, rate, bandwidth, e=2, policy="none"):
    """The tokens per GPU at which the data-parallel ratio reaches 1: more, and the all-reduce hides."""
    return dp_overlap_ratio(1, d, rate, bandwidth, e, policy)


def dp_step_seconds(tokens, d, rate, bandwidth, e=2, policy="none"):
    """A data-parallel step per parameter (modelled): the forward (2 tokens FLOPs), then the backward (4, or 6
    with full recomputation) with the gradient's all-reduce beside it; the step ends when the later ends."""
    backward = (6 if policy == "full" else 4) * tokens / rate
    all_reduce = WIRE["all_reduce"](d) * e / bandwidth  # one parameter's gradient, on the wire
    return 2 * tokens / rate + max(backward, all_reduce)


def fit_latency_bandwidth(sizes, seconds):
    """alpha (s) and beta (bytes/s) of seconds = alpha + size / beta, fitted by least squares of the relative
    error (weights 1 / seconds^2), so that the small sizes count as much as the large ones. A noisy
    measurement whose time does not grow with the size gives beta = inf (no bandwidth term resolved) and the
    median time as alpha."""
    w = [1 / y**2 for y in seconds]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, sizes)), sum(wi * y for wi, y in zip(w, seconds))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes, seconds))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    if slope <= 0:
        return statistics.median(seconds), math.inf
    return (sy - slope * sx) / sw, 1 / slope


def modelled_comm_seconds(report, alpha, beta, n):
    """{phase: seconds} a rank's communication would take at alpha + wire bytes / beta per call."""
    return {phase: report["comm_calls"][phase] * alpha
            + sum(WIRE[kind](n) * nbytes for kind, nbytes in report["comm_bytes_by_kind"][phase].items()) / beta
            for phase in report["comm_bytes"]}


# %% [markdown]
# ## Measured on this machine: compute, copy, all-reduce
#
# A square fp32 matmul's rate, a large copy's rate (bytes copied per second), and the sum all-reduce of
# 2 gloo ranks on this machine's loopback (`run_ranks`: each rank times every call, and a call lasts as
# long as its slower rank). All are Spreads of repeats, median [min..max]; the all-reduce's
# latency-bandwidth fit uses each size's least time, the repeat least disturbed by other programs on a
# shared machine.

# %%
def rates(device, n, copy_bytes, repeats):
    """(FLOP/s of each repeat of an n x n fp32 matmul, bytes/s of each repeat of a copy of copy_bytes)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)  # (n, n) each
    source = torch.empty(copy_bytes, dtype=torch.uint8, device=device)  # (copy_bytes,)
    target = torch.empty_like(source)
    spreads = interleaved_seconds({"matmul": lambda: a @ b, "copy": lambda: target.copy_(source)}, device, repeats)
    return (tuple(2 * n**3 / t for t in spreads["matmul"].samples),
            tuple(copy_bytes / t for t in spreads["copy"].samples))


def step_shape(mode):
    """(Config, batch, seq) of the model check: always on the CPU, where gloo ranks run."""
    return choose(mode, fast=(Config(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, max_seq=64), 2, 32),
                  cpu=(Config(vocab=256, hidden=128, layers=4, heads=4, kv_heads=2, ffn=352, max_seq=256), 4, 128),
                  large=(Config(vocab=256, hidden=128, layers=4, heads=4, kv_heads=2, ffn=352, max_seq=256), 4, 128))


def spread_text(values, scale):
    return f"{statistics.median(values) * scale:.2f} [{min(values) * scale:.2f}..{max(values) * scale:.2f}]"


# %%
args = lesson_args()
n, copy_bytes, repeats = choose(args.mode, fast=(256, 8 * 2**20, 3), cpu=(512, 64 * 2**20, 7),
                                large=(4096, 1024 * 2**20, 7))
sizes = choose(args.mode, fast=[2**12, 2**16, 2**20, 2**22], cpu=[2**k for k in range(12, 25, 2)],
               large=[2**k for k in range(12, 25, 2)])
matmul_rates, copy_rates = rates(args.device, n, copy_bytes, repeats)
print(f"lesson 23, measured on {device_name(args.device)}:")
print(f"  fp32 matmul {n} x {n}: {spread_text(matmul_rates, 1e-9)} GFLOP/s")
print(f"  copy of {copy_bytes / 2**20:.0f} MiB: {spread_text(copy_rates, 1e-9)} GB/s")
with spawning_ranks():  # the ranks import _allreduce_timing, not this lesson's cells
    per_rank = parallel.run_ranks(all_reduce_seconds, 2, sizes, repeats)  # spawn: the ranks get this sys.path
reduce_times = {s: tuple(max(r[s][i] for r in per_rank) for i in range(repeats)) for s in sizes}
medians = [statistics.median(reduce_times[s]) for s in sizes]
least = [min(reduce_times[s]) for s in sizes]  # what the fit uses: the repeats least disturbed by other programs
alpha, beta = fit_latency_bandwidth(sizes, least)
print("  gloo all-reduce, 2 ranks (fp32 sum): size, time in us, bus bandwidth at the median")
for s, median in zip(sizes, medians):
    print(f"    {s / 2**20:>8.3f} MiB: {spread_text(reduce_times[s], 1e6):>28} us, {s / median / 1e9:.3f} GB/s; "
          f"fit {(alpha + s / beta) * 1e6:>7.0f} us")
print(f"  fit: alpha = {alpha * 1e6:.0f} us a call, beta = {beta / 1e9:.3f} GB/s "
      f"(at n = 2 a ring all-reduce puts 2(n-1)/n = 1 x its size on the wire)")

# %% [markdown]
# ## The model against this machine
#
# Two checks, on the CPU. A single-process step's time against its matmul FLOPs at the measured matmul
# rate (the model's compute term): what it leaves out is every non-matmul op and the Python around
# them. And a `tp = 2` step's communication, whose bytes and calls per phase picockpt counts exactly
# (the rank's report), priced at the fitted $\alpha$ and $\beta$ (modelled from measured rates), beside
# the rank's compute at the measured matmul rate.

# %%
cfg, batch, seq = step_shape(args.mode)
cpu = torch.device("cpu")
params = init_params(cfg, seed=args.seed)
input_ids, targets = make_batch(cfg, batch, seq, cpu, args.seed)
flops = sum(step_flops(cfg, batch, seq, "full").values())
a, b = torch.randn(512, 512), torch.randn(512, 512)  # the CPU's matmul, timed beside the step: the same load
timed = interleaved_seconds({"matmul": lambda: a @ b,
                             "full": lambda: loss_and_grads(params, cfg, input_ids, targets, "full")}, cpu, repeats)
cpu_rate = 2 * 512**3 / timed["matmul"].median  # FLOP/s
explained = Spread(tuple(flops * t_mm / (2 * 512**3) / t_step  # modelled compute / measured step, repeat by repeat
                         for t_mm, t_step in zip(timed["matmul"].samples, timed["full"].samples)))
print(f"policy full, one process: {shape_line(cfg, batch, seq, cpu)}")
if args.mode == "fast":
    print(f"  {FAST_TIMING}")
else:
    print(f"  measured step {timed['full'].text('{:.1f}', scale=1e3)} ms; modelled compute {flops / 1e9:.3f} GFLOP / "
          f"{cpu_rate / 1e9:.2f} GFLOP/s = {flops / cpu_rate * 1e3:.1f} ms: {explained.text('{:.0%}')} of the step, "
          f"repeat by repeat")
with spawning_ranks():
    _, _, reports = parallel.loss_and_grads(params, cfg, input_ids, targets, "full", Layout(tp=2, sp=False),
                                            start_method=START)
report = reports[0]
comm = modelled_comm_seconds(report, alpha, beta, 2)
print("  tp = 2, rank 0 (modelled from measured rates; bytes and calls counted by picockpt):")
for phase in ("forward", "recompute", "backward"):
    latency = report["comm_calls"][phase] * alpha / comm[phase] if comm[phase] else 0.0
    print(f"    {phase:<10} {report['comm_calls'][phase]:>3} calls, {report['comm_bytes'][phase]:>10,} bytes: "
          f"comm {comm[phase] * 1e3:7.2f} ms ({latency:.0%} latency), "
          f"compute {report['flops'][phase] / cpu_rate * 1e3:7.2f} ms")
phases = ("forward", "recompute", "backward")
latency_share = sum(report["comm_calls"][p] for p in phases) * alpha / max(sum(comm[p] for p in phases), 1e-30)
if args.mode == "fast":
    print(f"  what the fit says of alpha and of the step: {FAST_TIMING}")
else:  # each sentence only where this run's own numbers carry it
    print(f"  alpha's share of the modelled communication: {latency_share:.0%}: "
          + ("most of it is the fixed cost of a gloo call over loopback, not bytes over bandwidth; the Playbook's "
             "ratios leave alpha out, and hold where messages are large enough for the bandwidth term to dominate"
             if latency_share > 0.5 else "bytes over bandwidth dominate even at these sizes on this machine"))
    print("  modelled compute / measured step: " + (
        f"{explained.text('{:.0%}')}, short of the step in every repeat: at small shapes the elementwise ops and "
        "Python take a share that FLOPs do not count" if explained.high < 1 else
        f"{explained.text('{:.0%}')}: inconclusive on this machine (not below the step in every repeat)"))

# %% [markdown]
# ## Modelled: a Llama 3 70B layer on 8 GPUs, three links
#
# One layer at $s = 4096$, $b = 1$, bf16, $t = 8$ at the H100's datasheet rate, per phase, with the
# tensor-parallel all-reduces over each link; and the data-parallel gradient all-reduce against the
# backward, as the tokens per GPU grow.

# %%
big = Config.from_preset("llama3-70b", dtype="bf16")
layer = {link: {policy: tp_layer_seconds(big, 1, 4096, 8, H100_BF16, bw, policy) for policy in ("none", "full")}
         for link, bw in LINKS.items()}
print(f"{'link':<16}{'policy':<7}{'compute ms':>11}{'comm ms':>9}{'comm / compute':>16}{'A3 TP ratio':>13}")
for link, by_policy in layer.items():
    for policy, phases in by_policy.items():
        compute, comm_s = (sum(v[i] for v in phases.values()) for i in (0, 1))
        print(f"{link:<16}{policy:<7}{compute * 1e3:>11.3f}{comm_s * 1e3:>9.3f}{comm_s / compute:>16.2f}"
              f"{tp_overlap_ratio(big.hidden, 8, H100_BF16, LINKS[link]):>13.2f}")
for link, bw in LINKS.items():
    print(f"data parallel over {link}, d = 8: the gradient all-reduce hides above "
          f"{hiding_tokens(8, H100_BF16, bw):,.0f} tokens per GPU, "
          f"{hiding_tokens(8, H100_BF16, bw, policy='full'):,.0f} with full recomputation")
STEP_TOKENS = (4096, 8192, 16384, 32768)
step_growth = {k: dp_step_seconds(k, 8, H100_BF16, LINKS["InfiniBand NDR"], policy="full")
               / dp_step_seconds(k, 8, H100_BF16, LINKS["InfiniBand NDR"]) for k in STEP_TOKENS}
print("data parallel over InfiniBand NDR, d = 8: step under full / step under none, at tokens per GPU "
      + ", ".join(f"{k:,}: {growth:.3f}" for k, growth in step_growth.items()))

# %% [markdown]
# Two ratios, two questions. A3's (last column) puts one collective against the single $h \times h$ linear
# that follows it, the finest overlap there is: above 1 even on NVLink in bf16, so one linear cannot hide
# one all-gather. The layer model puts all of a layer's communication against all of its compute, MLP
# included ($3 h f$ weights against $h^2$): 0.36 over NVLink. That share hides only where the framework
# overlaps collectives with matmuls. In the layout modelled here, without sequence parallelism, Megatron-LM
# overlaps half of them: the backward's. Its column-parallel linear (megatron/core/tensor_parallel/layers.py,
# `LinearWithGradAccumulationAndAsyncCommunication`) computes the input gradient, launches its all-reduce
# with `async_op=True` and computes the weight gradient while it runs, waiting on it only before returning
# (`allreduce_dgrad` is set when `world_size > 1 and not self.sequence_parallel`); so each of the backward's
# two all-reduces hides behind a weight-gradient GEMM of the same size as the input-gradient one. The
# forward's two, after the row-parallel attention output and down projections, do sit between the matmul
# that makes their input and the next layer's, with nothing to overlap. The finer overlap, `tp_comm_overlap`
# (ModelParallelConfig, megatron/core/model_parallel_config.py: Transformer Engine splits each linear into
# pieces that overlap an all-gather or a reduce-scatter), is refused without sequence parallelism:
# megatron/training/arguments.py asserts `sequence_parallel` whenever `tp_comm_overlap` is set. With
# sequence parallelism each forward all-reduce becomes an all-gather and a reduce-scatter, $(t-1)/t$ on
# the wire each, the same bytes (lesson 14: the backward moves more), and those are what the overlap hides.
#
# Over NVLink a layer's tensor-parallel communication is a fraction of its compute; over PCIe or
# InfiniBand it is several times the compute, which is why tensor parallelism stays inside a node.
# Recomputation makes it worse: Megatron's recompute runs the forward again, collectives included, and the
# forward has the highest ratio of the three phases (two all-reduces against one forward's FLOPs; the
# backward has two against twice the FLOPs): six all-reduces over four forwards' compute instead of four
# over three, 1.125 times none's ratio. A recompute sweep that stops early (its last layer's output is
# already stored as the next layer's input) would skip the last of those collectives. For data
# parallelism recomputation gives the gradient all-reduce a longer window, not a shorter step: the
# backward under `full` runs 6 tokens·Ψ FLOPs instead of 4, 1.5 times as long to hide behind, so it
# hides from 2/3 of the tokens per GPU (over InfiniBand NDR, d = 8: 11,544 with `full` against 17,316
# without). The step, forward plus the longer of backward and all-reduce, still grows: at 32,768 tokens
# per GPU, where both hide, by the recomputed forward, 8/6 = 1.333 times; at 16,384 by 1.285; at 8,192
# and below, where the all-reduce outlasts even the longer backward, by nothing, the recomputation
# filling time the step spent waiting anyway. It never makes a step shorter.
#
# ## The figure

# %%
fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.8))
left.loglog(sizes, [m * 1e6 for m in medians], "o", color="#4C72B0", label="measured median (2 gloo ranks)")
left.vlines(sizes, [min(reduce_times[s]) * 1e6 for s in sizes], [max(reduce_times[s]) * 1e6 for s in sizes],
            color="#4C72B0", lw=1)
left.loglog(sizes, [m * 1e6 for m in least], "v", color="#4C72B0", ms=4, label="least of the repeats (fitted)")
left.loglog(sizes, [(alpha + s / beta) * 1e6 for s in sizes], "-", color="0.4",
            label=f"fit α + S/β: α = {alpha * 1e6:.0f} µs, β = {beta / 1e9:.2f} GB/s")
left.set_xlabel("all-reduce size S (bytes)")
left.set_ylabel("µs per call")
left.set_title("measured: this machine's all-reduce", fontsize=10)
left.legend(fontsize=7)
left.grid(alpha=0.3, which="both")
x, labels = 0, []
for link, by_policy in layer.items():
    for policy, phases in by_policy.items():
        bottom = 0.0
        for phase, (compute, comm_s) in phases.items():
            middle.bar(x - 0.2, compute * 1e3, 0.38, bottom=bottom, color=PHASE_COLORS[phase])
            bottom += compute * 1e3
        bottom = 0.0
        for phase, (compute, comm_s) in phases.items():
            middle.bar(x + 0.2, comm_s * 1e3, 0.38, bottom=bottom, color=PHASE_COLORS[phase], hatch="//",
                       edgecolor="white")
            bottom += comm_s * 1e3
        labels.append(f"{link.replace(' x16', '').replace('InfiniBand', 'IB')}\n{policy}")
        x += 1
middle.set_xticks(range(len(labels)), labels, fontsize=7)
middle.set_ylabel("ms per layer and rank (modelled)")
middle.set_title("modelled: Llama 3 70B layer, t = 8, s = 4096\nleft bar compute, hatched bar TP all-reduces",
                 fontsize=10)
for phase in ("forward", "recompute", "backward"):
    middle.bar(0, 0, color=PHASE_COLORS[phase], label=phase)
middle.legend(fontsize=7)
tokens = [2**k for k in range(10, 17)]
for (link, bw), color in zip(LINKS.items(), ("#4C72B0", "#DD8452", "#55A868")):
    for policy, style in (("none", "-"), ("full", "--")):
        right.loglog(tokens, [dp_overlap_ratio(k, 8, H100_BF16, bw, policy=policy) for k in tokens], style,
                     color=color, label=f"{link}, {policy}")
right.axhline(1, color="k", lw=0.8)
right.annotate("above 1: exposed; below: hidden behind the backward", (tokens[0], 1), xytext=(2, 4),
               textcoords="offset points", fontsize=7)
right.set_xlabel("tokens per GPU (b · s)")
right.set_ylabel("t_comm / t_backward (modelled)")
right.set_title("modelled: data-parallel gradient all-reduce, d = 8", fontsize=10)
right.legend(fontsize=6, ncol=2)
right.grid(alpha=0.3, which="both")
fig.suptitle("Time from bytes: measured on this machine (left), modelled at H100 datasheet rates (middle, right)")
fig.tight_layout()
path = save_figure(fig, "23_time_from_bytes")
wrote(path)

# %% [markdown]
# ## Exercises
#
# **1.** Appendix A3's tensor-parallel ratio for $h = 8192$, $t = 8$, bf16 ($e = 2$), 989.5 TFLOPS and one
# direction of NVLink 4 (450 GB/s): does an all-gather hide behind the next linear? Give the ratio.

# %%
answer = 1.88

# %%
check("A3's TP ratio, h = 8192, t = 8, bf16, NVLink 4", answer, tp_overlap_ratio(8192, 8, H100_BF16, LINKS["NVLink 4"]),
      why=f"e (t - 1) / (2h) · F / W = 2 · 7 / 16384 · {H100_BF16 / 1e12:g}e12 / {LINKS['NVLink 4'] / 1e9:g}e9: "
          "above 1, so the all-gather alone does not hide behind one linear (A3 counts one byte per element and gets "
          "half of it)")

# %% [markdown]
# **2.** Data parallel over InfiniBand NDR (50 GB/s a direction), $d = 8$, bf16 gradients, 989.5 TFLOPS:
# above how many tokens per GPU does the gradient all-reduce hide behind a `full`-recomputation backward?

# %%
answer = 11_544  # tokens per GPU

# %%
check("tokens per GPU to hide the DP all-reduce under full (InfiniBand, d = 8)", answer,
      hiding_tokens(8, H100_BF16, LINKS["InfiniBand NDR"], policy="full"),
      why=f"(d - 1)/d · 2e F / (6 · tokens · W) = 1 at tokens = 7/8 · 4 · {H100_BF16 / 1e12:g}e12 / "
          f"(6 · {LINKS['InfiniBand NDR'] / 1e9:g}e9); without recomputation the backward is 4 tokens Ψ: "
          f"{hiding_tokens(8, H100_BF16, LINKS['InfiniBand NDR']):,.0f}")

# %% [markdown]
# **3.** In the modelled Llama 3 70B layer over PCIe Gen5 under `full`, how many times its compute does
# the layer's tensor-parallel communication take?

# %%
answer = 2.93

# %%
phases = tp_layer_seconds(big, 1, 4096, 8, H100_BF16, LINKS["PCIe Gen5 x16"], "full")
ratio = sum(v[1] for v in phases.values()) / sum(v[0] for v in phases.values())
check("TP communication / compute, Llama 3 70B layer, PCIe, full", answer, ratio,
      why="6 all-reduces of s·h·2 bytes at 2(t-1)/t on the wire, over 4 forwards' FLOPs / 8 ranks "
          "(tp_layer_seconds); without recomputation 4 over 3: the recomputed forward has the step's highest ratio")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"all-reduce fit alpha (us)": round(alpha * 1e6),
                      "all-reduce fit beta (GB/s)": round(beta / 1e9, 3),
                      "matmul GFLOP/s": round(statistics.median(matmul_rates) / 1e9, 2),
                      "DP hiding tokens IB none/full":
                          f"{hiding_tokens(8, H100_BF16, LINKS['InfiniBand NDR']):,.0f}/"
                          f"{hiding_tokens(8, H100_BF16, LINKS['InfiniBand NDR'], policy='full'):,.0f}"}}

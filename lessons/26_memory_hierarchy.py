# %% [markdown]
# # Lesson 26: the memory hierarchy for recomputed activations
#
# A recompute is priced by the slowest thing it has to do: its arithmetic at the compute rate, or its bytes
# at the bandwidth of the memory they come from. On a GPU the levels are (**datasheet** figures, H100 SXM):
#
# | level | size | what lives there |
# |---|---|---|
# | registers | 256 KB per SM (64K 32-bit registers; Hopper tuning guide) | one thread's operands |
# | shared memory (SRAM) | up to 228 KB per SM, 227 KB per block (Hopper tuning guide) | a kernel's tiles |
# | L2 | 50 MB (H100 architecture whitepaper) | what recently came from HBM |
# | HBM3 | 80 GB at 3.35 TB/s (H100 datasheet) | every tensor a step stores |
#
# Compute: 989 TFLOP/s dense bf16 on the tensor cores (the datasheet's 1,979 is with 2:4 sparsity), and
# 3.9 TFLOP/s of special functions such as `exp` (FlashAttention-3, Shah et al. 2024, sec. 3.2).
#
# **Arithmetic intensity** is FLOPs per byte moved to and from HBM. Below the *ridge point*, peak FLOP/s over
# bandwidth (989 / 3.35 = 295 FLOP/byte on an H100), an op is memory-bound and its time is bytes / bandwidth
# (the roofline model). An elementwise recompute (`cheap`'s RMSNorm and SwiGLU rebuilds) does a few FLOPs per
# element and moves several bytes: it sits hundreds of times below the ridge, so it costs its bytes.
#
# **FlashAttention's recompute is different** (Dao et al. 2022, sec. 3.1; Dao 2023): the forward stores the
# output and the softmax statistics of each row (one log-sum-exp $L_i$ in FlashAttention-2, the maximum and the
# sum in the first); the backward rebuilds each probability tile $P_{ij} = \exp(Q_i K_j^\top / \sqrt{d} - L_i)$
# from Q and K tiles in SRAM and uses it there. P is never written to HBM, so the rebuild costs
# tensor-core FLOPs and `exp`s, not HBM bytes. FlashAttention-1 reports, for GPT-2 medium on an A100
# (seq. 1024, head dim. 64, 16 heads, batch 64, forward + backward): standard attention 66.6 GFLOPs, 40.3 GB of
# HBM reads and writes, 41.7 ms; FlashAttention 75.2 GFLOPs (more: the recompute), 4.4 GB, 7.3 ms. (That A100
# has 192 KB of SRAM on each of its 108 SMs at an estimated 19 TB/s, against 1.5-2.0 TB/s of HBM, the same
# paper's sec. 2.1.)
#
# This CPU has a hierarchy too, and this lesson measures it: picockpt's RMSNorm rebuild over working sets from
# inside the L1 cache to far beyond the last-level cache (sizes read from this machine at run time), a
# matmul, which is FLOP-bound, for contrast, and what recomputation gains from the caches: a consumer reading a
# tensor rebuilt just before it (warm) against one stored long before (back from DRAM).
#
# **Run it** as a script, `python lessons/26_memory_hierarchy.py` (the CPU run, well under a minute; `--fast`
# for seconds), or step through this notebook, where the same flags come from the environment variable
# `PICOCKPT_LESSON_ARGS` (unset: the CPU run). The measured part always runs on this machine's CPU: its caches
# are what it reads; the GPU's figures are datasheet values.

# %%
import contextlib
import os

import matplotlib.pyplot as plt
import torch

from _check import check
from _lesson import (FAST_TIMING, Spread, choose, clock_words, compute_clock, interleaved_seconds, lesson_args,
                     paired_ratios, timed_claim, timing_verdict, wrote)
from picockpt import Config
from picockpt.measurement.cpu_caches import read_cache_sizes
from picockpt.planning.hardware import H100_SXM_BF16, H100_SXM_HBM
from picockpt.ops.rmsnorm import rmsnorm_apply
from picockpt.ops.swiglu import swiglu_forward
from picockpt.teaching.plotting import save_figure

H100_SMEM_PER_SM = 228 * 2**10  # bytes: NVIDIA Hopper tuning guide, "shared memory capacity per SM is 228 KB"
H100_L2 = 50 * 10**6  # bytes: NVIDIA H100 Tensor Core GPU architecture whitepaper, "50 MB L2 cache" (H100 SXM5)
H100_SFU = 3.9e12  # exp/s: FlashAttention-3 (Shah et al. 2024), "only 3.9 TFLOPS of special functions"
SWIGLU_OPS = 5  # FLOPs per element of silu(g) * u = g / (1 + exp(-g)) * u: an exp, an add, a divide, two multiplies
HIDDEN = 128  # the `small` preset's h: the rows the measured RMSNorm rebuild normalises
CALLS_PER_SAMPLE = 8  # consumer calls (each after its own eviction) averaged into one sample of the cache experiment

# %% [markdown]
# ## The roofline, in three functions
#
# `arithmetic_intensity` is FLOPs over bytes; `attainable_rate` the roofline, the least of the peak and
# intensity times bandwidth; `least_seconds` the time of an op that can go no faster than its slowest
# resource (FLOPs, bytes, and for softmax the `exp`s).

# %%
def arithmetic_intensity(flops, nbytes):
    """FLOPs per byte moved to and from memory."""
    if nbytes <= 0:
        raise ValueError(f"nbytes={nbytes}: an op moves at least one byte (its output)")
    return flops / nbytes


def attainable_rate(intensity, peak, bandwidth):
    """The roofline: FLOP/s an op of this intensity can reach, min(peak, intensity x bandwidth)."""
    return min(peak, intensity * bandwidth)


def least_seconds(flops, nbytes, peak, bandwidth, exps=0, exp_rate=H100_SFU):
    """The least time of an op: its slowest resource, FLOPs / peak, bytes / bandwidth or exps / exp rate."""
    return max(flops / peak, nbytes / bandwidth, exps / exp_rate)


# %% [markdown]
# ## What each recompute of one Llama layer costs, on a datasheet H100
#
# For one sequence of $s$ tokens of Llama 3 8B in bf16 ($e = 2$ bytes): FLOPs and the least HBM bytes of each
# recompute, as a fused kernel would move them (each input read once, the output written once). The
# standard attention recompute writes P to HBM and the backward reads it back; FlashAttention's reads Q, K
# and the log-sum-exp and keeps every P tile in SRAM (the least bytes: it reads K again for every query
# block, and L2 serves part of those re-reads).

# %%
def recompute_costs(cfg, s, e=2):
    """{op: (FLOPs, least HBM bytes, exps)} of the recomputes of one layer at s tokens, e bytes an element."""
    h, f, H, KV, hd = cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.head_dim
    causal = s * (s + 1) // 2  # (query, key) pairs a causal head computes
    qk = (H + KV) * s * hd * e  # read q and k: (s, H*hd) and (s, KV*hd)
    return {
        "RMSNorm rebuild": (2 * s * h, 2 * s * h * e + 4 * s + h * e, 0),  # x*rstd*w: read x, rstd, w; write y
        "SwiGLU rebuild": (SWIGLU_OPS * s * f, 3 * s * f * e, s * f),  # read gate, up; write the product
        "P rebuilt, written to HBM": (2 * H * causal * hd, qk + 4 * s * H + 2 * H * causal * e, H * causal),
        "P rebuilt in SRAM (flash)": (2 * H * causal * hd, qk + 4 * s * H, H * causal),  # P never leaves SRAM
        "down projection (matmul)": (2 * s * f * h, (s * f + f * h + s * h) * e, 0),  # for contrast
    }


llama8 = Config.from_preset("llama3-8b", dtype="bf16")
S = 4096
costs = recompute_costs(llama8, S)
ridge = H100_SXM_BF16 / H100_SXM_HBM
print(f"H100 SXM (datasheet): {H100_SXM_BF16 / 1e12:.0f} TFLOP/s bf16 dense, {H100_SXM_HBM / 1e12:.2f} TB/s HBM3: "
      f"ridge point {ridge:.0f} FLOP/byte")
print(f"Llama 3 8B, one layer, s = {S}, bf16 (modelled):")
print(f"{'recompute':<28}{'GFLOP':>9}{'HBM MB':>10}{'FLOP/byte':>11}{'bound by':>10}{'least us':>10}")
for op, (flops, nbytes, exps) in costs.items():
    times = {"FLOPs": flops / H100_SXM_BF16, "bytes": nbytes / H100_SXM_HBM, "exps": exps / H100_SFU}
    print(f"{op:<28}{flops / 1e9:>9.2f}{nbytes / 1e6:>10.1f}{arithmetic_intensity(flops, nbytes):>11.1f}"
          f"{max(times, key=times.get):>10}"
          f"{least_seconds(flops, nbytes, H100_SXM_BF16, H100_SXM_HBM, exps) * 1e6:>10.1f}")
flash_flops, flash_bytes, flash_exps = costs["P rebuilt in SRAM (flash)"]
print(f"P rebuilt in SRAM: its FLOPs take {flash_flops / H100_SXM_BF16 * 1e6:.1f} us on the tensor cores, its exps "
      f"{flash_exps / H100_SFU * 1e6:.1f} us, its bytes {flash_bytes / H100_SXM_HBM * 1e6:.1f} us")
tile = 128 * 128 * 4  # one FA-2 tile of fp32 scores, B_r = B_c = 128
print(f"a 128 x 128 fp32 probability tile is {tile // 2**10} KiB, within the {H100_SMEM_PER_SM // 2**10} KiB of "
      f"shared memory an SM has; one head's whole P at s = {S} is {S * S * 2 / 2**20:.0f} MiB in bf16, and the "
      f"layer's {llama8.heads} heads {llama8.heads * S * S * 2 / 1e9:.2f} GB, "
      f"{llama8.heads * S * S * 2 / H100_L2:.0f}x "
      f"the {H100_L2 / 1e6:.0f} MB L2")

# %% [markdown]
# Read the "bound by" column. The elementwise rebuilds are bound by their bytes: their FLOPs would take a
# fraction of that time. Written to HBM, the rebuilt P costs over a gigabyte of traffic per layer; rebuilt in
# SRAM it costs what its FLOPs and `exp`s cost, and those two take about as long as each other: $Q K^\top$
# does $2 \cdot hd = 256$ FLOPs per `exp` at head dimension 128, and the tensor cores are about 254 times faster
# than the `exp` units (the reason FlashAttention-3 overlaps the softmax of one tile with the matmuls of
# another). Either way the rebuild takes a fraction of the layer's matmuls and no HBM traffic for P: that is
# why FlashAttention's recompute is nearly free, and why the `selective` drop has nothing left to take
# (lesson 13).
#
# ## Measured on this CPU: the same rebuild in cache and from DRAM
#
# The RMSNorm rebuild of `picockpt/model/layer.py` (`rmsnorm_apply`, $y = w \cdot (x \cdot r)$ over rows of
# $h = 128$), written into a kept output buffer so that no step allocates (a fresh allocation would add the
# operating system's page faults to the DRAM sizes). Eager PyTorch runs it as two passes: $x \cdot r$ into the
# output, then the output times $w$ in place, $4 N h + N + h$ elements read and written. Each timed step runs
# it often enough to move about 64 MB (milliseconds: longer than the moments another program holds the core
# for), so the fixed cost of a call (microseconds of Python and dispatch) is a
# small part of the large sizes and a visible part of the smallest. All sizes, the SwiGLU rebuild (`swiglu_forward`)
# in L2 and a 512 x 512 matmul are timed in interleaved repeats.

# %%
def norm_rebuild(x, rstd, weight, out):
    """rmsnorm_apply(x, rstd, weight) into `out`: two eager passes, no allocation."""
    torch.mul(x, rstd, out=out)  # (N, h) pass 1: read x and rstd, write x * rstd
    return out.mul_(weight)  # (N, h) pass 2: read it and w, write w * (x * rstd)


def swiglu_rebuild(gate, up, out):
    """swiglu_forward(gate, up) into `out`: silu(g) * u = sigmoid(g) * g * u, three eager passes."""
    torch.sigmoid(gate, out=out)  # (N, f) pass 1: read g, write sigmoid(g)
    return out.mul_(gate).mul_(up)  # (N, f) passes 2 and 3: times g (silu), times u


def norm_rows(working_set, h=HIDDEN):
    """Rows N of the rebuild whose x and out (N, h), rstd (N, 1) and w (h,) fp32 fill working_set bytes."""
    return max(1, working_set // ((2 * h + 1) * 4))


def norm_operands(working_set, h=HIDDEN):
    """(x, rstd, weight, out) whose bytes, x and out (N, h), rstd (N, 1) and w (h,) fp32, fill working_set."""
    rows = norm_rows(working_set, h)
    return torch.randn(rows, h), torch.rand(rows, 1) + 0.5, torch.randn(h), torch.empty(rows, h)


def eager_norm_bytes(rows, h=HIDDEN):
    return (4 * rows * h + rows + h) * 4  # pass 1 reads x, rstd and writes; pass 2 reads it, w and writes


def timed_steps(working_sets, step_bytes):
    """{size: step()} for every working set, each step repeating the rebuild until it moves about step_bytes,
    {size: elements one step computes} and {size: bytes one step reads and writes}."""
    steps, elements, moved = {}, {}, {}
    for size in working_sets:
        x, rstd, w, out = norm_operands(size)
        times = max(1, step_bytes // eager_norm_bytes(x.shape[0]))
        steps[size] = lambda x=x, r=rstd, w=w, o=out, n=times: [norm_rebuild(x, r, w, o) for _ in range(n)]
        elements[size], moved[size] = times * x.numel(), times * eager_norm_bytes(x.shape[0])
    return steps, elements, moved


def level_of(size, caches):
    """The smallest data cache a working set of `size` bytes fits in, or DRAM."""
    return next((name for name, capacity in caches.data_levels if size <= capacity), "DRAM")


def speed_of(size, per_element, streamed):
    """What the measurement says of a working set, whatever the cache sizes promise: its time per element over that
    of the one that streams from DRAM, repeat by repeat: 'faster' when every repeat is below 1, 'slower' when
    every one is above (the smallest sets: a call's fixed cost over too few bytes), else 'DRAM speed'."""
    ratio = paired_ratios(per_element[size], per_element[streamed])
    return "faster" if ratio.high < 1 else "slower" if ratio.low > 1 else "DRAM speed"


# %%
args = lesson_args()
fast = args.mode == "fast"
caches = read_cache_sizes()
print(f"this machine's caches ({caches.source}): " + ", ".join(f"{name} {size // 2**10:,} KiB"
                                                            for name, size in caches.levels.items()))
if caches.note:
    print(caches.note)
if args.device.type != "cpu":
    print(f"--device {args.device}: the measured part runs on the CPU, whose caches were read")
last_name, last_size = caches.last_level
in_cache = caches.size("L2") // 2  # half of L2: room for the rest of the program beside it
streamed = choose(args.mode, fast=2, cpu=8, large=8) * last_size  # far beyond the last level: it streams from DRAM
sweep = sorted({16 * 2**10 * 2**k for k in range(24) if 16 * 2**10 * 2**k < streamed} | {in_cache, streamed})
working_sets = choose(args.mode, fast=[16 * 2**10, in_cache, streamed], cpu=sweep, large=sweep)
repeats, step_bytes = choose(args.mode, fast=(1, 2**20), cpu=(9, 64 * 2**20), large=(15, 64 * 2**20))
steps, elements, moved = timed_steps(working_sets, step_bytes)
x, rstd, w, out = norm_operands(in_cache)
rebuild_matches = torch.equal(norm_rebuild(x, rstd, w, out), rmsnorm_apply(x, rstd, w))  # bitwise picockpt's
gate, up = torch.randn(in_cache // 12), torch.randn(in_cache // 12)  # (n,) each: with the output 12 bytes an element
product = torch.empty_like(gate)  # (n,)
swiglu_matches = torch.allclose(swiglu_rebuild(gate, up, product), swiglu_forward(gate, up), rtol=1e-5, atol=1e-6)
times = max(1, step_bytes // (8 * 4 * gate.numel()))  # its three passes read and write 8 elements per element
steps["swiglu"] = lambda: [swiglu_rebuild(gate, up, product) for _ in range(times)]
elements["swiglu"] = times * gate.numel()
a, b = torch.randn(512, 512), torch.randn(512, 512)  # (512, 512) each
steps["matmul"] = lambda: a @ b  # (512, 512): 2 * 512^3 FLOPs
timing = interleaved_seconds(steps, torch.device("cpu"), repeats, clock=compute_clock("cpu"))
per_element = {name: Spread(tuple(t / elements[name] for t in timing[name].samples)) for name in elements}
bandwidth = {size: Spread(tuple(moved[size] / t for t in timing[size].samples)) for size in working_sets}
matmul_rate = Spread(tuple(2 * 512**3 / t for t in timing["matmul"].samples))  # FLOP/s of each repeat
print(f"\nRMSNorm rebuild (eager, two passes), h = {HIDDEN}, fp32, {repeats} interleaved repeats, "
      f"{clock_words(compute_clock('cpu'))}, median [min..max]:")
print(f"{'working set':>12}{'fits in':>9}{'runs at':>14}{'ns per element':>26}{'GB/s read + written':>26}")
for size in working_sets:
    speed = "-" if fast else speed_of(size, per_element, streamed)  # --fast: one short repeat says nothing
    print(f"{size / 2**10:>9,.0f} KiB{level_of(size, caches):>9}{speed:>14}"
          f"{per_element[size].text('{:.3f}', 1e9):>26}{bandwidth[size].text('{:.1f}', 1e-9):>26}")
slow_in_last = [size for size in working_sets if not fast and level_of(size, caches) == last_name
                and speed_of(size, per_element, streamed) != "faster"]
slowest = [size for size in working_sets if not fast and level_of(size, caches) not in (last_name, "DRAM")
           and speed_of(size, per_element, streamed) == "slower"]  # within a core's own caches, yet slower
if slow_in_last:
    sizes = sorted({min(slow_in_last), max(slow_in_last)})
    print(f"{' to '.join(f'{size / 2**10:,.0f}' for size in sizes)} KiB fit the {last_name} by its "
          f"size ({last_size / 2**10:,.0f} KiB) and run at DRAM speed: that cache is the socket's, shared by every "
          f"core on it, and this process gets a share")
if slowest:
    call_us = [timing[size].median / (elements[size] / (norm_rows(size) * HIDDEN)) * 1e6 for size in slowest]
    print(", ".join(f"{size / 2**10:,.0f} KiB" for size in slowest) + " ran slower an element than from DRAM in "
          f"every repeat: a call there takes " + ", ".join(f"{us:.1f} us" for us in call_us) + " for "
          + ", ".join(f"{norm_rows(size) * HIDDEN:,}" for size in slowest) + " elements, a fixed cost (Python and "
          f"the dispatcher) that so few bytes cannot hide")
print(f"matmul 512 x 512 fp32: {matmul_rate.text('{:.1f}', 1e-9)} GFLOP/s"
      + (f" ({FAST_TIMING})" if fast else ""))

# %% [markdown]
# The same two passes and the same FLOPs per element at every size, and the same bytes per element but
# for the weight, read once a call; what changes is where the bytes come from. "Fits in" is arithmetic on the sizes
# sysfs gives; "runs at" is the measurement's verdict (each size's time per element against the DRAM-sized set's,
# repeat by repeat: faster or slower in every repeat, or DRAM speed), and the two can part. The L3 that sysfs reports
# is the socket's, shared by every core on it (on a cloud machine, with other tenants' cores), so a working set well
# under its size can still stream from DRAM: where the column says "DRAM speed" under an L3 label, the measured
# time, not the label, is what a recompute of that size pays. Three ratios, each taken within a repeat, each through
# the timing guard: the rebuild from DRAM against in L2; the SwiGLU rebuild against the RMSNorm rebuild, both in L2
# (the SwiGLU's passes move twice the bytes per element, and its `exp` is real arithmetic on a CPU core); and the
# rebuild's time per FLOP against the matmul's.

# %%
bytes_per_element = {size: moved[size] / elements[size] for size in working_sets}  # exact: the eager passes' count
norm_ratio = paired_ratios(per_element[streamed], per_element[in_cache])
norm_claim = timed_claim(args.mode, norm_ratio, "RMSNorm rebuild, time per element from DRAM / in L2", ">1")
print(norm_claim.text)
print(f"  by work: {bytes_per_element[streamed]:.3f} bytes read and written per element from DRAM, "
      f"{bytes_per_element[in_cache]:.3f} in L2 (the weight's {HIDDEN} elements are read once a call): a ratio of "
      f"{bytes_per_element[streamed] / bytes_per_element[in_cache]:.4f}, and 2 FLOPs per element at both")
if norm_claim.conclusive:
    print(f"  the same rebuild at the same bytes and FLOPs per element takes {norm_ratio.median:.1f}x the time "
          f"when its working set ({streamed / 2**20:.0f} MiB) streams from DRAM instead of sitting in L2 "
          f"({in_cache // 2**10} KiB): an elementwise recompute is priced by where its bytes come from")
swiglu_ratio = paired_ratios(per_element["swiglu"], per_element[in_cache])
swiglu_work = 8 * 4 / bytes_per_element[in_cache]  # by bytes: its 3 passes move 8 elements per element, fp32
swiglu_claim = timed_claim(args.mode, swiglu_ratio, "time per element in L2, SwiGLU rebuild / RMSNorm rebuild", ">1",
                           work=swiglu_work)
print(swiglu_claim.text)
if swiglu_claim.conclusive and swiglu_ratio.low > swiglu_work:
    print(f"  {swiglu_ratio.median:.1f}x, where its bytes alone would make it {swiglu_work:.1f}x: on one CPU core its "
          f"sigmoid's arithmetic (an exp and a divide an element), not its bytes, prices the SwiGLU rebuild "
          f"({per_element['swiglu'].text('{:.2f}', 1e9)} ns an element); on an "
          f"H100 the exp units are fast enough that bytes price it again (the table above)")
norm_flops, matmul_flops = 2, 2 * 512**3  # per element of the rebuild (x * r, * w); per matmul
per_flop = paired_ratios(Spread(tuple(t / norm_flops for t in per_element[streamed].samples)),
                         Spread(tuple(t / matmul_flops for t in timing["matmul"].samples)))
flop_claim = timed_claim(args.mode, per_flop, "time per FLOP, RMSNorm rebuild from DRAM / matmul", ">1")
print(flop_claim.text)
norm_intensity = arithmetic_intensity(norm_flops * HIDDEN, (4 * HIDDEN + 1) * 4)  # a row: 2h FLOPs, (4h + 1) x 4 bytes
matmul_intensity = arithmetic_intensity(2 * 512**3, 3 * 512**2 * 4)
if flop_claim.conclusive:
    print(f"  a FLOP of the rebuild costs {per_flop.median:.0f}x a FLOP of the matmul here")
else:
    print(f"  modelled: the matmul does {matmul_intensity:.0f} FLOPs per byte, the eager rebuild "
          f"{norm_intensity:.3f}")
cpu_peak, cpu_bandwidth = matmul_rate.median, bandwidth[streamed].median  # this CPU's roofline, measured

# %% [markdown]
# ## Measured on this CPU: a rebuilt tensor is read warm, a stored one cold
#
# A stored activation is written in the forward and read in the backward, with the rest of the step's
# working set (every later layer's activations, and their backwards) passing through the caches in
# between: it comes back from DRAM. A rebuilt one is written just before its consumer reads it: it is read
# from the cache it was just written to. Three steps time this, each call preceded (untimed) by a pass over a
# buffer twice the last-level cache, which evicts what the step will read (the stand-in for the layers in
# between), and by a pass over the consumer's other operands, which leaves them warm in both:
#
# - **stored**: the consumer, $dy \cdot y$ into a kept buffer (a pointwise op of the backward that reads an
#   activation beside a gradient), reads the norm output $y$ the forward stored: cold;
# - **rebuilt, the consumer alone**: $y$ was rebuilt from the stored $x$ and $r$ (`norm_rebuild`, untimed)
#   just before the same consumer reads it: warm;
# - **rebuilt, the rebuild and the consumer**: both timed, the rebuild reading $x$ and $r$ cold.
#
# The first two read the same bytes and do the same FLOPs: what differs is only where $y$ comes from. The
# third against the first says what the rebuild adds in all: it reads $x$ from DRAM where the stored path
# reads $y$ (the same bytes, and $r$'s few more), and adds its own two passes, which run in cache. A call
# takes tens of microseconds, so each sample is the mean of 8 calls in a row (each after its own eviction),
# and the ratios are taken sample by sample. The thread is kept on one core meanwhile (`one_core`): L2 is a
# core's own, and the scheduler of a busy machine may otherwise move the thread between a rebuild and its read.

# %%
def consumer(y, dy, out):
    """A pointwise consumer of y: dy * y into `out` (a backward's elementwise product of a gradient and y)."""
    return torch.mul(dy, y, out=out)  # (N, h): read dy and y, write out


@contextlib.contextmanager
def one_core():
    """Keep this thread on one core (Linux's sched_setaffinity) while the block runs, and say which: L2 is a core's
    own, and a thread the scheduler moves to another core between a rebuild and its read finds a cold L2 there.
    None where the system has no affinity call."""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        yield min(allowed)
    finally:
        os.sched_setaffinity(0, allowed)


def cache_steps(size, evict_bytes, h=HIDDEN):
    """({name: step()}, {name: untimed setup before each call}) of the stored and rebuilt consumers, on tensors
    of `size` bytes each (y, dy, out and x: (N, h) fp32), after a pass over `evict_bytes` of other memory."""
    rows = max(1, size // (h * 4))
    x, rstd, w = torch.randn(rows, h), torch.rand(rows, 1) + 0.5, torch.randn(h)  # what the forward kept
    stored = norm_rebuild(x, rstd, w, torch.empty(rows, h))  # (N, h): y as the forward stored it
    rebuilt, dy, out = torch.empty(rows, h), torch.randn(rows, h), torch.empty(rows, h)  # (N, h) each
    sweep = torch.zeros(max(1, evict_bytes // 4))  # the working set of the layers in between

    def evict():
        sweep.add_(1.0)  # read and write every byte of it: what was in the caches before is gone
        dy.mul_(1.0), out.zero_()  # the consumer's other operands warm again, in both

    def evict_and_rebuild():
        evict()
        norm_rebuild(x, rstd, w, rebuilt)  # y rebuilt just before its use: in cache

    steps = {"stored": lambda: consumer(stored, dy, out),
             "rebuilt: consumer": lambda: consumer(rebuilt, dy, out),
             "rebuilt: rebuild + consumer": lambda: consumer(norm_rebuild(x, rstd, w, rebuilt), dy, out)}
    before = {"stored": evict, "rebuilt: consumer": evict_and_rebuild, "rebuilt: rebuild + consumer": evict}
    return steps, before, {"y": stored, "rebuilt": rebuilt}


# %%
tensor_bytes = caches.size("L2") // 4  # y, dy and out together: three quarters of L2
cache_repeats = choose(args.mode, fast=1, cpu=15, large=25)
steps_cold, before_cold, kept = cache_steps(tensor_bytes, 2 * last_size)
with one_core() as core:  # a rebuilt y stays in the L2 of the core that wrote it only if the reader stays there too
    calls = interleaved_seconds(steps_cold, torch.device("cpu"), cache_repeats * CALLS_PER_SAMPLE,
                                before=before_cold, clock=compute_clock("cpu"))  # each call after its own eviction
cold = {name: Spread(tuple(sum(spread.samples[i:i + CALLS_PER_SAMPLE]) / CALLS_PER_SAMPLE  # a sample: the mean of
                           for i in range(0, len(spread.samples), CALLS_PER_SAMPLE)))  # calls in a row, still paired
        for name, spread in calls.items()}
rebuilt_equal = torch.equal(kept["y"], kept["rebuilt"])  # the rebuild is bitwise the stored y
print(("this thread kept on one core" if core is None else f"this thread kept on core {core}") + "; "
      f"a consumer of y, {tensor_bytes // 2**10} KiB (y, dy and out: {3 * tensor_bytes // 2**10} KiB, within L2), "
      f"each call after a pass over {2 * last_size // 2**20} MiB; {cache_repeats} interleaved repeats, each the mean "
      f"of {CALLS_PER_SAMPLE} calls, {clock_words(compute_clock('cpu'))}, median [min..max], microseconds a call:")
for name, spread in cold.items():
    print(f"  {name:<30}{spread.text('{:.1f}', 1e6)}")
print(f"  the rebuilt y equals the stored one bitwise: {rebuilt_equal}")
warm_ratio = paired_ratios(cold["stored"], cold["rebuilt: consumer"])
warm_claim = timed_claim(args.mode, warm_ratio,
                         "consumer's read, stored (from DRAM) / rebuilt just before (in cache)", ">1", work=1.0)
print(warm_claim.text)
if warm_claim.conclusive:
    print(f"  the same consumer, the same bytes: the rebuilt copy is read from cache, in "
          f"{1 / warm_ratio.median:.2f}x the time the stored one takes to come back from DRAM")
whole_ratio = paired_ratios(cold["rebuilt: rebuild + consumer"], cold["stored"])
print(timing_verdict(args.mode, whole_ratio, "rebuild + consumer / stored consumer, time"))
print(f"  by DRAM bytes the two are the same ({tensor_bytes // 2**10} KiB of x against {tensor_bytes // 2**10} KiB of "
      f"y, and r's {tensor_bytes // HIDDEN // 2**10} KiB): the rebuild adds its two passes over data already in cache")

# %% [markdown]
# ## The figure
#
# Left, measured: the rebuild's bytes read and written per second against its working set, with this
# machine's cache sizes marked (the bars are the spread of the repeats, the dashed line the fastest repeat of
# each size: on a shared machine the least disturbed one). Right, two rooflines: the H100's
# from its datasheet, and this CPU's from the two rates just measured (the matmul's FLOP/s, the rebuild's
# bytes/s from DRAM). On the H100's, each recompute of a Llama 3 8B layer at the rate its intensity allows.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.2))
sizes = [size / 2**10 for size in working_sets]
medians = [bandwidth[size].median / 1e9 for size in working_sets]
left.errorbar(sizes, medians, fmt="o-", color="#4C72B0", ms=4, capsize=2, label="median, bar: min..max",
              yerr=[[m - bandwidth[s].low / 1e9 for m, s in zip(medians, working_sets)],
                    [bandwidth[s].high / 1e9 - m for m, s in zip(medians, working_sets)]])
left.plot(sizes, [bandwidth[size].high / 1e9 for size in working_sets], "--", color="#4C72B0", lw=0.8, alpha=0.7,
          label="the fastest repeat (the least disturbed by other programs)")
for name, size in caches.data_levels:
    left.axvline(size / 2**10, color="0.5", ls=":", lw=1)
    left.annotate(f" {name}\n {size // 2**10:,} KiB", (size / 2**10, 0), xycoords=("data", "axes fraction"),
                  xytext=(2, 4), textcoords="offset points", fontsize=8, color="0.35")
for size, label in ((in_cache, "in L2"), (streamed, "from DRAM")):
    left.annotate(label, (size / 2**10, bandwidth[size].median / 1e9), xytext=(0, 8), textcoords="offset points",
                  ha="center", fontsize=8, weight="bold")
left.set_xscale("log", base=2)
left.xaxis.set_major_formatter(lambda value, _: f"{value / 1024:g} MiB" if value >= 1024 else f"{value:g} KiB")
left.set_ylim(0, max(bandwidth[size].high for size in working_sets) / 1e9 * 1.3)
left.legend(fontsize=7, loc="upper left")
left.set_xlabel("working set: x, the output, rstd and w")
left.set_ylabel("GB/s read + written (eager passes)")
left.set_title(f"measured: RMSNorm rebuild (h = {HIDDEN}, fp32) on this CPU,\nmedian and min..max of {repeats} "
               f"interleaved repeats ({caches.source})", fontsize=10)
left.grid(alpha=0.3)

xs = [0.05 * 1.25**k for k in range(60)]  # FLOP/byte, 0.05 to about 27,000
right.plot(xs, [attainable_rate(x, H100_SXM_BF16, H100_SXM_HBM) / 1e12 for x in xs], color="#C44E52",
           label=f"H100 SXM (datasheet): {H100_SXM_BF16 / 1e12:.0f} TFLOP/s, {H100_SXM_HBM / 1e12:.2f} TB/s")
right.plot(xs, [attainable_rate(x, cpu_peak, cpu_bandwidth) / 1e12 for x in xs], color="#4C72B0",
           label=f"this CPU (measured): {cpu_peak / 1e9:.0f} GFLOP/s, {cpu_bandwidth / 1e9:.1f} GB/s")
for (op, (flops, nbytes, exps)), color, marker in zip(costs.items(), ("#DD8452", "#8172B3", "#937860", "#55A868",
                                                                    "#333333"), "sssDs"):
    intensity = arithmetic_intensity(flops, nbytes)
    rate = flops / least_seconds(flops, nbytes, H100_SXM_BF16, H100_SXM_HBM, exps)
    right.plot(intensity, rate / 1e12, marker, color=color, ms=8 if marker == "D" else 6, alpha=0.85,
               label=f"{op}: {intensity:.1f} FLOP/byte")
right.plot(norm_intensity, norm_flops / per_element[streamed].median / 1e12, "o", color="#4C72B0", mfc="white",
           label="RMSNorm rebuild from DRAM, measured here")
right.plot(matmul_intensity, cpu_peak / 1e12, "o", color="#4C72B0", label="matmul 512 x 512, measured here")
right.set_xscale("log")
right.set_yscale("log")
right.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
right.set_ylabel("attainable TFLOP/s")
right.set_title(f"rooflines; squares and diamond: one Llama 3 8B layer's recomputes at s = {S}, bf16\n"
                f"(their rate on the "
                f"H100 model: exps at {H100_SFU / 1e12:.1f} T/s count too)", fontsize=10)
right.legend(fontsize=6.5, loc="lower right")
right.grid(alpha=0.3, which="both")
fig.suptitle("Where a recompute's bytes come from: this CPU's caches (measured), an H100's roofline (datasheet)"
             + (f" ({FAST_TIMING})" if fast else ""))
fig.tight_layout()
path = save_figure(fig, "26_memory_hierarchy")
wrote(path)

# %% [markdown]
# ## Exercises
#
# **1.** The SwiGLU rebuild as one fused kernel in bf16: it reads the gate and up projections and writes
# their product, 2 bytes each, and does 5 FLOPs per element (an `exp`, an add, a divide, two multiplies). What
# is its arithmetic intensity, in FLOPs per byte?

# %%
answer = 0.8333  # FLOP/byte

# %%
flops, nbytes, _ = recompute_costs(llama8, S)["SwiGLU rebuild"]
swiglu_intensity = arithmetic_intensity(flops, nbytes)
check("arithmetic intensity of the fused bf16 SwiGLU rebuild", answer, swiglu_intensity,
      why=f"{SWIGLU_OPS} FLOPs over 3 elements x 2 bytes per element: {flops:,} FLOPs / {nbytes:,} bytes at "
          f"s = {S}, f = {llama8.ffn} (the same at any shape)")

# %% [markdown]
# **2.** Where does it sit on the H100's roofline (989.5 TFLOP/s dense bf16, 3.35 TB/s, datasheet)? Give the
# rate it can reach at best, in TFLOP/s.

# %%
answer = 2.79  # TFLOP/s

# %%
check("the best rate of the SwiGLU rebuild on an H100's roofline, TFLOP/s", answer,
      attainable_rate(swiglu_intensity, H100_SXM_BF16, H100_SXM_HBM) / 1e12,
      why=f"min(peak, intensity x bandwidth) = min({H100_SXM_BF16 / 1e12:.1f}, {swiglu_intensity:.4f} x "
          f"{H100_SXM_HBM / 1e12:.2f}) TFLOP/s: {ridge / swiglu_intensity:.0f}x below the ridge point of {ridge:.0f} "
          f"FLOP/byte, memory-bound")

# %% [markdown]
# **3.** For one Llama 3 8B layer at $s = 4096$ on an H100: the least time of the SwiGLU rebuild (its
# slowest resource: bytes, FLOPs or `exp`s) over the least time of the down projection's matmul
# ($2 s f h$ FLOPs, compute-bound). By FLOPs it is $5 / (2h) = 0.06\%$; what is it by time?

# %%
answer = 0.2165

# %%
rebuild_s = least_seconds(*costs["SwiGLU rebuild"][:2], H100_SXM_BF16, H100_SXM_HBM, costs["SwiGLU rebuild"][2])
down_s = least_seconds(*costs["down projection (matmul)"][:2], H100_SXM_BF16, H100_SXM_HBM)
check("least time of the SwiGLU rebuild / the down projection, Llama 3 8B, s = 4096, H100", answer,
      rebuild_s / down_s,
      why=f"{costs['SwiGLU rebuild'][1] / 1e6:.1f} MB / {H100_SXM_HBM / 1e12:.2f} TB/s = {rebuild_s * 1e6:.1f} us "
          f"against {costs['down projection (matmul)'][0] / 1e9:.1f} GFLOP / {H100_SXM_BF16 / 1e12:.1f} TFLOP/s = "
          f"{down_s * 1e6:.1f} us: a recompute with almost no FLOPs still costs a fifth of a matmul")

# %%
def timed(spread, spec="{:.3g}", scale=1.0):  # a measured value for the results table
    return FAST_TIMING if fast else spread.text(spec, scale)


RESULT = {"figures": [str(path)],
          "summary": {"caches": ", ".join(f"{n} {s // 2**10:,} KiB" for n, s in caches.data_levels),
                      "ns/element in L2": timed(per_element[in_cache], "{:.3f}", 1e9),
                      "ns/element from DRAM": timed(per_element[streamed], "{:.3f}", 1e9),
                      "DRAM / L2 time per element": norm_claim.short,
                      "consumer of y, stored / rebuilt": warm_claim.short,
                      "rebuilt y = stored y": rebuilt_equal,
                      "matmul GFLOP/s": timed(matmul_rate, "{:.1f}", 1e-9),
                      "H100 ridge FLOP/byte": round(ridge, 1),
                      "rebuild = rmsnorm_apply": rebuild_matches,
                      "rebuild = swiglu_forward": swiglu_matches}}

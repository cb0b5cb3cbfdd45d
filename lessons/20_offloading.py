# %% [markdown]
# # Lesson 20: offloading: a third action beside keeping and recomputing
#
# A tensor the backward will need can stay on the device (keep), be thrown away and computed again
# (recompute), or be **moved to host memory** in the forward and brought back before the backward
# reads it (offload). Which is cheaper is a question of bytes per FLOP: an offloaded tensor crosses the
# link twice, out in the forward and back in the backward, and costs nothing while both copies, bytes /
# link bandwidth each, hide behind the compute they overlap; a recomputed one costs its FLOPs / compute
# rate, always. Device memory is what offloading saves; host memory and the link are what it spends.
#
# What the frameworks do (each read in its source or documentation):
#
# - PyTorch: `torch.autograd.graph.save_on_cpu(pin_memory=True)` packs every tensor autograd saves into
#   a host buffer and unpacks it back in the backward; both copies run on the current stream, in the
#   pack and unpack hooks (torch/autograd/graph.py).
# - torchtune's `OffloadActivations` (torchtune/training/_activation_offloading.py) uses a second CUDA
#   stream for the copies, keeps up to `max_fwd_stash_size` (5) offloaded activations alive until their
#   copies are done, and in the backward starts each copy back when autograd unpacks the tensor, on
#   the side stream, with the compute stream waiting for it.
# - Megatron-Core offloads whole layers' activations through Transformer Engine's CPU offloading
#   (`cpu_offloading`, `cpu_offloading_num_layers`, fields of megatron/core/model_parallel_config.py;
#   transformer_config.py refuses them together with activation recomputation), and module by module
#   with `--fine-grained-activation-offloading --offload-modules ...`, each listed module's input
#   going to the host (`attn_norm`, `qkv_linear`, `core_attn`, `attn_proj`, `mlp_norm` and the MoE ones),
#   which may be combined with selective recomputation (megatron/core/transformer/moe/README.md,
#   docs/user-guide/features/fine_grained_activation_offloading.md).
# - Transformer Engine's CPU-offloading docs (docs/features/other_optimizations/cpu_offloading) set
#   PCIe Gen5 x16, 128 GB/s with both directions added, against a GB200's NVLink-C2C, 900 GB/s both
#   directions per link; NVIDIA's GH200 datasheet gives Grace Hopper's NVLink-C2C the same 900 GB/s.
#   picockpt/planning/hardware.py holds one direction of each: 63.0 GB/s for PCIe (the 128 GB/s is raw
#   signalling, before 128b/130b encoding) and 450 GB/s for NVLink-C2C.
# - DeepSpeed's activation checkpointing configuration has `cpu_checkpointing`: the checkpointed layers'
#   inputs go to CPU memory, partitioned over model-parallel ranks under `partition_activations` and
#   whole otherwise (docs/_pages/config-json.md, deepspeed/runtime/activation_checkpointing/
#   checkpointing.py). It once required partitioning: issue #541 asks why, and PR #1254 lifted it.
# - Planners that choose per tensor: Capuchin (Peng et al., ASPLOS 2020) swaps first and recomputes what
#   cannot be hidden, from access patterns it tracks at run time; POET (Patil et al., ICML 2022) solves
#   a mixed-integer linear programme over rematerialisation and paging (for energy on tiny devices);
#   Checkmate (Jain et al. 2020) did the same for recomputation alone.
#
# picockpt's version (picockpt/recompute/offload.py): the store's put may go to a host tier; on CUDA into pinned
# buffers, copied on a side stream ordered with events; the engine prefetches layer i-1's tensors while
# layer i's backward runs. On the CPU the same code runs with the host tier in ordinary memory: the
# copies are real, their time is **modelled** (host_walk.py) and printed as modelled. Every time
# below is labelled measured or modelled.
#
# **Run it** as a script, `python lessons/20_offloading.py` (the CPU run, about a minute; `--fast` for
# seconds; `--device cuda` to measure the copies' overlap on a GPU), or step through this notebook,
# where the same flags come from the environment variable `PICOCKPT_LESSON_ARGS`.

# %%
import matplotlib.pyplot as plt
import torch

from _check import check
from _lesson import FAST_TIMING, choose, device_name, lesson_args, shape_line, small, wrote
from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import chain_sizes, layer_flops, layer_inventory, predicted_host_bytes, predicted_peak_bytes
from picockpt.measurement.measure import make_batch
from picockpt.planning.planner import frontier, least_budget, model_chain
from picockpt.planning.hardware import H100_SXM_BF16, H200_SXM_BF16, NVLINK_C2C, PCIE_GEN5_X16
from picockpt.planning.host_walk import DEFAULT_COMPUTE_RATE, DEFAULT_HOST_BANDWIDTH
from picockpt.planning.planner_offload import plan_offload
from picockpt.teaching.plotting import save_figure
from picockpt.measurement.tracker import Tracker

LINKS = {"PCIe Gen5 x16": PCIE_GEN5_X16, "NVLink-C2C": NVLINK_C2C}  # bytes/s, one direction (picockpt/planning/hardware.py)
RATES = {"H100 SXM": H100_SXM_BF16, "H200 SXM": H200_SXM_BF16}  # dense BF16 FLOP/s (picockpt/planning/hardware.py)

# %% [markdown]
# ## Device bytes against host bytes, measured
#
# One tracked step per policy on the `small` preset. The store counts device bytes and host bytes apart
# (every store event says where its tensor is); the closed forms (`predicted_peak_bytes`,
# `predicted_host_bytes`, picockpt/planning/step_forms.py) walk the same loop on byte counts and must agree to the
# byte. With $X$ one layer input, $A$ one stored layer (input included), $F$ the head's tensors:
#
# - `offload` (= `full+offload`): device peak $\max(F + X,\ A + X)$, host $L \cdot X$: a layer is
#   recomputed from its input while the next layer's input comes back;
# - `none+offload`: device peak $\max(F + A,\ 2A)$, host $L \cdot A$: two layers meet on the device,
#   the one running its backward and the one coming back;
# - `every:C+offload`: device peak $\max(F + X,\ C \cdot A,\ A + X)$, host the $\lceil L/C \rceil$ checkpoints.

# %%
args = lesson_args()
cfg = small() if args.mode != "fast" else small(layers=4)
batch, seq = choose(args.mode, fast=(2, 32), cpu=(4, 128), large=(8, 512))
POLICIES = ("none", "full", "every:2", "selective", "offload", "every:2+offload", "none+offload",
            "offload:mlp.gate,mlp.up", "cheap+offload")
params = init_params(cfg, seed=args.seed, device=args.device)
input_ids, targets = make_batch(cfg, batch, seq, args.device, args.seed)
torch.manual_seed(args.seed)
base_loss, base_grads = loss_and_grads(params, cfg, input_ids, targets, "none")
rows = []
for policy in POLICIES:
    torch.manual_seed(args.seed)
    with Tracker(args.device, flops=False) as tracker:
        loss, grads = loss_and_grads(params, cfg, input_ids, targets, policy, tracker=tracker)
    bitwise = torch.equal(loss, base_loss) and all(torch.equal(grads[k], base_grads[k]) for k in base_grads)
    layer_forms = (predicted_peak_bytes(cfg, batch, seq, policy), predicted_host_bytes(cfg, batch, seq, policy))
    rows.append(dict(policy=policy, device=tracker.peak_logical, host=tracker.peak_host, bitwise=bitwise,
                     exact=(tracker.peak_logical, tracker.peak_host) == layer_forms,
                     live=tracker.peak_physical, exposed=tracker.exposed_copy_seconds))
print(f"measured on {shape_line(cfg, batch, seq, args.device)}")
print(f"{'policy':<26}{'device peak':>14}{'host peak':>14}{'peak live':>14}  closed forms  bitwise = none")
for r in rows:
    print(f"{r['policy']:<26}{r['device'] / 2**20:>10.2f} MiB{r['host'] / 2**20:>10.2f} MiB"
          f"{r['live'] / 2**20:>10.2f} MiB  {'exact' if r['exact'] else 'DIFFER':<12}  {r['bitwise']}")
assert all(r["exact"] and r["bitwise"] for r in rows)

# %% [markdown]
# ## Which tensors are worth moving: bytes per FLOP
#
# A Llama 3 8B layer in bf16 (eager attention, so the probabilities are there to look at), one sequence,
# $W$ one direction of the link, $R$ the compute rate. Two ratios per stored tensor:
#
# - **unhidden**: its bytes over the matmul FLOPs that rebuild it from what stands just before it. Moved,
#   a tensor crosses the link twice, so with neither copy hidden moving costs $2 \cdot \text{bytes} / W$
#   against recomputing's $\text{FLOPs} / R$, and beats it only below $W/(2R)$: 3.2e-5 B/FLOP for PCIe
#   Gen5 at 989.5 TFLOP/s (H100 and H200 SXM have the same dense BF16 rate; the H200's gain is its
#   memory), 2.3e-4 B/FLOP over NVLink-C2C. The projections' ratio is $1/h$ = 2.4e-4 B/FLOP whatever $T$, above
#   both: a projection is cheaper to recompute than to move *unless the copies hide*.
# - **hidden**: its bytes over one layer's forward FLOPs. The copy out overlaps the next layer's forward,
#   the copy back a backward twice as long, so the copy out is the one to hide: below $W/R$ (6.4e-5
#   B/FLOP for PCIe, 4.5e-4 B/FLOP over NVLink-C2C) both copies cost nothing. The layer's FLOPs grow with $T^2$
#   (attention) while a projection's bytes grow with $T$, so every tensor but the $T \times T$
#   probabilities hides better at long sequences.
#
# The elementwise tensors (norm outputs, the SwiGLU product) rebuild with no matmul at all: recomputing
# them is always the cheaper action, which is why the planner drops them (`cheap`) and moves others.

# %%
llama = Config.from_preset("llama3-8b", dtype="bf16", attention="eager", max_seq=32768)


def recompute_flops_of(cfg, seq):
    """name -> matmul FLOPs that rebuild the tensor from the ones just before it, one sequence."""
    h, kv, f, T = cfg.hidden, cfg.kv_dim, cfg.ffn, seq
    core = layer_flops(cfg, 1, seq)["scores"]
    return {"attn.q": 2 * T * h * h, "attn.k": 2 * T * h * kv, "attn.v": 2 * T * h * kv, "attn.probs": core,
            "attn.context": core, "mlp.gate": 2 * T * h * f, "mlp.up": 2 * T * h * f}


def bytes_per_flop(cfg, seq, hidden=False):
    """name -> bytes per FLOP: of its own rebuild (hidden=False), or of one layer's forward (hidden=True)."""
    inventory, layer = layer_inventory(cfg, 1, seq), sum(layer_flops(cfg, 1, seq).values())
    return {name: inventory[name][2] / (layer if hidden else flops)
            for name, flops in recompute_flops_of(cfg, seq).items()}


def break_even(bandwidth, rate, hidden=False):
    """Bytes per FLOP below which moving a tensor beats recomputing it (modelled). Unhidden, both copies cost
    time: 2 bytes / W < FLOPs / R. Hidden, the copy out overlaps a layer's forward (the copy back a backward
    twice as long): bytes / W < forward FLOPs / R."""
    return bandwidth / rate if hidden else bandwidth / (2 * rate)


def layer_hides(cfg, seq, bandwidth, rate):
    """Modelled: does the copy of one whole stored layer hide behind one layer's forward?"""
    _, A, _ = chain_sizes(cfg, 1, seq)
    return A / bandwidth <= sum(layer_flops(cfg, 1, seq).values()) / rate


seqs = choose(args.mode, fast=[1024, 8192], cpu=[1024, 2048, 4096, 8192, 16384, 32768],
              large=[1024, 2048, 4096, 8192, 16384, 32768])
unhidden = bytes_per_flop(llama, seqs[-1])
hidden = {T: bytes_per_flop(llama, T, hidden=True) for T in seqs}
print("modelled: bytes per FLOP of each tensor of a Llama 3 8B layer (bf16), one sequence")
print(f"{'tensor':<14}{'own rebuild T=' + str(seqs[-1]):>22}  against one layer's forward at" +
      "".join(f"{'T=' + str(T):>10}" for T in seqs))
for name in unhidden:
    print(f"{name:<14}{unhidden[name]:>22.2e}  {'':<30}" + "".join(f"{hidden[T][name]:>10.2e}" for T in seqs))
for link, W in LINKS.items():
    for gpu, R in RATES.items():
        moves = [name for name, ratio in unhidden.items() if ratio < break_even(W, R)]
        since = {name: next((T for T in seqs if hidden[T][name] < break_even(W, R, hidden=True)), None)
                 for name in unhidden}
        whole = next((T for T in seqs if layer_hides(llama, T, W, R)), None)
        print(f"  {link} on {gpu}: W/(2R) = {break_even(W, R):.2e}, W/R = {break_even(W, R, hidden=True):.2e} "
              f"B/FLOP. Cheaper to move than rebuild, unhidden: "
              f"{', '.join(moves) or 'none'}. Hides alone behind a layer's forward from T = "
              + ", ".join(f"{name} {T or 'never'}" for name, T in since.items())
              + f"; the whole layer from T = {whole or 'never (within these lengths)'}")

# %% [markdown]
# ## The three-action planner beside the two-action one
#
# `plan_offload` (picockpt/planning/planner_offload.py) starts from every plan of the two-action frontier
# (rotor's dynamic programme, lesson 12) and tries each with the first $n$ layers' tensors offloaded
# (all of them, only the checkpoints, or only the MLP's gate and up outputs), keeping the fastest whose
# device peak, walked exactly, fits the budget. The two-action plan is one of the candidates, so the
# three-action plan is never slower by the model; the model counts a copy only where it cannot hide
# (one side stream, first in first out; the compute stream waits only for a prefetch that has not
# landed). The frontier: device bytes against modelled step time, for a Llama-3-8B-shaped stack
# (bf16, flash attention) at PCIe and at NVLink-C2C bandwidth, 989.5 TFLOP/s.

# %%
stack = Config.from_preset("llama3-8b", dtype="bf16", attention="fused", max_seq=8192,
                           layers=choose(args.mode, fast=4, cpu=8, large=8))
stack_seq = choose(args.mode, fast=1024, cpu=4096, large=4096)
chain = model_chain(stack, 1, stack_seq)
least, most = least_budget(chain), predicted_peak_bytes(stack, 1, stack_seq, "none")
budgets = [least + (most - least) * k // 10 for k in range(11)]
curves = {}
for link, W in LINKS.items():
    plans = [plan_offload(stack, 1, stack_seq, b, bandwidth=W, rate=DEFAULT_COMPUTE_RATE) for b in budgets]
    curves[link] = [(p.peak_bytes, p.walk.seconds, p.two_action_walk.device_peak,
                     p.two_action_walk.seconds, p.walk.host_peak) for p in plans]
two_action = [(p.peak_bytes, p.recompute_flops) for p in frontier(chain)]
print(f"modelled: L={stack.layers} Llama-3-8B layers, 1 x {stack_seq} tokens, bf16, "
      f"{DEFAULT_COMPUTE_RATE / 1e12:.1f} TFLOP/s")
print(f"{'budget':>10}" + "".join(f"{link + ' 3-action':>26}{'2-action':>12}{'host':>10}" for link in LINKS))
for k, b in enumerate(budgets):
    print(f"{b / 2**30:>6.2f} GiB" + "".join(f"{curves[link][k][1] * 1e3:>23.2f} ms{curves[link][k][3] * 1e3:>9.2f} ms"
                                             f"{curves[link][k][4] / 2**30:>6.2f} GiB" for link in LINKS))
faster = {link: sum(c[1] < c[3] for c in curves[link]) for link in LINKS}
print(f"three-action strictly faster at {faster} of {len(budgets)} budgets; never slower: "
      f"{all(c[1] <= c[3] for link in LINKS for c in curves[link])}")

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
x = range(len(rows))
left.bar([i - 0.2 for i in x], [r["device"] / 2**20 for r in rows], 0.4, label="device (store peak)")
left.bar([i + 0.2 for i in x], [r["host"] / 2**20 for r in rows], 0.4, label="host (peak)")
left.set_xticks(list(x), [r["policy"] for r in rows], rotation=35, ha="right", fontsize=7)
left.set_ylabel("MiB (measured, equal to the closed forms)")
left.set_title(f"measured: device against host bytes\nsmall preset, {batch} x {seq} tokens", fontsize=10)
left.legend(fontsize=8)
for (link, curve), color in zip(curves.items(), ("#4C72B0", "#DD8452")):
    right.plot([c[0] / 2**30 for c in curve], [c[1] * 1e3 for c in curve], "o-", color=color,
               label=f"keep / recompute / offload, {link}")
right.plot([c[2] / 2**30 for c in curves["PCIe Gen5 x16"]], [c[3] * 1e3 for c in curves["PCIe Gen5 x16"]], "k--",
           label="keep / recompute (two actions)")
right.set_xlabel("device peak of the store (GiB)")
right.set_ylabel("step time (ms, modelled)")
right.set_title(f"modelled: the frontier, {stack.layers} Llama-3-8B layers, 1 x {stack_seq}, "
                f"{DEFAULT_COMPUTE_RATE / 1e12:.1f} TFLOP/s", fontsize=10)
right.legend(fontsize=7)
right.grid(alpha=0.3)
fig.tight_layout()
path = save_figure(fig, "20_offloading", fast=args.mode == "fast")
wrote(path)

# %% [markdown]
# ## What a GPU shows, and what the CPU shows
#
# On a GPU the copies run on their own stream while the compute stream works; the tracker measures, with
# CUDA events, how long the compute stream waited for a prefetch that had not landed (the exposed copy
# time), and `torch.cuda.max_memory_allocated` shows the device bytes really freed. One thing the store's
# count does not show: an offloaded tensor's device memory is handed back to the allocator only when its
# copy has read it (record_stream), so a copy that lags keeps memory in flight. On a CPU there is one
# engine and one memory: the copies are real, the bookkeeping (device bytes, host bytes, bytes each way)
# is the same, exact, and the time is the model's.

# %%
for r in rows:
    if "offload" in r["policy"]:
        if r["exposed"] is not None:
            print(f"measured on {device_name(args.device)}: {r['policy']}: exposed copy time "
                  f"{r['exposed'] * 1e3:.3f} ms")
        else:
            print(f"{r['policy']}: exposed copy time not measured on a CPU (no second engine to overlap with); "
                  f"the model at {DEFAULT_HOST_BANDWIDTH / 1e9:.1f} GB/s and {DEFAULT_COMPUTE_RATE / 1e12:.1f} TFLOP/s "
                  f"is in `python -m picockpt measure --policy {r['policy']}`")
if args.mode == "fast":
    print(FAST_TIMING)

# %% [markdown]
# ## Exercises
#
# **1.** Under `none+offload` on the `small` preset at the CPU run's shape, how many layers' worth of
# activations ($A$) are on the device at the store's peak?

# %%
answer = 2

# %%
_, A, F = chain_sizes(small(), 4, 128)
check("layers on the device at none+offload's peak (small, 4 x 128)", answer,
      predicted_peak_bytes(small(), 4, 128, "none+offload") / A, rel=0,
      why=f"max(F + A, 2A) = max({F + A:,}, {2 * A:,}) bytes: layer i's backward runs while layer i-1's tensors "
          f"come back")

# %% [markdown]
# **2.** Over PCIe Gen5 (63.0 GB/s a direction) at 989.5 TFLOP/s, if nothing hid either copy (out in the
# forward, back in the backward), would moving a Llama 3 8B layer's `mlp.gate` be cheaper than recomputing
# it from `mlp_norm.output` (1 for yes, 0 for no)?

# %%
answer = 0

# %%
ratio = bytes_per_flop(llama, 4096)["mlp.gate"]
check("moving mlp.gate unhidden beats recomputing it, PCIe Gen5, H200", answer,
      int(ratio < break_even(PCIE_GEN5_X16, H200_SXM_BF16)), rel=0,
      why=f"its bytes per FLOP, 2 bytes / (2h FLOPs) = 1/h = {ratio:.2e}, are above W/(2R) = "
          f"{break_even(PCIE_GEN5_X16, H200_SXM_BF16):.2e} (two copies of its bytes against one rebuild): "
          f"offloading it pays only because its copies hide behind the rest of the layer's compute")

# %% [markdown]
# **3.** Four Llama 3 8B layers (bf16, flash attention), one sequence of 2048 tokens, at the two-action
# planner's least budget, over PCIe Gen5 at 989.5 TFLOP/s: how many ms (modelled) does the three-action
# plan save?

# %%
answer = 2.19  # ms

# %%
four = Config.from_preset("llama3-8b", dtype="bf16", attention="fused", max_seq=2048, layers=4)
at_least = plan_offload(four, 1, 2048, least_budget(model_chain(four, 1, 2048)), bandwidth=PCIE_GEN5_X16,
                        rate=H200_SXM_BF16)
check("three-action gain at the least two-action budget, 4 Llama 3 8B layers, PCIe (ms, modelled)", answer,
      (at_least.two_action_walk.seconds - at_least.walk.seconds) * 1e3,
      why="the two-action plan recomputes layers from their checkpoints; offloading what hides behind the "
          "next layer's compute keeps some layers whole instead, within the same device bytes")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"policies exact and bitwise": all(r["exact"] and r["bitwise"] for r in rows),
                      "none+offload device/host MiB": f"{rows[6]['device'] / 2**20:.2f}/{rows[6]['host'] / 2**20:.2f}",
                      "3-action faster at budgets (PCIe)": faster["PCIe Gen5 x16"]}}

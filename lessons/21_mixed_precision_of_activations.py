# %% [markdown]
# # Lesson 21: mixed precision of stored and recomputed activations
#
# A bf16 step does not store everything in bf16. picockpt keeps fp32 master weights, computes in bf16,
# and stores each activation in the dtype its op produced: the 16-bit activations (projections,
# attention probabilities, the MLP's $(B, T, f)$ tensors), the residual stream (each layer's input and
# the stream after attention, `mlp_norm.input`) also in bf16, and the *statistics* in fp32: every
# RMSNorm's reciprocal root mean square `rstd`, and, under tiled or fused attention and a chunked loss,
# one log-sum-exp per row (`attn.lse`, `lm_head.lse`). Those are small ($B \cdot T$ or $B \cdot H \cdot T$
# numbers) and sit inside exponentials and divisions, where bf16's 8 significant bits would be too few.
# (Megatron-LM keeps the residual stream in bf16 too unless `--fp32-residual-connection` is set; that
# option keeps it in fp32.)
#
# Two ways to hold fewer bytes, and what each does to the gradients:
#
# - **store narrower**: keep some activations in 8 bits, fp8 e4m3 with one fp32 scale per tensor
#   (amax / 448), and widen them again when the backward takes them out. Half the bytes of a bf16
#   tensor; the gradient now differentiates a rounded copy of the forward.
# - **recompute**: drop them and rebuild them from what was kept, by the forward's own functions on the
#   same inputs. On this CPU the rebuilt tensors are bitwise the first ones, so the gradients are bitwise
#   those of storing everything: the cost is FLOPs, not accuracy.
#
# Errors are measured against an fp64 step of the same weights and batch, which stands for the exact
# gradient.
#
# **Run it** as a script, `python lessons/21_mixed_precision_of_activations.py` (the CPU run, seconds;
# `--fast` for fewer, `--large --device cuda` for a bigger shape on a GPU), or step through this
# notebook, where the same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset: the
# CPU run).

# %%
import math
import weakref

import matplotlib.pyplot as plt
import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from _check import check
from _lesson import choose, large, lesson_args, shape_line, small, wrote
from picockpt import ActivationStore, Config, init_params, loss_and_grads
from picockpt.measurement.alloc_trace import live_peak, only, trace_of
from picockpt.recompute.engine import Model, Step
from picockpt.planning.step_forms import layer_inventory, step_flops
from picockpt.measurement.measure import make_batch
from picockpt.model.params import copy_bytes, layer_shapes
from picockpt.planning.planner_copies import plan_copies
from picockpt.teaching.plotting import mib, policy_color, save_figure
from picockpt.recompute.policy import parse_policy
from picockpt.measurement.tracker import Tracker

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: the largest e4m3 number; a tensor's amax is scaled onto it
FP8_NORMAL = torch.finfo(FP8).smallest_normal  # 2^-6: below it e4m3 is subnormal, a fixed step of 2^-9
RESIDUAL = frozenset({"input", "mlp_norm.input", "final_norm.input"})  # the residual stream, stored
MLP_WIDE = frozenset({"mlp.gate", "mlp.up", "mlp.act"})  # the MLP's three (B, T, f) tensors
NARROWABLE = MLP_WIDE | {"attn_norm.output", "attn.q", "attn.k", "attn.v", "attn.probs", "attn.context",
                         "mlp_norm.output", "final_norm.output"}  # every 16-bit one but the stream and logits
KINDS = ("fp32 statistics", "residual stream (16-bit)", "other 16-bit activations", "8-bit")
KIND_COLORS = dict(zip(KINDS, ("#C44E52", "#2F4858", "#8DA0CB", "#E5C494")))

# %% [markdown]
# ## What a bf16 step stores, from the store itself
#
# `stored_tensors` runs one step of the engine's own loop (`engine.Step`) and reads the store's
# inventory (name, shape, dtype, bytes) at the end of the forward, when everything is in it. `kind`
# sorts a tensor into the four rows of the figure.

# %%
def shape(mode):
    """(Config, batch, seq) of each run mode: bf16 compute, fp32 master weights."""
    return choose(mode, fast=(small(layers=2, dtype="bf16"), 2, 32), cpu=(small(dtype="bf16"), 4, 128),
                  large=(large(layers=4, dtype="bf16"), 2, 1024))


def kind(name, dtype):
    if dtype == "float32":
        return KINDS[0]
    if name in RESIDUAL:
        return KINDS[1]
    return KINDS[3] if dtype.startswith("float8") else KINDS[2]


def run_step(params, cfg, input_ids, targets, policy="none", store=None, look=None):
    """One forward and backward through the engine's loop, optionally with another store; look(store)
    sees the store at the end of the forward. Returns (loss, grads, the store's peak bytes)."""
    B, T = input_ids.shape
    with torch.no_grad():
        step = Step(Model(params, cfg, input_ids, targets), parse_policy(policy, cfg).schedule(cfg, B, T),
                    parse_policy(policy, cfg).unstored)
        if store is not None:
            step.store = store
        loss = step.forward()
        if look is not None:
            look(step.store)
        grads = step.backward()
    return loss, grads, step.store.peak_bytes


def stored_tensors(params, cfg, input_ids, targets, store=None):
    """{(layer, name): (shape, dtype, bytes)} of layer 0 and the head, read from the store."""
    found = {}

    def look(store):
        for layer in (0, None):
            found.update({(layer, name): row for name, row in store.inventory(layer).items()})
    run_step(params, cfg, input_ids, targets, store=store, look=look)
    return found


def bytes_by_kind(tensors):
    totals = dict.fromkeys(KINDS, 0)
    for (_, name), (_, dtype, nbytes) in tensors.items():
        totals[kind(name, dtype)] += nbytes
    return totals


# %%
args = lesson_args()
cfg, batch, seq = shape(args.mode)
print(f"lesson 21, mixed precision: {shape_line(cfg, batch, seq, args.device)}")
params = init_params(cfg, seed=args.seed, device=args.device)  # fp32 master weights
input_ids, targets = make_batch(cfg, batch, seq, args.device, args.seed)
variants = {"eager attention": cfg, "tiled attention, chunked loss": cfg.replace(attention="tiled", loss_chunk=64)}
inventories = {label: stored_tensors(params, c, input_ids, targets) for label, c in variants.items()}
for label, tensors in inventories.items():
    print(f"\n{label}: layer 0 and the head, as the store holds them at the end of the forward")
    print(f"  {'tensor':<26}{'shape':<22}{'dtype':<10}{'bytes':>11}  kind")
    for (layer, name), (size, dtype, nbytes) in tensors.items():
        where = f"head.{name}" if layer is None else f"0.{name}"
        print(f"  {where:<26}{str(size):<22}{dtype:<10}{nbytes:>11,}  "
              f"{kind(name, dtype)}")
closed = {(0, name): row for name, row in layer_inventory(cfg, batch, seq).items()}
same = all(inventories["eager attention"][key] == row for key, row in closed.items())
print(f"\nlayer 0 as stored = layer_inventory (shapes, dtypes, bytes): {same}")

# %% [markdown]
# Everything but the statistics is 16-bit: the fp32 rows are two $(B, T, 1)$ tensors a layer under
# eager attention (0.15% of the layer at the CPU shape), plus a $(B, H, T)$ log-sum-exp under tiled
# attention and a $(B, T)$ one in the chunked head. The residual stream is two of the layer's
# $B \cdot T \cdot h$ tensors; the rest, the largest part, is what the next section makes narrower.
#
# ## Narrower, or recomputed
#
# `NarrowStore` is the activation store with one change: a tensor whose name it is given is kept as fp8
# e4m3 with one fp32 scale per tensor (the scale is stored too, 4 bytes), and widened back to the compute
# dtype when the backward takes it out. The store counts the bytes it really holds, so the peak is
# measured, not assumed. The rows below compare it with the recomputation policies of earlier lessons.

# %%
class NarrowStore(ActivationStore):
    """An activation store that keeps the tensors named in `narrow` in fp8 (e4m3) with a per-tensor
    scale: put quantises, pop dequantises to `dtype`, and counts the elements put, the nonzero ones that
    land below e4m3's smallest normal after scaling, and those that round to zero. Everything else as
    ActivationStore."""

    def __init__(self, narrow, dtype, listener=None):
        super().__init__(listener)
        self.narrow, self.dtype = frozenset(narrow), dtype
        self.elements = self.subnormal = self.zeroed = 0  # counts over every put: where the 2^-4 bound fails

    def put(self, layer, name, tensor):
        if name not in self.narrow:
            return super().put(layer, name, tensor)
        amax = tensor.abs().max().float()  # () the tensor's largest magnitude
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # () fp32: amax lands on 448
        scaled = tensor.float() / scale  # (same shape) fp32, amax on 448
        narrow = scaled.to(FP8)  # (same shape) 1 byte an element
        size = scaled.abs()  # (same shape)
        self.elements += scaled.numel()
        self.subnormal += int(((size > 0) & (size < FP8_NORMAL)).sum())  # nonzero, under the smallest normal
        self.zeroed += int(((size > 0) & (narrow == 0)).sum())  # nonzero, rounded to 0: all of it lost
        super().put(layer, name, narrow)
        super().put(layer, name + ".scale", scale)  # () 4 bytes

    def pop(self, layer, name, rebuild=None):
        if name not in self.narrow or not self.has(layer, name):
            return super().pop(layer, name, rebuild)
        narrow, scale = super().pop(layer, name), super().pop(layer, name + ".scale")
        return (narrow.float() * scale).to(self.dtype)  # (same shape) widened: the rounded forward value


def relative_error(grads, reference):
    """||g - g_ref|| / ||g_ref|| over every parameter's gradient at once (in fp64)."""
    diff = sum((grads[k].double() - reference[k].double()).pow(2).sum() for k in reference)
    return (diff / sum(reference[k].double().pow(2).sum() for k in reference)).sqrt().item()


def rows_of(cfg):
    """(label, policy, names kept in fp8) of the comparison."""
    return (("bf16, store all", "none", frozenset()),
            ("fp8 MLP (gate, up, act)", "none", MLP_WIDE),
            ("fp8 all but stream and stats", "none", NARROWABLE),
            ("recompute: cheap", "cheap", frozenset()),
            ("recompute: full", "full", frozenset()))


def compare(params, cfg, input_ids, targets):
    """{label: (peak stored bytes, relative gradient error against fp64, recompute FLOPs, grads)}; also
    the fp32 step's error, for scale."""
    B, T = input_ids.shape
    exact = {k: v.double() for k, v in params.items()}
    _, truth, _ = run_step(exact, cfg.replace(dtype="float64"), input_ids, targets)
    _, fp32, _ = run_step(params, cfg.replace(dtype="float32"), input_ids, targets)
    out = {}
    for label, policy, narrow in rows_of(cfg):
        store = NarrowStore(narrow, cfg.torch_dtype) if narrow else None
        _, grads, peak = run_step(params, cfg, input_ids, targets, policy, store)
        out[label] = (peak, relative_error(grads, truth), step_flops(cfg, B, T, policy)["recompute"], grads)
    return out, relative_error(fp32, truth)


# %%
results, fp32_error = compare(params, cfg, input_ids, targets)
base = results["bf16, store all"]
print(f"{'':<31}{'peak stored MiB':>16}{'saved':>8}{'grad error vs fp64':>20}{'recompute GFLOP':>17}{'= bf16 all':>12}")
for label, (peak, error, flops, grads) in results.items():
    bitwise = all(torch.equal(grads[k], base[3][k]) for k in grads)
    print(f"{label:<31}{mib(peak):>16.3f}{1 - peak / base[0]:>8.0%}{error:>20.3e}{flops / 1e9:>17.3f}"
          f"{'bitwise' if bitwise else 'no':>12}")
print(f"{'(fp32 step, store all)':<31}{'':>24}{fp32_error:>20.3e}")
narrowest, cheap = results["fp8 all but stream and stats"], results["recompute: cheap"]
print(f"\ncheap saves {1 - cheap[0] / base[0]:.0%} of the peak with bitwise gradients, for {cheap[2] / 1e9:.3f} GFLOP; "
      f"fp8 on every 16-bit tensor but the stream and the logits saves {1 - narrowest[0] / base[0]:.0%}, "
      f"at {narrowest[1] / base[1]:.2f}x the gradient error")
recomputed_bitwise = all(torch.equal(results[label][3][k], base[3][k]) for label in ("recompute: cheap",
                                                                                      "recompute: full")
                         for k in base[3])

# %% [markdown]
# Storing the MLP's tensors in fp8 saves what its row says at no FLOP, and multiplies the gradient's
# error against fp64 by the factor the table shows: e4m3 keeps 4 significant bits against bf16's 8, so
# a stored value is off by up to $2^{-4}$ of itself, and the backward differentiates at those values.
# That bound holds for normal numbers only (the section after this one counts where it does not). Going
# further (every 16-bit tensor but the residual stream and the logits) saves more and errs more. The two
# recomputation rows save bytes for FLOPs and leave the gradients **bitwise** those of storing
# everything: the rebuilt tensors are the first ones, bit for bit. At this model's shape `cheap` (norm
# outputs, attention probabilities and SwiGLU products rebuilt, the q k^T its only matmul) saves about as
# much as fp8 on every narrowable tensor, and loses nothing. (Bitwise here means within one process, the
# comparison the engine's recomputation has to pass; the bf16 error against fp64 itself is not promised
# to repeat to the last digit from one process to the next.)
#
# ## Where the $2^{-4}$ bound stops: subnormals
#
# Half a step of round-to-nearest is at most $2^{-4}$ of a value only while the value is **normal**: after
# scaling, at least e4m3's smallest normal, $2^{-6}$. Below it the subnormals have one fixed step,
# $2^{-6} \cdot 2^{-3} = 2^{-9}$, so the error is at most $2^{-10}$ in absolute terms and grows relative
# to the value, to all of it for values under $2^{-10}$, which round to zero. With the tensor's amax
# scaled onto 448, an element turns subnormal once it is more than $448 / 2^{-6}$ = 28,672 times smaller than
# the amax, and rounds to zero only once it is more than $448 / 2^{-10}$ = 458,752 times smaller.
# e5m2 (Transformer Engine's `Format.HYBRID` keeps the backward's fp8 tensors in it and the forward's in
# e4m3, transformer_engine/common/recipe/__init__.py) has range where e4m3 has precision: 3 significant bits, a
# bound of $2^{-3}$, for normals down to $2^{-14}$ below a largest value of 57,344. (bf16's subnormals
# start at $2^{-126}$, out of an activation's way.) `NarrowStore` counts, over every tensor it narrows,
# the nonzero elements that land below $2^{-6}$ and those that become zero; measured here, on the row
# that narrows the most:

# %%
counting = NarrowStore(NARROWABLE, cfg.torch_dtype)
run_step(params, cfg, input_ids, targets, store=counting)
for fp8 in (FP8, torch.float8_e5m2):  # the formats' numbers, from torch.finfo
    info = torch.finfo(fp8)
    step = info.smallest_normal * info.eps  # the subnormals' one spacing
    print(f"{str(fp8).removeprefix('torch.float8_')}: largest {info.max:g}, smallest normal "
          f"2^{math.log2(info.smallest_normal):.0f}, subnormal step 2^{math.log2(step):.0f}, "
          f"relative bound for normals 2^{math.log2(info.eps / 2):.0f}")
print(f"fp8 all but stream and stats: {counting.elements:,} elements narrowed, {counting.subnormal:,} "
      f"({counting.subnormal / counting.elements:.3%}) subnormal after scaling (no 2^-4 bound), "
      f"{counting.zeroed:,} ({counting.zeroed / counting.elements:.3%}) rounded to zero")

# %% [markdown]
# **Is recomputation bitwise equal on a GPU?** Here, on the CPU, it is, and the tests hold it to that.
# On a GPU it holds as long as each forward kernel gives the same bits for the same input.
# FlashAttention says so of its kernels ("The forward pass is always deterministic",
# `flash_attn_interface.py`), and its backward is deterministic only when asked (`deterministic=True`,
# slower, more memory). PyTorch lists the ops that are nondeterministic by default on CUDA, and that
# `torch.use_deterministic_algorithms(True)` makes deterministic or refuses, `index_add_` among them and
# `scatter_add_` in some cases (its documentation; the usual cause is atomic adds, which land in whatever
# order the threads arrive); cuBLAS has conditions of its own (PyTorch's Reproducibility notes). In
# picockpt the embedding backward avoids the scatter-add for this reason (`ops/embedding.py`), but the mixture of
# experts combines its experts' outputs with `index_add_` (`moe.py`): on a GPU, a recomputed MoE layer
# can differ from its first forward in the last bits. Even when every forward replays exactly, a
# nondeterministic backward makes two runs of the same policy differ, so a "bitwise equal to none" check
# needs deterministic algorithms on a GPU. `torch.utils.checkpoint` checks less: its default
# `determinism_check` compares the recomputed tensors' shapes, dtypes and devices, not their values.
#
# ## The figure
#
# Left: layer 0 and the head of a bf16 step by kind, as the store holds them. Right: the trade,
# peak stored bytes against the gradient's error, each point a row of the table.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
names = list(inventories)
bottoms = [0.0] * len(names)
for kind_name in KINDS[:3]:
    values = [mib(bytes_by_kind(inventories[n])[kind_name]) for n in names]
    left.bar(names, values, bottom=bottoms, color=KIND_COLORS[kind_name], label=kind_name, width=0.55)
    bottoms = [b + v for b, v in zip(bottoms, values)]
left.set_xticks(range(len(names)), [f"{n}\nfp32: {bytes_by_kind(inventories[n])[KINDS[0]]:,} B of "
                                    f"{sum(bytes_by_kind(inventories[n]).values()):,} B" for n in names], fontsize=8)
left.set_ylabel("MiB (layer 0 + head, measured in the store)")
left.set_title("what a bf16 step stores, by dtype (fp32: a sliver at the bottom)")
left.legend(fontsize=8, loc="upper right")
policies = {label: policy for label, policy, _ in rows_of(cfg)}
for label, (peak, error, flops, _) in results.items():
    fp8 = label.startswith("fp8")
    right.scatter(mib(peak), error / base[1], s=60, marker="s" if fp8 else "o", zorder=3, edgecolor="k",
                  color=KIND_COLORS[KINDS[3]] if fp8 else policy_color(policies[label]))
    right.annotate(f"{label}\n{flops / 1e9:.2f} GFLOP recomputed", (mib(peak), error / base[1]),
                   xytext=(0, 10 if fp8 else -24), textcoords="offset points", fontsize=7, ha="center")
right.set_ylim(0, max(e for _, e, _, _ in results.values()) / base[1] * 1.25)
right.set_xlim(0, mib(base[0]) * 1.15)
right.set_xlabel("peak stored MiB (the store's own count)")
right.set_ylabel("gradient error vs fp64, / that of bf16 store-all")
right.set_title(f"fp8 storage costs accuracy; recomputation costs FLOPs\n(bf16 store-all: "
                f"{base[1]:.2e} relative; an fp32 step: {fp32_error:.1e})", fontsize=10)
right.grid(alpha=0.3)
fig.suptitle(f"Mixed precision of activations: L={cfg.layers}, h={cfg.hidden}, batch {batch} x {seq}, bf16 "
             f"compute, fp32 master weights")
fig.tight_layout()
path = save_figure(fig, "21_mixed_precision_of_activations")
wrote(path)

# %% [markdown]
# ## The 16-bit weight copies: memory like an activation, recomputed like one
#
# A bf16 step computes with 16-bit weights, and its master weights are fp32: somebody makes the 16-bit
# copies. Unless the policy says otherwise, `Model.start` casts every weight once, at the start of the
# step, and keeps the copies to its end: 2 bytes a parameter (about 15 GiB for Llama 3 8B), held through
# the whole step like a stored activation that is never dropped. The policy's `+recast` treats them as one:
# a layer's copies are made when the layer runs and dropped after it, made again in its recompute and in
# its backward. Live at once: the embedding's, final norm's and head's copies and one layer's
# (`params.copy_bytes`). The price is a cast per layer in each recompute and backward, a memory-bound pass
# that reads 4 and writes 2 bytes a parameter, and no FLOPs; the bits are the same, a cast being
# deterministic.
#
# `torch.autocast` is close, not the same. It caches a weight's cast until the outermost autocast region
# exits (`torch.autocast.__exit__` clears the cache at nesting level 0), so in a forward run under one
# `autocast` every layer's copy stays alive to the forward's end, checkpointed or not. A checkpoint's
# recompute, in the backward, is a new region: it casts the layer again, and the layer's backward uses that
# copy. The cell below counts the casts of one weight both ways, and how many of autocast's copies a chain of
# checkpointed layers holds at its forward's end.
#
# The tracker marks the copies "weights", out of its physical activation count; `alloc_trace` replays its
# log for their peak, and the tracked total is every storage of the step, copies and gradients included.

# %%
class WeightCasts(TorchDispatchMode):
    """Every copy aten._to_copy makes of one of `weights`, by a weak reference: how many made, how many alive."""

    def __init__(self, weights):
        super().__init__()
        self.ids, self.made = {id(w): name for name, w in weights.items()}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.ids:
            self.made.append((self.ids[id(args[0])], weakref.ref(out)))
        return out

    def count(self, name=None):
        return sum(1 for n, _ in self.made if name in (None, n))

    def alive(self):
        return sum(1 for _, ref in self.made if ref() is not None)


chain = {f"{i}": torch.nn.Linear(64, 64, bias=False, device=args.device) for i in range(4)}
x = torch.randn(8, 64, device=args.device, requires_grad=True)
with WeightCasts({name: layer.weight for name, layer in chain.items()}) as autocast_casts:
    with torch.autocast(args.device.type, dtype=torch.bfloat16):
        h = x
        for layer in chain.values():
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
        at_forward_end = autocast_casts.alive()
    h.float().sum().backward()
first = next(name for name in params if ".layers.0." in name and name.endswith("proj.weight"))
with WeightCasts(params) as picockpt_casts:
    loss_and_grads(params, cfg, input_ids, targets, "full+recast")
print(f"torch.autocast, {len(chain)} layers each under checkpoint: {at_forward_end} copies alive at the forward's "
      f"end; {autocast_casts.count('0')} casts of the first layer's weight (forward, recompute)")
print(f"picockpt full+recast: {picockpt_casts.count(first)} casts of {first} (forward, recompute, backward), "
      f"one layer's copies alive at a time (the table below)")

# %%
copy_rows = {}  # policy -> (stored peak, weight copies' peak, tracked total's peak, loss, grads)
for policy in ("none", "recast", "full", "full+recast"):
    with Tracker(args.device, flops=False) as tracker:
        loss, grads = loss_and_grads(params, cfg, input_ids, targets, policy, tracker=tracker)
    copies = live_peak(only(trace_of(tracker, tracker.device.type), ("weights",)))
    copy_rows[policy] = (tracker.peak_logical, copies, max(p["total"] for p in tracker.peaks.values()), loss, grads)
print(f"{'policy':<14}{'stored peak':>14}{'weight copies':>15}{'copy_bytes':>13}{'tracked total':>15}")
for policy, (stored, copies, total, _, _) in copy_rows.items():
    closed = copy_bytes(cfg, parse_policy(policy, cfg).recast)
    print(f"{policy:<14}{stored:>14,}{copies:>15,}{closed:>13,}{total:>15,}")
copies_closed = all(row[1] == copy_bytes(cfg, parse_policy(policy, cfg).recast) for policy, row in copy_rows.items())
recast_bitwise = all(torch.equal(copy_rows[kept][3], copy_rows[recast][3]) and
                     all(torch.equal(copy_rows[kept][4][n], copy_rows[recast][4][n]) for n in params)
                     for kept, recast in (("none", "recast"), ("full", "full+recast")))
print(f"weight copies = copy_bytes, kept and recast: {copies_closed}; loss and gradients with recast bitwise "
      f"those without: {recast_bitwise}")
full_total, recast_total = copy_rows["full"][2], copy_rows["full+recast"][2]
print(f"full's tracked total {mib(full_total):.2f} MiB -> full+recast's {mib(recast_total):.2f} MiB "
      f"({recast_total / full_total:.2f}x); the stored activations do not move")
billion = Config(vocab=32000, hidden=2048, layers=16, heads=16, kv_heads=4, ffn=8192, dtype="bfloat16")
for name, model in (("1.1B (L=16, h=2048, f=8192, V=32000)", billion),
                    ("Llama 3 8B", Config.from_preset("llama3-8b", dtype="bfloat16"))):
    layer_params = sum(math.prod(size) for size in layer_shapes(model).values())
    print(f"{name}: copies kept {copy_bytes(model) / 2**30:.2f} GiB, recast {copy_bytes(model, True) / 2**30:.2f} "
          f"GiB; a layer's cast moves {6 * layer_params / 2**20:.0f} MiB (4 bytes read, 2 written a parameter)")

# %% [markdown]
# Under `full` the stored activations are one layer input each, so at a small batch the kept copies can
# outweigh them; `full+recast` gives all but one layer's back, for two more casts per layer (one in the
# recompute, one in the backward; the forward's was always made). A `budget:SIZE` counts the activation
# store, and `fit.step_bytes` counts the copies beside it. Given one total for both (`plan --with-copies`,
# `picockpt/planning/planner_copies.py`), the planner weighs the trade: it plans the store in the room kept copies
# leave and in the larger room recast ones leave, and prices what differs, the recomputed FLOPs at a
# compute rate against the casts' bytes (4 read and 2 written a parameter, each time a layer runs) at a
# memory bandwidth. Modelled at an H200's datasheet rates (989.5 TFLOP/s dense BF16, 4.8 TB/s HBM):

# %%
for name, model, batch, seq, total in (("1.1B, 4 x 2048, 12 GiB", billion, 4, 2048, 12 * 2**30),
                                       ("Llama 3 8B, 1 x 8192, 40 GiB", Config.from_preset("llama3-8b",
                                                                                          dtype="bfloat16"),
                                        1, 8192, 40 * 2**30),
                                       ("Llama 3 8B, 1 x 8192, 20 GiB", Config.from_preset("llama3-8b",
                                                                                          dtype="bfloat16"),
                                        1, 8192, 20 * 2**30)):
    chosen, both = plan_copies(model, batch, seq, total)
    print(name)
    for option in both:
        fits = option.plan is not None
        print(f"  copies {'recast' if option.recast else 'kept  '}: {copy_bytes(model, option.recast) / 2**30:6.2f} GiB, "
              f"store room {max(option.store_budget, 0) / 2**30:6.2f} GiB, recompute "
              + (f"{option.plan.recompute_flops / 1e12:7.3f} TFLOP, {option.casts:3d} layer casts "
                 f"({option.cast_bytes / 2**30:6.2f} GiB): {option.seconds * 1e3:6.2f} ms" if fits else "(does not fit)"))
    other = both[0] if chosen.recast else both[1]
    change = (other.plan.recompute_flops - chosen.plan.recompute_flops) / 1e12 if other.plan else None
    print(f"  chosen: {'recast' if chosen.recast else 'kept'} (--policy {chosen.policy})"
          + ("" if change is None else f"; the other would change recompute by {change:+.3f} TFLOP and the "
                                       f"casts by {(other.cast_bytes - chosen.cast_bytes) / 2**30:+.2f} GiB"))

# %% [markdown]
# Which side wins depends on the room, as the rows above print: a layer's cast moves the same bytes
# whatever the shape, while what the freed room saves is the recomputation of whatever it can now store;
# where kept copies squeeze the store down to recomputing most layers, that is worth the casts.

# %% [markdown]
# ## Exercises
#
# These use the `small` model in bf16 at batch 4 × 128 tokens, whatever shape the run above used.

# %%
exercise = small(dtype="bf16")
ex_params = init_params(exercise, seed=0)
ex_ids, ex_targets = make_batch(exercise, 4, 128, "cpu", 0)
ex_layer = layer_inventory(exercise, 4, 128)
print(f"small, bf16, batch 4 x 128: h = {exercise.hidden}, f = {exercise.ffn}, L = {exercise.layers}")

# %% [markdown]
# **1.** How many bytes of one stored layer are fp32 (the statistics), under eager attention?

# %%
answer = 4096  # bytes

# %%
fp32_rows = {name: row for name, row in ex_layer.items() if row[1] == "float32"}
check("fp32 bytes of one stored bf16 layer (small, 4 x 128)", answer, sum(r[2] for r in fp32_rows.values()), rel=0,
      why=f"{' + '.join(fp32_rows)}: two (B, T, 1) rstd tensors, 2·4·128·4 bytes (layer_inventory)")

# %% [markdown]
# **2.** Keeping `mlp.gate`, `mlp.up` and `mlp.act` in fp8 with one 4-byte scale each: how many bytes
# does each layer save? (Each is $B \times T \times f$ elements, 2 bytes in bf16, 1 in fp8.)

# %%
answer = 688_116  # bytes per layer

# %%
_, _, all_bf16 = run_step(ex_params, exercise, ex_ids, ex_targets)
_, _, with_fp8 = run_step(ex_params, exercise, ex_ids, ex_targets, store=NarrowStore(MLP_WIDE, exercise.torch_dtype))
check("bytes one layer saves with its MLP tensors in fp8", answer, (all_bf16 - with_fp8) / exercise.layers, rel=0,
      why=f"3·B·T·f·(2 − 1) − 3·4 = 3·4·128·{exercise.ffn} − 12 bytes; measured: the store's peak "
          f"{all_bf16:,} − {with_fp8:,} bytes over L = {exercise.layers} layers")

# %% [markdown]
# **3.** On this CPU, are the bf16 gradients under `full` bitwise equal to those of storing everything?
# (True or False)

# %%
answer = True

# %%
_, none_grads, _ = run_step(ex_params, exercise, ex_ids, ex_targets)
_, full_grads, _ = run_step(ex_params, exercise, ex_ids, ex_targets, "full")
check("full's bf16 gradients are bitwise none's", answer, all(torch.equal(full_grads[k], none_grads[k])
                                                              for k in none_grads),
      why="the recomputation runs the forward's own functions on the same stored inputs, one thread, the same "
          "kernels: the same bits (torch.equal on every gradient)")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"stored layer = layer_inventory": same,
                      "recomputed gradients = stored (bitwise)": recomputed_bitwise,
                      "weight copies = copy_bytes (kept, recast)": copies_closed,
                      "recast gradients = kept (bitwise)": recast_bitwise,
                      "full+recast tracked total / full's": f"{recast_total / full_total:.2f}",
                      "fp8 MLP saves": f"{1 - results['fp8 MLP (gate, up, act)'][0] / base[0]:.0%}",
                      "grad error bf16 / fp8 MLP": f"{base[1]:.2e} / {results['fp8 MLP (gate, up, act)'][1]:.2e}"}}

"""picockpt's policies beside PyTorch's and Hugging Face's recomputation on the same shape, weights and batch.

Every run is one forward + backward (no optimizer). Memory and FLOPs come from one tracked run each; times are medians
of interleaved untracked runs (each repeat runs every contender once, so a slow moment of a shared machine hits them all
alike). For autograd runs recomputation happens inside backward, so their recompute FLOPs are measured as
(their total) - (plain autograd's total).

The peers: PyTorch's checkpointing on picockpt's autograd reference model (eager attention), and Hugging Face's
LlamaForCausalLM (peers_hf.py) with eager and sdpa attention, each without and with its activation checkpointing, when
transformers is installed and the shape allows it. Each picockpt row names the peer that does the same thing: under
eager attention the reference model's runs; under tiled or fused attention (no stored probabilities, as sdpa) Hugging
Face sdpa. Host memory: picockpt's offload policies beside torch.autograd.graph.save_on_cpu(pin_memory=True) on the
reference model, alone and with torch.utils.checkpoint per layer; each row has its device bytes (peak_live_bytes: host
copies are kept out) and its host bytes (host_peak_bytes), both measured. They are not paired as equivalents: on a CPU
save_on_cpu's unpack returns the host copy itself (.to() of a tensor already on the CPU copies nothing), so its backward
reads host memory where a GPU would copy back, and its device bytes there are not what a GPU would hold; picockpt's
prefetch copies for real. With min_cut=(budgets), the reference model also runs through torch.compile's min-cut
partitioner at each activation_memory_budget (peers.min_cut; dense fp32/fp64 models only).

The gradient check: every run's gradients against picockpt none's, within GRAD_TOLERANCE of the compute dtype (max
|difference| / max |reference|, tensor by tensor). In bf16/fp16 the Hugging Face rows run under torch.autocast over fp32
master weights (picockpt's mixed precision; its recast policies are their peers), and autocast rounds elsewhere than
picockpt does (its residual stream stays fp32, its norms compute in fp32): such a run is a different 16-bit rounding of
the same fp32 step, not a re-run of picockpt's. So it is checked against picockpt none in fp32 (the truth both round),
within AUTOCAST_FACTOR times picockpt none's own distance from it measured in the same run. Memory in 16 bits is
compared by the tracked total (every storage of the step): autocast's weight copies are made inside torch, where the
tracker cannot tell them from activations, as it can picockpt's. With dropout, a run can only be checked against one
that draws the same masks: the reference model draws eager attention's masks, so under tiled attention (each tile's mask
from a stored seed) its runs are checked against autograd instead, and marked so (a cross-family difference would only
measure the masks).
"""
import contextlib
import math
import statistics

import torch

from . import peers, peers_hf
from ..recompute.bridge import segmented_backward
from ..device import resolve_device
from ..recompute.engine import loss_and_grads
from .measure import make_batch, max_relative_diff, time_step
from ..model.params import init_params
from .reference import ReferenceLlama
from .tracker import Tracker


# Max relative gradient difference that passes, by compute dtype; what fails is a wrong gradient, not rounding.
# Measured (tiny and small presets, every contender): fp32 1.2e-6, fp64 2.0e-7 (Hugging Face computes its RoPE
# tables in fp32), bf16 1.0e-2, fp16 1.6e-3. A dropped or stale tensor, or another dropout mask, gives 0.1 to 1.
GRAD_TOLERANCE = {"float64": 1e-5, "float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
# Hugging Face under autocast against picockpt in fp32: measured 0.57x to 0.89x picockpt bf16's own distance from
# it (tiny and small presets, eager and fused, 8e-3 to 3.5e-2); twice it passes any 16-bit rounding of the step.
AUTOCAST_FACTOR = 2.0
SIXTEEN_BITS = ("bfloat16", "float16")


def reference_masks_match(cfg):
    """Do the reference model's runs draw the dropout masks picockpt draws? Without dropout there are none;
    under eager attention both draw the same tensors in the same order; under tiled attention picockpt
    draws each tile's mask from a stored seed, which the reference model's eager attention does not."""
    return cfg.dropout == 0 or cfg.attention == "eager"


def min_cut_supported(cfg):
    """None when the min-cut partitioner's runs can be measured like the others, else why not."""
    if cfg.experts:
        return "an MoE model routes with data-dependent shapes (aten.nonzero), which AOTAutograd cannot trace"
    if cfg.dtype not in ("float32", "float64"):
        return (f"dtype={cfg.dtype}: the compiled graph makes the 16-bit weight copies inside, where the tracker "
                f"cannot tell them from activations")
    return None


def contenders(cfg, seq, segment, min_cut=()):
    """(name, kind, how to run, name of its equivalent) for every run of the table."""
    C, segments = segment, math.ceil(cfg.layers / segment)
    eager, hf = cfg.attention == "eager", hf_rows(cfg)
    sequential = f"torch checkpoint_sequential({segments})" if segments > 1 else None  # one segment: it is the
    #            last, which checkpoint_sequential runs without checkpointing (autograd), no peer of every:C
    none_peer, full_peer = ("autograd", "torch checkpoint per layer") if eager or not hf else \
        ("HF sdpa", "HF sdpa + checkpointing")
    rows = [
        ("picockpt none", "picockpt", "none", none_peer),
        ("picockpt full", "picockpt", "full", full_peer),
        *([("picockpt recast", "picockpt", "recast", none_peer),  # the weight copies cast at use, as autocast
           ("picockpt full+recast", "picockpt", "full+recast", full_peer)] if cfg.dtype in SIXTEEN_BITS else []),
        (f"picockpt every:{C}", "picockpt", f"every:{C}",
         sequential if eager else None),
        ("picockpt selective", "picockpt", "selective", "torch selective checkpoint" if eager else None),
        ("picockpt cheap", "picockpt", "cheap", "torch checkpoint saving matmuls" if eager else None),
        (f"picockpt every:{C}+selective", "picockpt", f"every:{C}+selective", None),
        ("autograd", "torch", peers.autograd, None),
        ("torch checkpoint per layer", "torch", peers.per_layer, None),
        (f"torch checkpoint_sequential({segments})", "torch", peers.sequential(segments), None),
        ("torch selective checkpoint", "torch", peers.selective(seq), None),
        ("torch checkpoint saving matmuls", "torch", peers.save_matmuls(seq), None),
        ("picockpt full+offload", "picockpt", "full+offload", None),  # ~ torch checkpoint per layer + save_on_cpu
        ("picockpt none+offload", "picockpt", "none+offload", None),  # ~ torch save_on_cpu
        ("autograd + save_on_cpu", "torch", peers.SaveOnCpu(peers.autograd), None),
        ("torch checkpoint per layer + save_on_cpu", "torch", peers.SaveOnCpu(peers.per_layer), None),
        ("bridge full", "bridge", 1, "torch checkpoint per layer"),
        (f"bridge every:{C}", "bridge", C, sequential),
    ]
    if hf:
        rows += [(f"HF {attention}" + (" + checkpointing" if checkpointing else ""), "hf", (attention, checkpointing),
                  None) for attention in ("eager", "sdpa") for checkpointing in (False, True)]
    rows += [(f"min-cut partitioner, budget {budget:g}", "min-cut", budget, None) for budget in min_cut]
    return rows


def hf_rows(cfg):
    """Can the Hugging Face peers run this shape? (installed, no dropout; 16 bits under autocast)"""
    try:
        peers_hf.check_supported(cfg, autocast=True)
    except ValueError:
        return False
    return peers_hf.available()


BASES = ("picockpt none", "autograd")  # always run: the gradient references and the FLOP base
FP32 = "picockpt none in float32"  # the reference of Hugging Face's rows under autocast


def compare(cfg, batch, seq, device="cpu", segment=2, repeats=5, seed=0, log=print, min_cut=(), only=None):
    """One row per contender (only: the names to run, beside BASES; None runs every one)."""
    device = resolve_device(device)
    cfg.check_seq(seq)
    min_cut = check_min_cut(cfg, min_cut)
    runs = contenders(cfg, seq, segment, min_cut)
    if isinstance(only, str):
        raise ValueError(f"only={only!r}: give a list of contender names, e.g. only=[{only!r}]")
    if only is not None:
        unknown = set(only) - {name for name, *_ in runs}
        if unknown:
            raise ValueError(f"only={sorted(unknown)}: no such contender here; choose from "
                             f"{[name for name, *_ in runs]}")
        runs = [run for run in runs if run[0] in set(only) | set(BASES)]
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)
    model = ReferenceLlama(cfg, params).to(device)

    hf_models = {}  # (attention, checkpointing) -> LlamaForCausalLM, built once
    compiled = {}   # budget -> the reference model through the min-cut partitioner, traced once

    def step_of(kind, how, tracker=None):
        if kind == "picockpt":
            return lambda: loss_and_grads(params, cfg, input_ids, targets, how, tracker=tracker)[0]
        owner = hf_models[how] if kind == "hf" else model

        def run():
            owner.zero_grad(set_to_none=True)
            if kind == "bridge":
                with _phase(tracker, "backward"):
                    _mark(tracker, model.cast_weights(), "weights")  # the bridge runs the model's parts itself
                    loss = segmented_backward(model.model.layers, model.embed(input_ids),
                                              lambda y: model.head_loss(y, targets), how)
            else:  # the torch, min-cut and Hugging Face runs: a forward, then autograd's backward
                with _phase(tracker, "forward"):
                    loss = compiled[how](input_ids, targets) if kind == "min-cut" else \
                        peers_hf.hf_loss(owner, input_ids, targets) if kind == "hf" else \
                        model(input_ids, targets, run_layers=how)
                    if kind == "torch":  # 16-bit copies, as picockpt marks its own
                        _mark(tracker, model.casts.copies.values(), "weights")
                    if isinstance(how, peers.SaveOnCpu):  # its host copies: host bytes, not device bytes
                        _mark(tracker, how.host_tensors(), "host")
                with _phase(tracker, "backward"):
                    loss.backward()
            if kind != "hf":
                model.release_weights()
            return loss.detach()
        return run

    def tracked(kind, how, **what):
        torch.manual_seed(seed)
        with Tracker(device, **what) as tracker:
            loss = step_of(kind, how, tracker)()
            owner = hf_models.get(how) if kind == "hf" else model
            if kind != "picockpt":
                for p in owner.parameters():
                    tracker.mark(p.grad, "gradients")
                owner.zero_grad(set_to_none=True)
        return loss, tracker

    def grads_of(kind, how, step_cfg=cfg):
        """{name: gradient} of one untracked step, under the params' names."""
        torch.manual_seed(seed)  # the same dropout masks as every other run
        if kind == "picockpt":
            return loss_and_grads(params, step_cfg, input_ids, targets, how)[1]
        step_of(kind, how)()
        owner = hf_models.get(how) if kind == "hf" else model
        grads = peers_hf.hf_grads(owner, cfg.tie_embeddings) if kind == "hf" else model.grads()
        grads = {name: grad.detach().clone() for name, grad in grads.items()}
        owner.zero_grad(set_to_none=True)
        return grads

    for _, kind, how, _ in runs:
        if kind == "hf":  # built before any tracking: their weights are not the step's memory
            hf_models[how] = peers_hf.hf_llama(cfg, params, *how, device=device, autocast=True)
        if kind == "min-cut":  # traced and partitioned before any tracking (seconds each)
            compiled[how] = peers.min_cut(model, how)
            step_of(kind, how)()
            model.zero_grad(set_to_none=True)
    rows = []
    # every contender's gradients against picockpt's under none; the reference model's runs against
    # autograd's when they draw other dropout masks
    same_masks = reference_masks_match(cfg)
    references = {"picockpt none": grads_of("picockpt", "none")}
    if not same_masks:
        references["autograd"] = grads_of("torch", peers.autograd)
    tolerances = dict.fromkeys(references, GRAD_TOLERANCE[cfg.dtype])
    autocast = cfg.dtype in SIXTEEN_BITS and any(kind == "hf" for _, kind, _, _ in runs)
    if autocast:  # the fp32 step both round; the tolerance from picockpt's own distance from it
        references[FP32] = grads_of("picockpt", "none", cfg.replace(dtype="float32"))
        own = max(max_relative_diff(references["picockpt none"][n], references[FP32][n]) for n in references[FP32])
        tolerances[FP32] = AUTOCAST_FACTOR * own
    for name, kind, how, equivalent in runs:
        # memory and FLOPs in two runs, each measured on its own
        loss, memory = tracked(kind, how, flops=False)
        _, flops = tracked(kind, how, physical=False)
        grads = grads_of(kind, how)
        against = FP32 if kind == "hf" and autocast else \
            "picockpt none" if kind == "picockpt" or same_masks else "autograd"
        reference, tolerance = references[against], tolerances[against]
        worst = max(max_relative_diff(grads[n], reference[n]) for n in reference)
        rows.append({"name": name, "kind": kind, "equivalent": equivalent, "loss": loss.item(),
                     "grad_max_rel_diff": worst, "grad_checked_against": against, "grad_tolerance": tolerance,
                     "grad_ok": worst <= tolerance,
                     "dropout_masks": "picockpt's" if kind == "picockpt" or same_masks else "the reference model's",
                     "peak_live_bytes": memory.peak_physical, "host_peak_bytes": memory.peak_host_live,
                     "peak_total_bytes": max(p["total"] for p in memory.peaks.values()),
                     "total_flops": sum(flops.flops.values()),
                     "recompute_flops": flops.flops["recompute"], "times": []})
        if log:
            log(f"  measured {name}")
    base = next(r for r in rows if r["name"] == "autograd")["total_flops"]
    for row in rows:
        if row["kind"] != "picockpt":
            row["recompute_flops"] = row["total_flops"] - base

    steps = [step_of(kind, how) for _, kind, how, _ in runs]
    for step in steps:  # warm-up
        step()
    for repeat in range(repeats):
        for row, step in zip(rows, steps):
            row["times"].append(time_step(step, device))
        if log:
            log(f"  timed repeat {repeat + 1}/{repeats}")
    by_name, times_of = {row["name"]: row for row in rows}, {row["name"]: row.pop("times") for row in rows}
    memory = "peak_total_bytes" if cfg.dtype in SIXTEEN_BITS else "peak_live_bytes"  # autocast's copies: see the top
    for row in rows:  # medians, with the spread over repeats; a ratio is taken repeat by repeat (interleaved)
        times = times_of[row["name"]]
        row["step_seconds"] = statistics.median(times)
        row["step_seconds_min_max"] = [min(times), max(times)]
        peer = by_name.get(row["equivalent"])
        ratios = [t / u for t, u in zip(times, times_of[peer["name"]])] if peer else None
        row["time_vs_equivalent"] = statistics.median(ratios) if peer else None
        row["time_vs_equivalent_min_max"] = [min(ratios), max(ratios)] if peer else None
        row["memory_vs_equivalent"] = row[memory] / peer[memory] if peer else None
        row["memory_compared"] = memory
    return rows


def check_min_cut(cfg, budgets, name="min_cut"):
    """The min-cut budgets as a tuple of floats in [0, 1], or a ValueError naming what is wrong."""
    budgets = tuple(budgets)
    shown = ",".join(f"{b:g}" if isinstance(b, (int, float)) else repr(b) for b in budgets)
    for budget in budgets:
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
            raise ValueError(f"{name}={shown}: each activation_memory_budget is a fraction, 0 <= budget <= 1 "
                             f"(e.g. 0.5,0.2,0)")
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"{name}={shown}: a budget given twice; give each once")
    reason = min_cut_supported(cfg) if budgets else None
    if reason:
        raise ValueError(f"{name}={shown}: {reason}; compare without min-cut runs ({name} none)"
                         if name.startswith("--") else f"{name}={shown}: {reason}; use min_cut=()")
    return tuple(float(budget) for budget in budgets)


def _phase(tracker, name):
    return tracker.phase(name) if tracker is not None else contextlib.nullcontext()


def _mark(tracker, tensors, category):
    for tensor in tensors if tracker is not None else ():
        tracker.mark(tensor, category)

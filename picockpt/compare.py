"""picockpt's policies beside PyTorch's and Hugging Face's recomputation on the same shape, weights and batch.

Every run is one forward + backward (no optimizer). Memory and FLOPs come from one tracked
run each; times are medians of interleaved untracked runs (each repeat runs every
contender once, so a slow moment of a shared machine hits them all alike).
For autograd runs recomputation happens inside backward, so their recompute FLOPs are
measured as (their total) - (plain autograd's total).

The peers: PyTorch's checkpointing on picockpt's autograd reference model (eager attention), and
Hugging Face's LlamaForCausalLM (peers_hf.py) with eager and sdpa attention, each without and
with its activation checkpointing, when transformers is installed and the shape allows it. Each
picockpt row names the peer that does the same thing: under eager attention the reference
model's runs; under tiled or fused attention (no stored probabilities, as sdpa) Hugging Face sdpa.
"""
import contextlib
import math
import statistics
import time

import torch

from . import peers, peers_hf
from .bridge import segmented_backward
from .engine import loss_and_grads
from .measure import _sync, make_batch, max_relative_diff
from .params import init_params
from .reference import ReferenceLlama
from .tracker import Tracker


def contenders(cfg, seq, segment):
    """(name, kind, how to run, name of its equivalent) for every run of the table."""
    C, segments = segment, math.ceil(cfg.layers / segment)
    eager, hf = cfg.attention == "eager", hf_rows(cfg)
    none_peer, full_peer = ("autograd", "torch checkpoint per layer") if eager or not hf else \
        ("HF sdpa", "HF sdpa + checkpointing")
    rows = [
        ("picockpt none", "picockpt", "none", none_peer),
        ("picockpt full", "picockpt", "full", full_peer),
        (f"picockpt every:{C}", "picockpt", f"every:{C}", f"torch checkpoint_sequential({segments})" if eager else None),
        ("picockpt selective", "picockpt", "selective", "torch selective checkpoint" if eager else None),
        ("picockpt cheap", "picockpt", "cheap", "torch checkpoint saving matmuls" if eager else None),
        (f"picockpt every:{C}+selective", "picockpt", f"every:{C}+selective", None),
        ("autograd", "torch", peers.autograd, None),
        ("torch checkpoint per layer", "torch", peers.per_layer, None),
        (f"torch checkpoint_sequential({segments})", "torch", peers.sequential(segments), None),
        ("torch selective checkpoint", "torch", peers.selective(seq), None),
        ("torch checkpoint saving matmuls", "torch", peers.save_matmuls(seq), None),
        ("bridge full", "bridge", 1, "torch checkpoint per layer"),
        (f"bridge every:{C}", "bridge", C, f"torch checkpoint_sequential({segments})"),
    ]
    if hf:
        rows += [(f"HF {attention}" + (" + checkpointing" if checkpointing else ""), "hf", (attention, checkpointing),
                  None) for attention in ("eager", "sdpa") for checkpointing in (False, True)]
    return rows


def hf_rows(cfg):
    """Can the Hugging Face peers run this shape? (installed, fp32/fp64, no dropout)"""
    if not peers_hf.available():
        return False
    try:
        peers_hf.check_supported(cfg)
    except ValueError:
        return False
    return True


def compare(cfg, batch, seq, device="cpu", segment=2, repeats=5, seed=0, log=print):
    cfg.check_seq(seq)
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)
    model = ReferenceLlama(cfg, params).to(device)

    hf_models = {}  # (attention, checkpointing) -> LlamaForCausalLM, built once

    def step_of(kind, how, tracker=None):
        if kind == "picockpt":
            return lambda: loss_and_grads(params, cfg, input_ids, targets, how, tracker=tracker)[0]
        if kind == "hf":
            return hf_step(how, tracker)

        def run():
            model.zero_grad(set_to_none=True)
            if kind == "bridge":
                with _phase(tracker, "backward"):
                    _mark(tracker, model.cast_weights(), "weights")  # the bridge runs the model's parts itself
                    loss = segmented_backward(model.model.layers, model.embed(input_ids),
                                              lambda y: model.head_loss(y, targets), how)
            else:
                with _phase(tracker, "forward"):
                    loss = model(input_ids, targets, run_layers=how)
                    _mark(tracker, model.casts.copies.values(), "weights")  # 16-bit copies, as picockpt marks its own
                with _phase(tracker, "backward"):
                    loss.backward()
            model.release_weights()
            return loss.detach()
        return run

    def hf_step(how, tracker):
        hf = hf_models[how]

        def run():
            hf.zero_grad(set_to_none=True)
            with _phase(tracker, "forward"):
                loss = peers_hf.hf_loss(hf, input_ids, targets)
            with _phase(tracker, "backward"):
                loss.backward()
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

    def grads_of(kind, how):
        """{name: gradient} of one untracked step, under the params' names."""
        torch.manual_seed(seed)  # the same dropout masks as every other run
        if kind == "picockpt":
            return loss_and_grads(params, cfg, input_ids, targets, how)[1]
        step_of(kind, how)()
        owner = hf_models.get(how) if kind == "hf" else model
        grads = peers_hf.hf_grads(owner, cfg.tie_embeddings) if kind == "hf" else model.grads()
        grads = {name: grad.detach().clone() for name, grad in grads.items()}
        owner.zero_grad(set_to_none=True)
        return grads

    for _, kind, how, _ in contenders(cfg, seq, segment):
        if kind == "hf":  # built before any tracking: their weights are not the step's memory
            hf_models[how] = peers_hf.hf_llama(cfg, params, *how, device=device)
    rows = []
    reference = grads_of("picockpt", "none")  # every contender's gradients, against picockpt's under none
    for name, kind, how, equivalent in contenders(cfg, seq, segment):
        # memory and FLOPs in two runs: FlopCounterMode hooks every module's outputs, which under
        # torch.utils.checkpoint keeps recomputed graphs alive until the garbage collector runs
        loss, memory = tracked(kind, how, flops=False)
        _, flops = tracked(kind, how, physical=False)
        grads = grads_of(kind, how)
        worst = max(max_relative_diff(grads[n], reference[n]) for n in reference)
        rows.append({"name": name, "kind": kind, "equivalent": equivalent, "loss": loss.item(),
                     "grad_max_rel_diff": worst,
                     "peak_live_bytes": memory.peak_physical, "total_flops": sum(flops.flops.values()),
                     "recompute_flops": flops.flops["recompute"], "times": []})
        if log:
            log(f"  measured {name}")
    base = next(r for r in rows if r["name"] == "autograd")["total_flops"]
    for row in rows:
        if row["kind"] != "picockpt":
            row["recompute_flops"] = row["total_flops"] - base

    steps = [step_of(kind, how) for _, kind, how, _ in contenders(cfg, seq, segment)]
    for step in steps:  # warm-up
        step()
    for repeat in range(repeats):
        for row, step in zip(rows, steps):
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            row["times"].append(time.perf_counter() - start)
        if log:
            log(f"  timed repeat {repeat + 1}/{repeats}")
    by_name = {row["name"]: row for row in rows}
    for row in rows:  # medians, with the spread over repeats; a ratio is taken repeat by repeat (interleaved)
        times = row["times"]
        row["step_seconds"] = statistics.median(times)
        row["step_seconds_min_max"] = [min(times), max(times)]
        peer = by_name.get(row["equivalent"])
        ratios = [t / u for t, u in zip(times, peer["times"])] if peer else None
        row["time_vs_equivalent"] = statistics.median(ratios) if peer else None
        row["time_vs_equivalent_min_max"] = [min(ratios), max(ratios)] if peer else None
        row["memory_vs_equivalent"] = row["peak_live_bytes"] / peer["peak_live_bytes"] if peer else None
    for row in rows:
        del row["times"]
    return rows


def _phase(tracker, name):
    return tracker.phase(name) if tracker is not None else contextlib.nullcontext()


def _mark(tracker, tensors, category):
    for tensor in tensors if tracker is not None else ():
        tracker.mark(tensor, category)

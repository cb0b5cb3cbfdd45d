"""picockpt's policies beside PyTorch's recomputation on the same shape, weights and batch.

Every run is one forward + backward (no optimizer). Memory and FLOPs come from one tracked
run each; times are medians of interleaved untracked runs (each repeat runs every
contender once, so a slow moment of a shared machine hits them all alike).
For autograd runs recomputation happens inside backward, so their recompute FLOPs are
measured as (their total) - (plain autograd's total).
"""
import contextlib
import math
import statistics
import time

import torch

from . import peers
from .bridge import segmented_backward
from .engine import loss_and_grads
from .measure import _sync, make_batch
from .params import init_params
from .reference import ReferenceLlama
from .tracker import Tracker


def contenders(cfg, seq, segment):
    """(name, kind, how to run, name of its equivalent) for every run of the table."""
    C, segments = segment, math.ceil(cfg.layers / segment)
    return [
        ("picockpt none", "picockpt", "none", "autograd"),
        ("picockpt full", "picockpt", "full", "torch checkpoint per layer"),
        (f"picockpt every:{C}", "picockpt", f"every:{C}", f"torch checkpoint_sequential({segments})"),
        ("picockpt selective", "picockpt", "selective", "torch selective checkpoint"),
        ("picockpt cheap", "picockpt", "cheap", "torch checkpoint saving matmuls"),
        (f"picockpt every:{C}+selective", "picockpt", f"every:{C}+selective", None),
        ("autograd", "torch", peers.autograd, None),
        ("torch checkpoint per layer", "torch", peers.per_layer, None),
        (f"torch checkpoint_sequential({segments})", "torch", peers.sequential(segments), None),
        ("torch selective checkpoint", "torch", peers.selective(seq), None),
        ("torch checkpoint saving matmuls", "torch", peers.save_matmuls(seq), None),
        ("bridge full", "bridge", 1, "torch checkpoint per layer"),
        (f"bridge every:{C}", "bridge", C, f"torch checkpoint_sequential({segments})"),
    ]


def compare(cfg, batch, seq, device="cpu", segment=2, repeats=5, seed=0, log=print):
    cfg.check_seq(seq)
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)
    model = ReferenceLlama(cfg, params).to(device)

    def step_of(kind, how, tracker=None):
        if kind == "picockpt":
            return lambda: loss_and_grads(params, cfg, input_ids, targets, how, tracker=tracker)[0]

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

    def tracked(kind, how, **what):
        torch.manual_seed(seed)
        with Tracker(device, **what) as tracker:
            loss = step_of(kind, how, tracker)()
            if kind != "picockpt":
                for p in model.parameters():
                    tracker.mark(p.grad, "gradients")
        model.zero_grad(set_to_none=True)
        return loss, tracker

    rows = []
    for name, kind, how, equivalent in contenders(cfg, seq, segment):
        # memory and FLOPs in two runs: FlopCounterMode hooks every module's outputs, which under
        # torch.utils.checkpoint keeps recomputed graphs alive until the garbage collector runs
        loss, memory = tracked(kind, how, flops=False)
        _, flops = tracked(kind, how, physical=False)
        rows.append({"name": name, "kind": kind, "equivalent": equivalent, "loss": loss.item(),
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
    for row in rows:
        row["step_seconds"] = statistics.median(row.pop("times"))
    by_name = {row["name"]: row for row in rows}
    for row in rows:
        peer = by_name.get(row["equivalent"])
        row["time_vs_equivalent"] = row["step_seconds"] / peer["step_seconds"] if peer else None
        row["memory_vs_equivalent"] = row["peak_live_bytes"] / peer["peak_live_bytes"] if peer else None
    return rows


def _phase(tracker, name):
    return tracker.phase(name) if tracker is not None else contextlib.nullcontext()


def _mark(tracker, tensors, category):
    for tensor in tensors if tracker is not None else ():
        tracker.mark(tensor, category)

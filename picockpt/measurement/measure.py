"""Measure one policy on one shape: bytes (logical and physical), FLOPs, time, exactness.

    row = measure_policy(cfg, "every:2", batch=4, seq=128)
    row["peak_activation_bytes"] == row["predicted_activation_bytes"]   # exact

Under an offloading policy the store's device bytes stay peak_activation_bytes (and the closed form's,
predicted_activation_bytes); the host tier's peak, its closed form and the bytes copied each way in
each phase come beside them, with the copy time the compute stream waited for: measured with CUDA
events on a GPU, modelled from a bandwidth and a compute rate on a CPU (and labelled so).

Time is measured on untracked steps (the tracker's op-by-op watching is slow); memory and
FLOPs on one tracked step; gradients against policy "none" on the same seed and data.
"""
import contextlib
import statistics
import time

import torch

from ..recompute.engine import loss_and_grads
from ..planning.step_forms import offload_walk, predicted_host_bytes, predicted_peak_bytes
from ..model.params import init_params
from ..recompute.policy import as_policy
from .tracker import Tracker
from .train import MarkovTask, make_optimizer, train_step


def make_batch(cfg, batch, seq, device, seed=0):
    return MarkovTask(cfg.vocab, seed=seed).batch(batch, seq, device)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step, device):
    """Wall seconds of one call of step(), the device's queue empty before and after."""
    sync(device)
    start = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - start


def measure_policy(cfg, policy, batch, seq, device="cpu", seed=0, repeats=3, baseline=None, trace=False,
                   optimizer=True):
    """One row of measurements. `baseline` (loss, grads) of policy none may be passed in
    when several policies are measured on the same shape; otherwise it is computed. optimizer=False: the
    step is a forward and backward alone (no AdamW step, no optimizer state): fp32 master weights and their
    gradients, the 16-bit copies, the activations, as a model whose AdamW state would not fit is measured."""
    policy = as_policy(policy, cfg)
    cfg.check_seq(seq)
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)

    def grads_of(name, **kwargs):
        torch.manual_seed(seed)  # the same dropout masks for every policy
        return loss_and_grads(params, cfg, input_ids, targets, name, **kwargs)

    if baseline is None:  # on the host: a second set of fp32 gradients on the device would double their bytes
        loss, grads = grads_of("none")
        baseline = loss, {name: grad.cpu() for name, grad in grads.items()}
        del loss, grads
    loss, grads = grads_of(policy, trace=trace)
    diff = max((grads[k].double() - baseline[1][k].to(grads[k].device).double()).abs().max().item() for k in grads)
    del grads, baseline  # nothing of these steps stays on the device for the tracked one

    # one tracked step: a training step on a copy of the parameters (the optimizer changes them), or without one
    copy = {name: p.clone() for name, p in params.items()} if optimizer else params
    adamw = make_optimizer(copy) if optimizer else None
    torch.manual_seed(seed)
    with Tracker(device) as tracker:
        if optimizer:
            train_step(copy, adamw, cfg, input_ids, targets, policy, tracker)
        else:
            loss_and_grads(params, cfg, input_ids, targets, policy, tracker=tracker)  # its gradients dropped here
    state_bytes = sum(value.nbytes for state in adamw.state.values() for value in state.values()
                      if isinstance(value, torch.Tensor)) if optimizer else 0
    del copy, adamw

    if optimizer:
        adamw = make_optimizer(params)
        step = lambda: train_step(params, adamw, cfg, input_ids, targets, policy)  # noqa: E731
    else:
        step = lambda: loss_and_grads(params, cfg, input_ids, targets, policy)[0].item()  # noqa: E731
    step()  # warm-up
    times = [time_step(step, device) for _ in range(repeats)]
    row = {
        "policy": policy.text, "device": str(device), "dtype": cfg.dtype, "batch": batch, "seq": seq,
        "layers": cfg.layers, "hidden": cfg.hidden, "attention": cfg.attention, "loss_chunk": cfg.loss_chunk,
        "peak_activation_bytes": tracker.peak_logical,
        "predicted_activation_bytes": predicted_peak_bytes(cfg, batch, seq, policy),
        "peak_live_bytes": tracker.peak_physical,
        "peak_tracked_bytes": max(p["total"] for p in tracker.peaks.values()),  # with weights, grads, optimizer
        "forward_flops": tracker.flops["forward"], "recompute_flops": tracker.flops["recompute"],
        "backward_flops": tracker.flops["backward"],
        "step_seconds": statistics.median(times), "step_seconds_min_max": [min(times), max(times)],
        "loss": loss.item(), "grad_max_abs_diff_vs_none": diff,
        "phase_peaks": tracker.peaks,
        "optimizer": "AdamW" if optimizer else None, "optimizer_state_bytes": state_bytes,
    }
    if tracker.cuda:
        row["cuda_peak_bytes"] = tracker.peak_cuda
    if policy.offload is not None:
        row.update(offload_columns(cfg, batch, seq, policy, tracker))
    return row


def offload_columns(cfg, batch, seq, policy, tracker):
    """The host tier's numbers of one tracked step: measured bytes, their closed forms, the exposed copy time."""
    model = offload_walk(cfg, batch, seq, policy)  # at the default link and rate (host_walk.py)
    columns = {"host_peak_bytes": tracker.peak_host,
               "predicted_host_bytes": predicted_host_bytes(cfg, batch, seq, policy),
               "host_live_peak_bytes": tracker.peak_host_live,
               "copy_bytes": {phase: bytes_ for phase, bytes_ in tracker.copy_bytes.items() if any(bytes_.values())},
               "predicted_copy_bytes": {"to_host": model.to_host, "to_device": model.to_device},
               "modelled_exposed_copy_seconds": model.exposed_seconds, "modelled_step_seconds": model.seconds}
    if tracker.exposed_copy_seconds is not None:
        columns["measured_exposed_copy_seconds"] = tracker.exposed_copy_seconds  # CUDA events
    return columns


class PutRecorder:
    """A listener that remembers the bytes of every put: (layer, name) -> bytes."""

    def __init__(self):
        self.puts = {}

    def on_event(self, event):
        if event.kind == "put":
            self.puts.setdefault((event.layer, event.name), event.bytes)

    def phase(self, name):
        return contextlib.nullcontext()

    def mark(self, tensor, category):
        pass


def measured_inventory(cfg, batch, seq, policy="none", device="cpu", seed=0):
    """(layer, name) -> bytes of every tensor the engine stored during one step."""
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)
    recorder = PutRecorder()
    torch.manual_seed(seed)
    loss_and_grads(params, cfg, input_ids, targets, policy, tracker=recorder)
    return recorder.puts


def max_relative_diff(value, reference):
    """max |value - reference| / max |reference| over one tensor (0 when both are 0)."""
    scale = reference.double().abs().max().item()
    diff = (value.double() - reference.double()).abs().max().item()
    return diff / scale if scale else diff

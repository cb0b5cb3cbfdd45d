"""The tensor-parallel step, as the single-process one is called: full params and batch in, the loss,
full gradients and a report per rank out.

    from picockpt import parallel
    loss, grads, ranks = parallel.loss_and_grads(params, cfg, input_ids, targets, policy="full", tp=2, sp=True)
    ranks[r]["peak_activation_bytes"] == ranks[r]["predicted_activation_bytes"]     # to the byte
    ranks[r]["comm_bytes"] == {"forward": ..., "recompute": ..., "backward": ...}

The caller's process checks everything (a user mistake is a ValueError before any rank starts),
then starts tp ranks (run_ranks: spawned gloo ranks on 127.0.0.1, or the processes torchrun made);
each rank takes its slices of the parameters (tensor_parallel/tp_shard.py) and runs the engine's own loop
(picockpt/engine.py: Step) over its TensorParallelModel, under its own Tracker, to which its Comm
books every collective's bytes by phase. The caller puts the ranks' gradient slices back together.

A rank's report: rank, tp, sp, distribute_saved, policy; peak_activation_bytes (its store's peak)
and predicted_activation_bytes; peak_live_bytes (every tensor the step made, picockpt/tracker.py);
layer_stored_bytes and head_stored_bytes (what layer 0 and the head hold at the end of the forward)
and their predicted_*; comm_bytes, comm_calls, comm_bytes_by_kind and predicted_comm_bytes, by
phase (forward, recompute, backward); flops and predicted_flops, by phase.

Every rank starts from the caller's generator state, so its dropout masks are the single process's
(rng.py), and the caller's generator is left where a single process's step would leave it.
run_steps does several steps in one launch (the tests and the lesson measure every policy that way:
starting ranks costs about a second each).
"""
from dataclasses import dataclass, replace

import torch

from ...engine import Step, device_generator
from ...policy import parse_policy
from ...tracker import Tracker
from ..comm import CommLog
from ..job import PHASES, checked_batch, held_bytes, on_cpu, ranks_generator, trace_lines
from .tp_inventory import (rank_comm_bytes, rank_flops, rank_head_stored_bytes, rank_layer_stored_bytes, rank_peak_bytes,
                        rank_schedule)
from ..launch import check_rank_count, run_ranks
from .tp_shard import check_tensor_parallel, gather_grads, shard_params
from .tp_model import TensorParallelModel


@dataclass
class Job:
    """One step for the ranks to run: the full params and batch, the policy, the layout."""
    params: dict
    cfg: object
    input_ids: torch.Tensor
    targets: torch.Tensor
    policy: str = "full"
    sp: bool = True
    distribute_saved: bool = False
    rng_state: torch.Tensor = None  # the generator state to start from; None: the caller's now


def run_steps(jobs, tp=2, device="cpu", timeout_s=120, port=None, start_method="spawn", trace=False):
    """[(loss, grads, reports)] of every Job, all run by one launch of tp ranks."""
    jobs = [_checked(job, tp, device) for job in jobs]
    state = jobs[-1].rng_state
    sent = [on_cpu(job) for job in jobs]  # what the ranks receive; each moves it to its own device
    results = run_ranks(rank_steps, tp, sent, trace, device=device, timeout_s=timeout_s, port=port,
                        start_method=start_method)
    out = []
    for index, job in enumerate(jobs):
        per_rank = [rank_results[index] for rank_results in results]
        grads = gather_grads([result["grads"] for result in per_rank], job.params)
        grads = {name: grad.to(job.params[name].device) for name, grad in grads.items()}
        reports = [dict(result["report"], **_predicted(job, tp)) for result in per_rank]
        out.append((per_rank[0]["loss"].to(job.params[next(iter(job.params))].device), grads, reports))
        state = per_rank[0]["rng_state"]
    ranks_generator(device).set_state(state)
    return out


def _checked(job, tp, device):
    """The job checked (job.py) and its layout too; ValueError before any rank starts."""
    job = checked_batch(job, device)
    check_tensor_parallel(job.cfg, tp, job.sp, job.input_ids.shape[1], job.distribute_saved)
    check_rank_count("tp", tp, device)
    rank_schedule(parse_policy(job.policy, job.cfg), job.cfg, *job.input_ids.shape, tp, job.sp,
                  job.distribute_saved)  # an impossible budget says so
    return replace(job, sp=bool(job.sp), distribute_saved=bool(job.distribute_saved))


def _predicted(job, tp):
    B, T = job.input_ids.shape
    layout = (tp, job.sp, job.distribute_saved)
    return {"predicted_activation_bytes": rank_peak_bytes(job.cfg, B, T, job.policy, *layout),
            "predicted_layer_stored_bytes": rank_layer_stored_bytes(job.cfg, B, T, job.policy, *layout),
            "predicted_head_stored_bytes": rank_head_stored_bytes(job.cfg, B, T, job.policy, *layout),
            "predicted_comm_bytes": rank_comm_bytes(job.cfg, B, T, job.policy, *layout),
            "predicted_flops": rank_flops(job.cfg, B, T, job.policy, *layout)}


# ---- on each rank ------------------------------------------------------------------------------------
def rank_steps(comm, jobs, trace=False):
    return [rank_step(comm, job, trace) for job in jobs]


def rank_step(comm, job, trace=False):
    """One step on this rank: its shards, the engine's loop, its tracker; returns CPU tensors only."""
    t, cfg, device = comm.world_size, job.cfg, comm.device
    params = shard_params(job.params, comm.rank, t, device)
    input_ids, targets = job.input_ids.to(device), job.targets.to(device)
    policy = parse_policy(job.policy, cfg)
    schedule = rank_schedule(policy, cfg, *input_ids.shape, t, job.sp, job.distribute_saved)
    generator = device_generator(device)
    generator.set_state(job.rng_state)  # every rank as the single process: the same masks (rng.py)
    say = trace_lines(f"rank {comm.rank}", trace)
    comm.log = CommLog()  # this step's bytes only
    with Tracker(device) as tracker, torch.no_grad():
        comm.tracker = tracker  # the collectives book their bytes under the tracker's phase
        model = TensorParallelModel(params, cfg, input_ids, targets, comm, job.sp, job.distribute_saved)
        step = Step(model, schedule, policy.drop, tracker, say)
        loss = step.forward()
        held = {"layer_stored_bytes": held_bytes(step.store, 0), "head_stored_bytes": held_bytes(step.store, None)}
        grads = step.backward()
        del step, model
    comm.tracker = None
    report = {
        "rank": comm.rank, "tp": t, "sp": job.sp, "distribute_saved": job.distribute_saved, "policy": policy.text,
        "peak_activation_bytes": tracker.peak_logical, "peak_live_bytes": tracker.peak_physical,
        **comm.log.report(PHASES),  # bytes and calls per phase, bytes by kind
        "flops": {phase: tracker.flops[phase] for phase in PHASES},
        **held,  # what layer 0 and the head hold at the end of the forward
    }
    return {"loss": loss.cpu(), "grads": {name: grad.cpu() for name, grad in grads.items()},
            "rng_state": generator.get_state().cpu(), "report": report}


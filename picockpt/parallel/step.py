"""The tensor-parallel step, as the single-process one is called: full params and batch in, the loss,
full gradients and a report per rank out.

    from picockpt import parallel
    loss, grads, ranks = parallel.loss_and_grads(params, cfg, input_ids, targets, policy="full", tp=2, sp=True)
    ranks[r]["peak_activation_bytes"] == ranks[r]["predicted_activation_bytes"]     # to the byte
    ranks[r]["comm_bytes"] == {"forward": ..., "recompute": ..., "backward": ...}

The caller's process checks everything (a user mistake is a ValueError before any rank starts),
then starts tp ranks (run_ranks: spawned gloo ranks on 127.0.0.1, or the processes torchrun made);
each rank takes its slices of the parameters (shard.py) and runs the engine's own loop
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
import sys
from dataclasses import dataclass

import torch

from ..engine import Step, _generator, check_batch
from ..params import check_params
from ..policy import parse_policy
from ..tracker import Tracker
from .comm import CommLog
from .inventory import (rank_comm_bytes, rank_flops, rank_head_stored_bytes, rank_layer_stored_bytes, rank_peak_bytes,
                        rank_schedule)
from .launch import check_rank_count, run_ranks
from .shard import check_tensor_parallel, gather_grads, shard_params
from .tp_model import TensorParallelModel

PHASES = ("forward", "recompute", "backward")


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


def loss_and_grads(params, cfg, input_ids, targets, policy="full", tp=None, sp=True, distribute_saved=False,
                   device="cpu", timeout_s=120, port=None, start_method="spawn", trace=False, pp=1, microbatches=1,
                   schedule="1f1b", dp=1, recompute_early=False, overlap=True, ep=1, keep_dispatched=False):
    """Mean next-token cross-entropy, the gradient of every parameter (full shapes, params' names) and
    [one report per rank], computed by tp tensor-parallel ranks (sequence parallel when sp) under
    `policy` (every policy of picockpt.loss_and_grads; budget:SIZE is per rank).
    distribute_saved: without sp, each rank keeps 1/t of every checkpoint-only layer input.
    device "cpu" (gloo) or "cuda" (NCCL, one GPU per rank); timeout_s bounds every collective;
    trace=True prints each rank's engine trace lines, prefixed with the rank.
    pp, microbatches, schedule, dp, recompute_early, overlap: pipeline stages and data-parallel replicas
    (picockpt/parallel/pipeline_job.py), dp x pp x tp ranks in all. tp=None: 2 alone, 1 beside pp or dp.
    ep, keep_dispatched: expert parallelism over ep ranks (picockpt/parallel/ep_step.py), on its own."""
    if ep != 1 or keep_dispatched:
        from .ep_step import ep_loss_and_grads  # it imports this module
        return ep_loss_and_grads(params, cfg, input_ids, targets, policy, ep, keep_dispatched, device, timeout_s, port,
                                 start_method, trace, beside=dict(tp=tp, pp=pp, microbatches=microbatches, dp=dp,
                                                                  distribute_saved=distribute_saved))
    if (pp, microbatches, dp) != (1, 1, 1):
        from .pipeline_job import loss_and_grads as pipeline_loss_and_grads  # it imports this module
        return pipeline_loss_and_grads(params, cfg, input_ids, targets, policy, pp, microbatches, schedule, dp,
                                       1 if tp is None else tp, sp, distribute_saved, recompute_early, overlap,
                                       device, timeout_s, port, start_method, trace)
    tp = 2 if tp is None else tp
    job = Job(params, cfg, input_ids, targets, policy, sp, distribute_saved)
    return run_steps([job], tp, device, timeout_s, port, start_method, trace)[0]


def run_steps(jobs, tp=2, device="cpu", timeout_s=120, port=None, start_method="spawn", trace=False):
    """[(loss, grads, reports)] of every Job, all run by one launch of tp ranks."""
    jobs = [_checked(job, tp, device) for job in jobs]
    state = jobs[-1].rng_state
    sent = [_on_cpu(job) for job in jobs]  # what the ranks receive; each moves it to its own device
    results = run_ranks(_rank_steps, tp, sent, trace, device=device, timeout_s=timeout_s, port=port,
                        start_method=start_method)
    out = []
    for index, job in enumerate(jobs):
        per_rank = [rank_results[index] for rank_results in results]
        grads = gather_grads([result["grads"] for result in per_rank], job.params)
        grads = {name: grad.to(job.params[name].device) for name, grad in grads.items()}
        reports = [dict(result["report"], **_predicted(job, tp)) for result in per_rank]
        out.append((per_rank[0]["loss"].to(job.params[next(iter(job.params))].device), grads, reports))
        state = per_rank[0]["rng_state"]
    _ranks_generator(device).set_state(state)
    return out


def _checked(job, tp, device):
    """The job with its policy parsed and its batch checked; ValueError before any rank starts."""
    policy = parse_policy(job.policy, job.cfg)
    check_params(job.params, job.cfg)
    input_ids, targets = check_batch(job.cfg, job.input_ids, job.targets, job.params)
    check_tensor_parallel(job.cfg, tp, job.sp, input_ids.shape[1], job.distribute_saved)
    check_rank_count("tp", tp, device)
    rank_schedule(policy, job.cfg, *input_ids.shape, tp, job.sp, job.distribute_saved)  # an impossible budget says so
    if job.rng_state is not None:
        state = job.rng_state
    else:
        state = _ranks_generator(device).get_state()
    return Job(job.params, job.cfg, input_ids, targets, policy.text, bool(job.sp), bool(job.distribute_saved), state)


def _ranks_generator(device):
    """The caller's generator of the kind the ranks draw from: its CPU one, or its current GPU's."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return _generator(torch.device("cuda", torch.cuda.current_device()))
    return _generator(torch.device("cpu"))


def _on_cpu(job):
    params = {name: tensor.detach().cpu() for name, tensor in job.params.items()}
    return Job(params, job.cfg, job.input_ids.cpu(), job.targets.cpu(), job.policy, job.sp, job.distribute_saved,
               job.rng_state.cpu())


def _predicted(job, tp):
    B, T = job.input_ids.shape
    layout = (tp, job.sp, job.distribute_saved)
    return {"predicted_activation_bytes": rank_peak_bytes(job.cfg, B, T, job.policy, *layout),
            "predicted_layer_stored_bytes": rank_layer_stored_bytes(job.cfg, B, T, job.policy, *layout),
            "predicted_head_stored_bytes": rank_head_stored_bytes(job.cfg, B, T, job.policy, *layout),
            "predicted_comm_bytes": rank_comm_bytes(job.cfg, B, T, job.policy, *layout),
            "predicted_flops": rank_flops(job.cfg, B, T, job.policy, *layout)}


# ---- on each rank ------------------------------------------------------------------------------------
def _rank_steps(comm, jobs, trace=False):
    return [_rank_step(comm, job, trace) for job in jobs]


def _rank_step(comm, job, trace=False):
    """One step on this rank: its shards, the engine's loop, its tracker; returns CPU tensors only."""
    t, cfg, device = comm.world_size, job.cfg, comm.device
    params = shard_params(job.params, comm.rank, t, device)
    input_ids, targets = job.input_ids.to(device), job.targets.to(device)
    policy = parse_policy(job.policy, cfg)
    schedule = rank_schedule(policy, cfg, *input_ids.shape, t, job.sp, job.distribute_saved)
    generator = _generator(device)
    generator.set_state(job.rng_state)  # every rank as the single process: the same masks (rng.py)
    say = (lambda line: _write(f"[rank {comm.rank}] {line}\n")) if trace else False  # one write a line
    comm.log = CommLog()  # this step's bytes only
    with Tracker(device) as tracker, torch.no_grad():
        comm.tracker = tracker  # the collectives book their bytes under the tracker's phase
        model = TensorParallelModel(params, cfg, input_ids, targets, comm, job.sp, job.distribute_saved)
        step = Step(model, schedule, policy.drop, tracker, say)
        loss = step.forward()
        held = {"layer_stored_bytes": _held_bytes(step.store, 0), "head_stored_bytes": _held_bytes(step.store, None)}
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


def _write(text):
    sys.stdout.write(text)  # a whole line at once: the ranks' lines interleave, never their halves
    sys.stdout.flush()


def _held_bytes(store, layer):
    """Bytes of the unique storages the store holds for one layer (None: the head), as it counts them."""
    storages = {}
    for (held_layer, _), tensor in store.tensors.items():
        if held_layer == layer:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())

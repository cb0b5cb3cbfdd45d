"""One ZeRO rank's steps (stages 1/2/3, with recomputation): what a composed job calls on each rank.

    result = zero_rank_step(comm, job)       # comm: the data-parallel group (a Comm, N_d ranks)
    result = zero_rank_train(comm, job)      # training: one step on each of job.batches (zero_train.py)
    grads = zero_grads([r["grads"] for r in results], job.zero, param_shapes(cfg))   # the caller's side
    params = whole([r["params"] for r in results], param_shapes(cfg))

Both run zero_rank_run, the one loop of steps: a step is forward, backward and (optimizer=True) AdamW on
the rank's shards; the state (shards, AdamW moments, the generator) carries from step to step.

job: any object with these attributes (the caller's job dataclass):
    params, cfg, input_ids, targets   full parameters (HF names) and the whole batch (B, T); rank r of N_d
                                      computes rows r*B/N_d .. (r+1)*B/N_d - 1
    batches                           zero_rank_train, in place of input_ids and targets: one whole batch
                                      (input_ids, targets) per step, every one (B, T)
    policy                            any single-process policy (budget:SIZE is planned for the rank's rows)
    zero                              1, 2 or 3 (zero_model.py: what each stage shards)
    keep_gathered, prefetch           stage 3: a recomputed layer's gather kept for its backward; the next
                                      use's gather started before this one computes
    rng_state                         the generator state every rank starts from (the caller's)
    lr, weight_decay, steps           AdamW (picockpt/train.py's make_optimizer); zero_rank_step: `steps`
                                      steps on this same batch, steps = 0: forward and backward only

Returned (CPU tensors): "losses" (this rank's share of each step's mean loss: the caller adds the ranks'),
"grads" (the last step's: whole under stage 1, this rank's pieces under 2 and 3), "params" (this rank's
pieces of the parameters after the steps), "rng_state", and "report": param_bytes, grad_bytes,
optimizer_bytes, peak_activation_bytes, gathered_peak_bytes (per phase), comm_bytes, comm_calls and
comm_bytes_by_kind (per phase: forward, recompute, backward, optimizer), each beside its predicted_ twin
(zero_inventory.py), for the last step; and step_seconds, every step's seconds on this rank.
"""
import torch

from ...engine import Step, device_generator
from ...params import param_shapes
from ...ops.cross_entropy import IGNORE_INDEX
from ...policy import parse_policy
from ...tracker import Tracker
from ..comm import CommLog
from .zero_inventory import PHASES, STAGES, zero_predictions
from .zero_model import ZeroModel
from .zero_optim import ZeroState, storage_bytes
from .zero_params import whole

WORKS = "dp >= 2 with zero 1, 2 or 3, fp32 or fp64, untied embeddings, no router jitter"


def check_zero(zero, dp, cfg, batch, keep_gathered=False, prefetch=True):
    """ValueError naming the parameter, the value and what would work, before any rank starts."""
    if isinstance(zero, bool) or zero not in STAGES:
        raise ValueError(f"zero={zero!r}: ZeRO's stages are 1 (optimizer state sharded), 2 (and gradients) and "
                         f"3 (and parameters); use one of them, or leave zero out for plain data parallelism")
    if dp == 1:
        raise ValueError(f"zero={zero} with dp=1: ZeRO shards the model state over data-parallel ranks, and with one "
                         f"rank there is nothing to shard; use dp >= 2, or leave zero out")
    for name, value in (("keep_gathered", keep_gathered), ("prefetch", prefetch)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: use True or False")
    for refused, name in ((keep_gathered, "keep_gathered=True"), (not prefetch, "prefetch=False")):
        if refused and zero != 3:
            raise ValueError(f"{name} with zero={zero}: only stage 3 gathers parameters (stages 1 and 2 hold them "
                             f"whole); use zero=3, or leave {name.split('=')[0]} out")
    if batch % dp:
        raise ValueError(f"batch={batch} is not divisible by dp={dp}: each rank computes batch/dp whole sequences; use "
                         f"a batch that is a multiple of {dp}")
    unsupported = [(cfg.dtype not in ("float32", "float64"), f"dtype={cfg.dtype!r} (mixed precision)"),
                   (cfg.tie_embeddings, "tie_embeddings=True (one matrix in two units)"),
                   (cfg.router_jitter > 0, f"router_jitter={cfg.router_jitter} (jitter drawn per rank's rows)"),
                   (cfg.attention == "tiled" and cfg.dropout > 0,
                    "attention='tiled' with dropout (tile masks seeded at the rank's shape)")]
    for refused, what in unsupported:
        if refused:
            raise ValueError(f"zero={zero} with {what} is not supported yet; what works: {WORKS}")


def check_zero_job(job):
    """The ZeRO fields of a picockpt.parallel job (job.py: ParallelJob): refused beside other layouts, or
    without zero."""
    if job.zero:  # ZeRO runs over data-parallel ranks alone, for now
        others = [f"{name}={getattr(job, name)}" for name in ("pp", "microbatches", "tp", "ep", "cp")
                  if getattr(job, name) != 1]
        if others:
            raise ValueError(f"zero={job.zero} with {', '.join(others)} is not supported yet: ZeRO shards the model "
                             f"state over data-parallel ranks alone here; use dp >= 2 with zero and no other layout")
        if not job.overlap:
            raise ValueError(f"overlap=False with zero={job.zero}: ZeRO reduces each unit's gradients as soon as they "
                             f"are final, always (plain data parallelism's buckets are what overlap switches); leave "
                             f"overlap out")
        check_zero(job.zero, job.dp, job.cfg, job.input_ids.shape[0], job.keep_gathered, job.prefetch)
    elif job.steps:
        raise ValueError(f"steps={job.steps} without zero: AdamW on the shards is ZeRO's; add zero=1, 2 or 3 (and "
                         f"dp >= 2), or leave steps out")
    elif job.keep_gathered or not job.prefetch:
        raise ValueError(f"{'keep_gathered=True' if job.keep_gathered else 'prefetch=False'} without zero: it changes "
                         f"when ZeRO-3 gathers parameters, and there is none here; add zero=3 (and dp >= 2), or leave "
                         f"it out")


def zero_rank_steps(comm, jobs):
    """Every job in turn on this rank (a launch's function: run_ranks(zero_rank_steps, dp, jobs))."""
    return [zero_rank_step(comm, job) for job in jobs]


def zero_rank_step(comm, job):
    """job.steps AdamW steps on job's one batch (steps = 0: one forward and backward, no optimizer)."""
    return zero_rank_run(comm, job, [(job.input_ids, job.targets)] * max(job.steps, 1), job.steps > 0)


def zero_rank_train(comm, job):
    """Training: one AdamW step on each of job.batches in turn (zero_train.py's launch)."""
    return zero_rank_run(comm, job, job.batches, optimizer=True)


def zero_rank_run(comm, job, batches, optimizer=True):
    """The steps themselves, one per (input_ids, targets) of `batches` (every one (B, T)), written once."""
    cfg, W, r, device = job.cfg, comm.world_size, comm.rank, comm.device
    B, T = batches[0][0].shape
    check_zero(job.zero, W, cfg, B, job.keep_gathered, job.prefetch)
    mine = slice(r * B // W, (r + 1) * B // W)  # this rank's rows of every batch
    policy = parse_policy(job.policy, cfg)
    schedule = policy.schedule(cfg, B // W, T)
    state = ZeroState(job.params, cfg, job.zero, comm, job.lr, job.weight_decay)
    generator = device_generator(device)
    generator.set_state(job.rng_state)  # every rank as the single process: the same masks
    losses, seconds = [], []
    for whole_ids, whole_targets in batches:
        counted = int((whole_targets != IGNORE_INDEX).sum())  # the whole batch's: the loss is their mean
        input_ids, targets = whole_ids[mine].to(device), whole_targets[mine].to(device)
        comm.log = CommLog()  # this step's bytes only
        param_bytes = state.bytes()["param_bytes"]  # held at the step's start
        with Tracker(device, physical=False, flops=False, times=True) as tracker, torch.no_grad():
            comm.tracker = tracker  # every collective books its bytes under the tracker's phase
            model = ZeroModel(state, cfg, input_ids, targets, comm, counted, schedule, job.keep_gathered, job.prefetch)
            step = Step(model, schedule, policy.drop, tracker)
            losses.append(step.forward())
            grads = step.backward()
            grad_bytes = storage_bytes(grads.values())
            if optimizer:
                with tracker.phase("optimizer"):
                    state.step(comm, tracker)
        comm.tracker = None
        seconds.append(sum(tracker.seconds.values()))  # the step's (on CUDA the tracker synchronizes at its end)
    report = {"rank": r, "dp": W, "zero": job.zero, "policy": policy.text, "keep_gathered": job.keep_gathered,
              "prefetch": job.prefetch, "param_bytes": param_bytes, "grad_bytes": grad_bytes,
              "optimizer_bytes": state.bytes()["optimizer_bytes"], "peak_activation_bytes": tracker.peak_logical,
              "gathered_peak_bytes": dict(model.gathered_peak), **comm.log.report(PHASES), "step_seconds": seconds,
              **zero_predictions(cfg, B, T, policy, job.zero, W, job.keep_gathered, job.prefetch, optimizer)}
    params = {name: piece.cpu().clone() for key, unit in state.units.items()
              for name, piece in unit.pieces(state.shard(key), r).items()}
    return {"losses": [loss.cpu() for loss in losses], "grads": {name: g.cpu() for name, g in grads.items()},
            "params": params, "rng_state": generator.get_state().cpu(), "report": report}


def zero_grads(grads_by_rank, zero, shapes):
    """The whole gradients from every rank's: rank 0's under stage 1 (every rank holds the sum), else the
    pieces put together (zero_params.whole)."""
    return dict(grads_by_rank[0]) if zero == 1 else whole(grads_by_rank, shapes)


def zero_collected(job, per_rank):
    """(loss, gradients under the params' names, reports) of a ZeRO job, from every rank's result: the loss is
    the ranks' shares of the last step's mean added up; the gradients the last step's, put together."""
    loss = sum(result["losses"][-1] for result in per_rank)
    grads = zero_grads([result["grads"] for result in per_rank], job.zero, param_shapes(job.cfg))
    where = next(iter(job.params.values())).device
    return (loss.to(where), {name: grads[name].to(job.params[name].dtype).to(where) for name in job.params},
            [result["report"] for result in per_rank])

"""One ZeRO rank's steps (stages 1/2/3, with recomputation): what a composed job calls on each rank.

    result = zero_rank_step(comm, job)       # comm: the data-parallel group (a Comm, N_d ranks)
    grads = zero_grads([r["grads"] for r in results], job.zero, param_shapes(cfg))   # the caller's side
    params = whole([r["params"] for r in results], param_shapes(cfg))

job: any object with these attributes (the caller's job dataclass):
    params, cfg, input_ids, targets   full parameters (HF names) and the whole batch (B, T); rank r of N_d
                                      computes rows r*B/N_d .. (r+1)*B/N_d - 1
    policy                            any single-process policy (budget:SIZE is planned for the rank's rows)
    zero                              1, 2 or 3 (zero_model.py: what each stage shards)
    keep_gathered, prefetch           stage 3: a recomputed layer's gather kept for its backward; the next
                                      use's gather started before this one computes
    rng_state                         the generator state every rank starts from (the caller's)
    lr, weight_decay, steps           AdamW (picockpt/train.py's make_optimizer) for `steps` steps on this
                                      same batch; steps = 0: forward and backward only

Returned (CPU tensors): "losses" (this rank's share of each step's mean loss: the caller adds the ranks'),
"grads" (the last step's: whole under stage 1, this rank's pieces under 2 and 3), "params" (this rank's
pieces of the parameters after the steps), "rng_state", and "report": param_bytes, grad_bytes,
optimizer_bytes, peak_activation_bytes, gathered_peak_bytes (per phase), comm_bytes, comm_calls and
comm_bytes_by_kind (per phase: forward, recompute, backward, optimizer), each beside its predicted_ twin
(zero_inventory.py), for the last step.
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
    if keep_gathered and zero != 3:
        raise ValueError(f"keep_gathered=True with zero={zero}: only stage 3 gathers parameters (stages 1 and 2 hold "
                         f"them whole); use zero=3, or leave keep_gathered out")
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


def zero_rank_steps(comm, jobs):
    """Every job in turn on this rank (a launch's function: run_ranks(zero_rank_steps, dp, jobs))."""
    return [zero_rank_step(comm, job) for job in jobs]


def zero_rank_step(comm, job):
    cfg, W, r, device = job.cfg, comm.world_size, comm.rank, comm.device
    B, T = job.input_ids.shape
    check_zero(job.zero, W, cfg, B, job.keep_gathered, job.prefetch)
    mine = slice(r * B // W, (r + 1) * B // W)
    input_ids, targets = job.input_ids[mine].to(device), job.targets[mine].to(device)
    counted = int((job.targets != IGNORE_INDEX).sum())  # the whole batch's: the loss is their mean
    policy = parse_policy(job.policy, cfg)
    schedule = policy.schedule(cfg, B // W, T)
    state = ZeroState(job.params, cfg, job.zero, comm, job.lr, job.weight_decay)
    generator = device_generator(device)
    generator.set_state(job.rng_state)  # every rank as the single process: the same masks
    losses = []
    for _ in range(max(job.steps, 1)):
        comm.log = CommLog()  # this step's bytes only
        param_bytes = state.bytes()["param_bytes"]  # held at the step's start
        with Tracker(device, physical=False, flops=False) as tracker, torch.no_grad():
            comm.tracker = tracker  # every collective books its bytes under the tracker's phase
            model = ZeroModel(state, cfg, input_ids, targets, comm, counted, schedule, job.keep_gathered, job.prefetch)
            step = Step(model, schedule, policy.drop, tracker)
            losses.append(step.forward())
            grads = step.backward()
            grad_bytes = storage_bytes(grads.values())
            if job.steps:
                with tracker.phase("optimizer"):
                    state.step(comm, tracker)
        comm.tracker = None
    report = {"rank": r, "dp": W, "zero": job.zero, "policy": policy.text, "keep_gathered": job.keep_gathered,
              "prefetch": job.prefetch, "param_bytes": param_bytes, "grad_bytes": grad_bytes,
              "optimizer_bytes": state.bytes()["optimizer_bytes"], "peak_activation_bytes": tracker.peak_logical,
              "gathered_peak_bytes": dict(model.gathered_peak), **comm.log.report(PHASES),
              **zero_predictions(cfg, B, T, policy, job.zero, W, job.keep_gathered, job.prefetch, job.steps > 0)}
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

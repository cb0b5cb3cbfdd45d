"""The expert-parallel step, as the single-process one is called: full params and batch in, the loss,
full gradients and a report per rank out.

    from picockpt import parallel
    loss, grads, ranks = parallel.loss_and_grads(params, cfg, input_ids, targets, policy="full", ep=2)
    loss, grads, ranks = parallel.loss_and_grads(..., policy="full", ep=2, keep_dispatched=True)
    ranks[r]["peak_activation_bytes"] == ranks[r]["predicted_activation_bytes"]     # to the byte
    ranks[r]["comm_bytes"] == {"forward": ..., "recompute": ..., "backward": ...}

The caller's process checks everything (a user mistake is a ValueError before any rank starts),
then starts ep ranks (run_ranks). Rank r takes its experts and its sequences (ep_model.py), runs the
engine's own loop (picockpt/engine.py: Step) over its ExpertParallelModel under its own Tracker,
to which its Comm books every all-to-all by phase, and at the end of the backward sums the
replicated weights' gradients over the ranks (one all-reduce each: those weights are data
parallel). The caller adds the ranks' shares of the loss and puts the experts' gradients together.

A rank's report: rank, ep, policy, keep_dispatched, experts and sequences (the global ids it holds);
peak_activation_bytes and predicted_activation_bytes; peak_live_bytes; layer_stored_bytes and
head_stored_bytes (layer 0 and the head at the end of the forward) and their predicted_*;
received_rows (per layer: the rows its experts got) and predicted_received_rows; comm_bytes,
comm_calls, comm_bytes_by_kind and predicted_comm_bytes, by phase; flops and predicted_flops.
The predictions take the routing of the single process on the whole batch (picockpt.routing.step_routing,
from the step's generator state), as picockpt/inventory.py does.

Every rank starts from the caller's generator state and draws the whole batch's masks and jitter
(ep_layer.py), so the caller's generator is left where a single process's step would leave it.
"""
from dataclasses import dataclass

import torch

from ...engine import Step, device_generator
from ...routing import step_routing
from ...ops.cross_entropy import IGNORE_INDEX
from ...params import EMBED, HEAD
from ...policy import parse_policy
from ...tracker import Tracker
from ..comm import CommLog, all_reduce_grads
from .ep_inventory import (ep_comm_bytes, ep_flops, ep_head_stored_bytes, ep_layer_stored_bytes, ep_peak_bytes,
                           ep_sent_bytes, received_rows)
from .ep_model import ExpertParallelModel
from .ep_shard import gather_expert_grads, is_expert, shard_experts
from ..job import PHASES, checked_batch, held_bytes, on_cpu, ranks_generator, trace_lines
from ..launch import check_rank_count, run_ranks


@dataclass
class ExpertJob:
    """One expert-parallel step for the ranks to run: the full params and batch, the policy, the choice."""
    params: dict
    cfg: object
    input_ids: torch.Tensor
    targets: torch.Tensor
    policy: str = "full"
    keep_dispatched: bool = False  # keep the dispatched rows: a recomputation reads them, no all-to-all
    rng_state: torch.Tensor = None  # the generator state to start from; None: the caller's now


def check_expert_parallel(cfg, ep, batch, policy, keep_dispatched=False):
    """ValueError naming the parameter, the value and what would work, for every split that cannot be."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep={ep!r}: use a whole number of expert-parallel ranks, 1 or more")
    E = cfg.experts
    if not E:
        raise ValueError(f"ep={ep} with Config.experts=0: expert parallelism splits a mixture of experts over the "
                         f"ranks, and this model's MLP is dense; set experts to a multiple of {ep}")
    fits = [n for n in range(1, E + 1) if E % n == 0 and batch % n == 0]
    if E % ep:
        raise ValueError(f"ep={ep} does not divide experts={E}: each rank holds E/ep whole experts; use ep in {fits}")
    if batch % ep:
        raise ValueError(f"batch={batch} is not divisible by ep={ep}: each rank computes batch/ep whole sequences; "
                         f"use a batch that is a multiple of {ep}, or ep in {fits}")
    policy = parse_policy(policy, cfg)
    if policy.budget is not None:
        raise ValueError(f"policy {policy.text!r} with ep={ep}: a budget is planned per rank, but a rank's bytes "
                         f"depend on the tokens routed to its experts, and every rank must recompute the same layers "
                         f"at the same time (their all-to-alls meet); use none, full or every:C, with op-level options")
    if ep > 1 and cfg.attention == "tiled" and cfg.dropout > 0:
        raise ValueError(f"attention='tiled' with dropout={cfg.dropout} and ep={ep}: each tile's mask comes from a "
                         f"generator seeded by the tile's index at the shape of a rank's batch, so no rank's masks "
                         f"equal the single process's; use attention='eager', dropout=0, or ep=1")
    if not isinstance(keep_dispatched, bool):
        raise ValueError(f"keep_dispatched={keep_dispatched!r}: use True (keep the dispatched rows) or False "
                         f"(dispatch them again when recomputing)")
    return ep


def check_alone(ep, tp=None, pp=1, microbatches=1, dp=1, distribute_saved=False):
    """Expert parallelism runs on its own here: ValueError for any other layout asked beside it."""
    if tp not in (None, 1):
        raise ValueError(f"ep={ep} with tp={tp}: expert parallelism here keeps every weight but the experts' whole "
                         f"on each rank (no tensor parallelism beside it); leave tp out, or use tp without ep")
    for name, value in (("pp", pp), ("microbatches", microbatches), ("dp", dp)):
        if value != 1:
            raise ValueError(f"ep={ep} with {name}={value}: expert parallelism here runs on its own, its ranks already "
                             f"data parallel outside the experts; leave {name} out, or use it without ep")
    if distribute_saved:
        raise ValueError(f"ep={ep} with distribute_saved=True: that splits a tensor-parallel checkpoint over tp ranks; "
                         f"leave it out with ep")


def ep_loss_and_grads(params, cfg, input_ids, targets, policy="full", ep=2, keep_dispatched=False, device="cpu",
                      timeout_s=120, port=None, start_method="spawn", trace=False, beside=None):
    """Mean next-token cross-entropy, the gradient of every parameter (full shapes, params' names) and
    [one report per rank], computed by ep expert-parallel ranks under `policy` (none, full, every:C,
    with op-level options). keep_dispatched: every layer keeps the rows its experts received, and a
    recomputation reads them instead of dispatching them again. beside: the other layouts' arguments
    of picockpt.parallel.loss_and_grads (tp, pp, microbatches, dp, distribute_saved), all at rest."""
    check_alone(ep, **(beside or {}))
    job = ExpertJob(params, cfg, input_ids, targets, policy, keep_dispatched)
    return run_expert_steps([job], ep, device, timeout_s, port, start_method, trace)[0]


def run_expert_steps(jobs, ep=2, device="cpu", timeout_s=120, port=None, start_method="spawn", trace=False):
    """[(loss, grads, reports)] of every ExpertJob, all run by one launch of ep ranks."""
    jobs = [_checked(job, ep, device) for job in jobs]
    generator = ranks_generator(device)
    before = generator.get_state()
    routings = [_routing(job, generator, ep) for job in jobs]  # the single process's, for the closed forms
    generator.set_state(before)  # left as it was, should a rank fail
    sent = [on_cpu(job) for job in jobs]  # what the ranks receive; each moves it to its own device
    results = run_ranks(rank_steps, ep, sent, trace, device=device, timeout_s=timeout_s, port=port,
                        start_method=start_method)
    out = []
    for index, (job, routing) in enumerate(zip(jobs, routings)):
        per_rank = [rank_results[index] for rank_results in results]
        where = job.params[EMBED].device
        grads = gather_expert_grads([result["grads"] for result in per_rank], job.params)
        grads = {name: grad.to(where) for name, grad in grads.items()}
        loss = sum(result["loss"] for result in per_rank)  # the ranks' shares of the whole batch's mean
        reports = [dict(result["report"], **_predicted(job, ep, rank, routing)) for rank, result in enumerate(per_rank)]
        out.append((loss.to(where), grads, reports))
    generator.set_state(results[0][-1]["rng_state"])  # where a single process's steps would leave it
    return out


def _checked(job, ep, device):
    """The job with its policy parsed and its batch checked; ValueError before any rank starts."""
    job = checked_batch(job, device)
    check_expert_parallel(job.cfg, ep, job.input_ids.shape[0], job.policy, job.keep_dispatched)
    check_rank_count("ep", ep, device)
    return job


def _routing(job, generator, ep):
    """Every layer's per-expert token counts in the single process's forward of the whole batch, split by the
    ep ranks' sequences, from the job's generator state (the same jitter noise and dropout masks as the step)."""
    generator.set_state(job.rng_state)
    return step_routing(job.params, job.cfg, job.input_ids, ranks=ep)


def _predicted(job, ep, rank, by_rank):
    B, T = job.input_ids.shape
    routing = [[sum(column) for column in zip(*layer)] for layer in by_rank]  # the whole batch's counts
    args = (job.cfg, B, T, job.policy, ep, rank, routing, job.keep_dispatched)
    return {"predicted_activation_bytes": ep_peak_bytes(*args),
            "predicted_layer_stored_bytes": ep_layer_stored_bytes(*args),
            "predicted_head_stored_bytes": ep_head_stored_bytes(job.cfg, B, T, job.policy, ep),
            "predicted_comm_bytes": ep_comm_bytes(*args), "predicted_flops": ep_flops(*args),
            "predicted_received_rows": [received_rows(job.cfg, counts, ep, rank) for counts in routing],
            "predicted_all_to_all_sent_bytes": ep_sent_bytes(job.cfg, B, T, job.policy, ep, rank, by_rank,
                                                             job.keep_dispatched)}


# ---- on each rank ------------------------------------------------------------------------------------
def rank_steps(comm, jobs, trace=False):
    return [rank_step(comm, job, trace) for job in jobs]


def rank_step(comm, job, trace=False):
    """One step on this rank: its experts and sequences, the engine's loop, its tracker; CPU tensors out."""
    W, r, cfg, device = comm.world_size, comm.rank, job.cfg, comm.device
    B, T = job.input_ids.shape
    mine = slice(r * B // W, (r + 1) * B // W)  # its sequences
    params = shard_experts(job.params, r, W, device)
    input_ids, targets = job.input_ids[mine].to(device), job.targets[mine].to(device)
    counted = int((job.targets != IGNORE_INDEX).sum())  # the whole batch's: the loss is their mean
    policy = parse_policy(job.policy, cfg)
    generator = device_generator(device)
    generator.set_state(job.rng_state)  # every rank as the single process: the same masks and noise
    say = trace_lines(f"rank {r}", trace)
    comm.log = CommLog()  # this step's bytes only
    with Tracker(device) as tracker, torch.no_grad():
        comm.tracker = tracker  # the collectives book their bytes under the tracker's phase
        model = ExpertParallelModel(params, cfg, input_ids, targets, comm, counted, job.keep_dispatched)
        step = Step(model, policy.schedule(cfg, B // W, T), policy.drop, tracker, say)
        model.store = step.store  # where every layer keeps its routing, whatever its mode
        loss = step.forward()
        held = {"layer_stored_bytes": held_bytes(step.store, 0), "head_stored_bytes": held_bytes(step.store, None)}
        grads = step.backward()
        with tracker.phase("backward"):
            # data parallel: every weight but the experts' is replicated, and each rank's gradient comes
            # from its own sequences; the whole batch's is their sum (the loss shares already scale them)
            tied = cfg.tie_embeddings and HEAD in grads  # one matrix under two names: reduced once
            grads.update(all_reduce_grads({name: grad for name, grad in grads.items()
                                           if not is_expert(name) and not (tied and name == HEAD)}, comm))
            if tied:
                grads[HEAD] = grads[EMBED]
        del step
    comm.tracker = None
    report = {
        "rank": r, "ep": W, "policy": policy.text, "keep_dispatched": job.keep_dispatched,
        "experts": list(range(model.first_expert, model.first_expert + cfg.experts // W)),
        "sequences": list(range(mine.start, mine.stop)),
        "peak_activation_bytes": tracker.peak_logical, "peak_live_bytes": tracker.peak_physical,
        "received_rows": [model.received_rows[i] for i in model.layers],
        **comm.log.report(PHASES),  # bytes and calls per phase, bytes by kind
        "flops": {phase: tracker.flops[phase] for phase in PHASES},
        **held,  # what layer 0 and the head hold at the end of the forward
    }
    return {"loss": loss.cpu(), "grads": {name: grad.cpu() for name, grad in grads.items()},
            "rng_state": generator.get_state().cpu(), "report": report}

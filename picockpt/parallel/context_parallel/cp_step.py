"""One context-parallel rank's step: what it is given, the checks before any work, what it returns.

    step = ContextStep(params, cfg, input_ids, targets, policy="full", layout="zigzag", cp_comm="ring")
    check_context_parallel(cfg, cp, T, "zigzag", "ring")         # ValueError before any rank starts
    results = run_ranks(cp_rank_steps, cp, [step, ...])           # one launch, every step in turn
    result = cp_rank_step(comm, step)                            # on a rank: {"loss", "grads", "report", ...}

Rank r takes its tokens of every sequence (cp_layout.py), runs the engine's own loop (picockpt/engine.py:
Step) over its ContextParallelModel (cp_model.py) under its own Tracker, to which its Comm books every
ring step or all-gather by phase, and after the backward sums the replicated weights' gradients over
the ranks (one all-reduce each, booked "outside" the three phases). Its loss is its share of the whole
batch's mean: the caller adds the ranks' shares. Every rank returns the same, whole gradients.

A rank's report: rank, cp, layout, cp_comm, keep_kv, policy, chunks (the chunks of the sequence it holds)
and chunk_tokens (c);
peak_activation_bytes and predicted_activation_bytes; peak_live_bytes; comm_bytes, comm_calls,
comm_bytes_by_kind and predicted_comm_bytes by phase; gradient_bytes and predicted_gradient_bytes;
flops and predicted_flops by phase; attention_flops (one matmul of one layer, cp_inventory.py).
"""
from dataclasses import dataclass

import torch

from ...batch import check_batch
from ...engine import Step, device_generator
from ...params import EMBED, HEAD
from ...policy import parse_policy
from ...tracker import Tracker
from ..comm import CommLog, all_reduce_grads
from ..comm import PHASES
from ..launch import check_rank_count
from .cp_inventory import cp_comm_bytes, cp_flops, cp_peak_bytes, gradient_bytes, rank_attention_flops
from .cp_layout import SequenceLayout, check_layout
from .cp_model import ContextParallelModel

COMMS = ("ring", "allgather")


@dataclass
class ContextStep:
    """What one context-parallel step needs on every rank: the whole params and batch, and the choices."""
    params: dict
    cfg: object
    input_ids: torch.Tensor  # (B, T) the whole batch: each rank takes its tokens
    targets: torch.Tensor
    policy: str = "none"
    layout: str = "zigzag"  # "zigzag" | "contiguous" (cp_layout.py)
    cp_comm: str = "ring"  # "ring" | "allgather" (cp_model.py)
    keep_kv: bool = False  # allgather: keep the other ranks' K/V for the recomputation and the backward
    rng_state: torch.Tensor = None  # the generator state every rank starts from; None: as it is


def check_context_parallel(cfg, cp, seq, layout="zigzag", cp_comm="ring", keep_kv=False, policy="none",
                           device="cpu"):
    """ValueError naming the parameter, the value and what would work, before any work starts."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r}: give a whole number of ranks, 1 or more")
    check_layout(layout, cp, seq)
    if cp_comm not in COMMS:
        raise ValueError(f"cp_comm={cp_comm!r}: use 'ring' (K/V passed round, cp - 1 steps) or 'allgather' "
                         f"(K/V all-gathered once per layer)")
    if not isinstance(keep_kv, bool):
        raise ValueError(f"keep_kv={keep_kv!r}: use True or False")
    if keep_kv and cp_comm != "allgather":
        raise ValueError("keep_kv=True with cp_comm='ring': it keeps the all-gathered K/V of the other ranks; "
                         "use cp_comm='allgather', or leave keep_kv out (the ring passes the blocks round again)")
    if cfg.attention == "eager":
        raise ValueError("Config.attention='eager' under context parallelism: eager attention keeps the "
                         "probabilities and has no log-sum-exp to merge the ranks' blocks with; use "
                         "attention='tiled' or 'fused'")
    if cfg.dropout > 0:
        raise ValueError(f"Config.dropout={cfg.dropout} under context parallelism: the masks of blocks spread "
                         f"over ranks are not made equal to the single process's here; use dropout=0")
    if cfg.experts or cfg.router_jitter:
        raise ValueError(f"Config.experts={cfg.experts} under context parallelism: not supported here; use a "
                         f"dense MLP (experts=0), or expert parallelism (ep)")
    parsed = parse_policy(policy, cfg)
    if parsed.budget is not None or getattr(parsed, "offload", None) is not None:
        raise ValueError(f"policy={parsed.text!r} under context parallelism: budget and offloading policies are "
                         f"not planned per context-parallel rank; use none, full, every:C, selective or cheap")
    check_rank_count("cp", cp, device)


def cp_rank_steps(comm, steps):
    return [cp_rank_step(comm, step) for step in steps]


def cp_rank_step(comm, step):
    """One step on this rank of comm (cp = its size): its tokens, the engine's loop, its tracker; returns
    CPU tensors only: its loss share, the whole (summed) gradients, the generator state, its report."""
    cfg, cp, device, rank = step.cfg, comm.world_size, comm.device, comm.rank
    input_ids, targets = check_batch(cfg, step.input_ids, step.targets, step.params)  # (B, T) each, checked
    B, T = input_ids.shape
    check_context_parallel(cfg, cp, T, step.layout, step.cp_comm, step.keep_kv, step.policy, device)
    layout = SequenceLayout(step.layout, cp, T)
    policy = parse_policy(step.policy, cfg)
    params = {name: tensor.to(device) for name, tensor in step.params.items()}
    generator = device_generator(device)
    if step.rng_state is not None:
        generator.set_state(step.rng_state)
    comm.log = CommLog()  # this step's bytes only
    with Tracker(device) as tracker, torch.no_grad():
        comm.tracker = tracker  # the ring and the all-gathers book their bytes under the tracker's phase
        model = ContextParallelModel(params, cfg, input_ids.to(device), targets.to(device), comm, layout,
                                     step.cp_comm, step.keep_kv)
        engine = Step(model, policy.schedule(cfg, B, T // cp), policy.drop, tracker)
        model.store = engine.store  # where the kept K/V go, whatever a layer's mode
        loss = engine.forward()
        grads = engine.backward()
        del engine, model
        grads = summed(grads, cfg, comm)  # booked "outside": after the backward phase
    comm.tracker = None
    args = (cfg, B, T, policy, cp)
    report = {
        "rank": rank, "cp": cp, "layout": step.layout, "cp_comm": step.cp_comm, "keep_kv": step.keep_kv,
        "policy": policy.text, "chunks": layout.chunks(rank), "chunk_tokens": layout.chunk,
        "peak_activation_bytes": tracker.peak_logical, "peak_live_bytes": tracker.peak_physical,
        "predicted_activation_bytes": cp_peak_bytes(*args, step.cp_comm, step.keep_kv),
        **comm.log.report(PHASES),  # bytes and calls per phase, bytes by kind
        "predicted_comm_bytes": cp_comm_bytes(*args, step.cp_comm, step.keep_kv),
        "gradient_bytes": comm.log.total("outside"),  # the gradients' all-reduce, after the step
        "predicted_gradient_bytes": gradient_bytes(params) if cp > 1 else 0,
        "flops": {phase: tracker.flops[phase] for phase in PHASES},
        "predicted_flops": cp_flops(*args, step.layout, rank),
        "attention_flops": rank_attention_flops(cfg, B, T, cp, step.layout, rank),
    }
    return {"loss": loss.cpu(), "grads": {name: grad.cpu() for name, grad in grads.items()},
            "rng_state": generator.get_state().cpu(), "report": report}


def summed(grads, cfg, comm):
    """Every weight is replicated and each rank's gradient is its tokens' part: their sum over the ranks
    (one all-reduce per tensor; a tied embedding's one matrix once)."""
    tied = cfg.tie_embeddings and HEAD in grads and grads[HEAD] is grads.get(EMBED)
    reduced = all_reduce_grads({name: grad for name, grad in grads.items() if not (tied and name == HEAD)}, comm)
    if tied:
        reduced[HEAD] = reduced[EMBED]
    return reduced


def context_step(job):
    """The ContextStep of a picockpt.parallel job (job.py: ParallelJob with cp > 1)."""
    return ContextStep(job.params, job.cfg, job.input_ids, job.targets, job.policy, job.cp_layout, job.cp_comm,
                       job.cp_keep_kv, job.rng_state)


def cp_collected(job, per_rank):
    """(loss, gradients under the params' names, reports) from every rank's result: the loss is the ranks'
    shares of the mean added up; every rank holds the same, summed gradients."""
    loss = sum(result["loss"] for result in per_rank)
    where = next(iter(job.params.values())).device
    grads = per_rank[0]["grads"]
    return (loss.to(where), {name: grads[name].to(job.params[name].dtype).to(where) for name in job.params},
            [result["report"] for result in per_rank])

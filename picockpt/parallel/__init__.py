"""picockpt across processes, in the Picotron manner: every collective an explicit line.

    from picockpt import parallel
    loss, grads, ranks = parallel.loss_and_grads(params, cfg, ids, targets, policy="selective", tp=2, sp=True)

    from picockpt.parallel import run_ranks, gather_sequence_forward

    def step(comm, shards):                  # at module level: spawned ranks import it by name
        return gather_sequence_forward(shards[comm.rank], comm, dim=1)   # (B, T/2, h) -> (B, T, h)

    results = run_ranks(step, 2, x.chunk(2, dim=1))   # spawned local ranks on gloo, or torchrun's

launch.py     where the processes come from (torchrun, or spawned on 127.0.0.1), timeouts
watch.py      the caller's side of spawned ranks: results, the first failure, stopping the rest
comm.py       the Comm object, its log of bytes per phase, and the collectives as forward/backward pairs
shard.py      which slice of each weight a tensor-parallel rank holds; the checks; gradients put back together
rng.py        dropout masks equal to the single process's: drawn whole, sliced
tp_layer.py   a decoder layer on one tensor-parallel rank, with or without sequence parallelism
vocab.py      the vocabulary-parallel embedding, LM head and cross-entropy
tp_model.py   one rank's model for the engine's loop; distributed saved activations
inventory.py  per-rank closed forms: stored bytes, communication bytes per phase, FLOPs
step.py       loss_and_grads / run_steps: full params in, full gradients and per-rank reports out
layout.py     dp x pp x tp: which rank is which, and the process groups
schedules.py  pipeline stages' layers; AFAB and 1F1B orders of forwards and backwards; micro-batches in flight
p2p.py        sends and receives between stages, as forward/backward pairs
stage_model.py  one stage's micro-batch for the engine's loop: receive, layers, send; the loss's share
dp.py         gradient buckets, all-reduced over data-parallel replicas as soon as they are final
timeline.py   what each rank did when; every micro-batch's store counted as one
pp_inventory.py  per-stage closed forms: stored bytes with micro-batches in flight, p2p bytes, FLOPs; budgets
pipeline.py   one rank's pipeline step; pipeline_job.py the caller's side (PipelineJob, run_pipeline_steps)
ep_moe.py     a mixture of experts over expert-parallel ranks: dispatch and combine all-to-alls, forward and backward
ep_layer.py   a decoder layer on one expert-parallel rank; whole-batch random draws; what every layer keeps
ep_model.py   one expert-parallel rank's model for the engine's loop; which experts each rank holds
ep_inventory.py  per-rank closed forms under expert parallelism: stored bytes, all-to-all bytes per phase, FLOPs
ep_step.py    the expert-parallel step (ExpertJob, run_expert_steps; loss_and_grads(..., ep=2))
"""
from .comm import (Comm, CommLog, all_reduce_grads, all_reduce_max, all_to_all_backward, all_to_all_forward,
                   copy_to_parallel_backward, copy_to_parallel_forward, exchange_splits,
                   gather_sequence_backward, gather_sequence_forward, reduce_from_parallel_backward,
                   reduce_from_parallel_forward, scatter_sequence_backward, scatter_sequence_forward,
                   split_sequence_backward, split_sequence_forward)
from .launch import RankError, run_ranks, under_torchrun
from .step import Job, loss_and_grads, run_steps
from .pipeline_job import PipelineJob, run_pipeline_steps
from .ep_step import ExpertJob, run_expert_steps
from .p2p import (from_previous_stage_backward, from_previous_stage_forward, to_next_stage_backward,
                  to_next_stage_forward)

__all__ = ["run_ranks", "under_torchrun", "RankError", "Comm", "CommLog", "copy_to_parallel_forward",
           "copy_to_parallel_backward", "reduce_from_parallel_forward", "reduce_from_parallel_backward",
           "gather_sequence_forward", "gather_sequence_backward", "scatter_sequence_forward",
           "scatter_sequence_backward", "split_sequence_forward", "split_sequence_backward",
           "all_to_all_forward", "all_to_all_backward", "exchange_splits", "all_reduce_grads", "all_reduce_max",
           "loss_and_grads", "run_steps", "Job", "PipelineJob", "run_pipeline_steps", "from_previous_stage_forward",
           "from_previous_stage_backward", "to_next_stage_forward", "to_next_stage_backward", "ExpertJob",
           "run_expert_steps"]

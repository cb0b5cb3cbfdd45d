"""picockpt across processes, in the Picotron manner: a folder per parallelism, every collective an explicit line
beside the layer that calls it.

    jobs = [parallel.ParallelJob(params, cfg, ids, targets, policy, parallel.Layout(ep=2, dp=2))
            for policy in ("none", "full")]
    results = parallel.run_jobs(jobs)                 # one launch of 4 ranks runs both steps in turn

    def step(comm, shards):                  # at module level: spawned ranks import it by name
        return parallel.gather_sequence_forward(shards[comm.rank], comm, dim=1)   # (B, T/2, h) -> (B, T, h)
    results = parallel.run_ranks(step, 2, x.chunk(2, dim=1))   # spawned local ranks on gloo, or torchrun's

Read step.py first (the caller's side), then rank.py (one rank's step, for any layout) and rank_model.py (its model:
each dimension applied over the ones before). Every other module opens with what it holds, and so does each folder
(tensor_parallel/, pipeline_parallel/, data_parallel/, expert_parallel/, context_parallel/), naming the file to
read first.
"""
from .comm import Comm, CommLog, all_reduce_grads, all_reduce_max
from .expert_parallel.ep_comm import all_to_all_backward, all_to_all_forward, exchange_splits
from .job import ParallelJob
from .layout import Layout
from .launch import RankError, run_ranks, under_torchrun
from .pipeline_parallel.pp_comm import (from_previous_stage_backward, from_previous_stage_forward,
                                        to_next_stage_backward, to_next_stage_forward)
from .step import loss_and_grads, run_jobs
from .tensor_parallel.tp_comm import (copy_to_parallel_backward, copy_to_parallel_forward, gather_sequence_backward,
                                      gather_sequence_forward, reduce_from_parallel_backward,
                                      reduce_from_parallel_forward, scatter_sequence_backward, scatter_sequence_forward,
                                      split_sequence_backward, split_sequence_forward)

__all__ = ["run_ranks", "under_torchrun", "RankError", "Comm", "CommLog", "copy_to_parallel_forward",
           "copy_to_parallel_backward", "reduce_from_parallel_forward", "reduce_from_parallel_backward",
           "gather_sequence_forward", "gather_sequence_backward", "scatter_sequence_forward",
           "scatter_sequence_backward", "split_sequence_forward", "split_sequence_backward", "all_to_all_forward",
           "all_to_all_backward", "exchange_splits", "all_reduce_grads", "all_reduce_max", "loss_and_grads", "run_jobs",
           "ParallelJob", "Layout", "from_previous_stage_forward", "from_previous_stage_backward",
           "to_next_stage_forward", "to_next_stage_backward"]

"""picockpt.parallel.loss_and_grads: the single-process call, split over ranks. Which layout runs which
step, in a few lines (each layout's own step is in its folder):

    ep > 1          expert_parallel/ep_job.py     experts split over ep ranks, every other weight replicated
    pp, dp or M > 1 pipeline_parallel/pp_job.py   dp x pp x tp ranks: stages of layers, micro-batches, replicas
                                                  whose gradients data_parallel/dp_comm.py all-reduces
    otherwise       tensor_parallel/tp_step.py    tp ranks, sequence parallel when sp

Every one of them runs the engine's own loop (picockpt/engine.py: Step) on each rank, over a model whose
parts cross ranks at named points (picockpt/layer.py's Crossings): the loop and the layer are written
once. Full parameters and batch in; the loss, full gradients under the parameters' names and one report
per rank out.
"""
from .expert_parallel.ep_job import ep_loss_and_grads
from .pipeline_parallel.pp_job import PipelineJob, run_pipeline_steps
from .tensor_parallel.tp_step import Job, run_steps


def loss_and_grads(params, cfg, input_ids, targets, policy="full", tp=None, sp=True, distribute_saved=False,
                   device="cpu", timeout_s=120, port=None, start_method="spawn", trace=False, pp=1, microbatches=1,
                   schedule="1f1b", dp=1, recompute_early=False, overlap=True, ep=1, keep_dispatched=False):
    """Mean next-token cross-entropy, the gradient of every parameter (full shapes, params' names) and
    [one report per rank], under `policy` (every policy of picockpt.loss_and_grads; budget:SIZE per rank).
    tp, sp, distribute_saved: tensor parallelism (tp=None: 2 alone, 1 beside pp or dp), sequence parallel,
    each rank keeping 1/t of every checkpoint-only layer input (without sp).
    pp, microbatches, schedule ("afab" | "1f1b"), recompute_early: pipeline stages; dp, overlap: data-
    parallel replicas, all-reducing each layer's gradients as soon as they are final.
    ep, keep_dispatched: expert parallelism, on its own.
    device "cpu" (gloo) or "cuda" (NCCL, one GPU per rank); timeout_s bounds every collective;
    trace=True prints each rank's engine trace lines to stderr, prefixed with the rank."""
    check_flags(tp=tp, pp=pp, microbatches=microbatches, dp=dp, ep=ep, sp=sp, distribute_saved=distribute_saved,
                recompute_early=recompute_early, overlap=overlap, keep_dispatched=keep_dispatched)
    if keep_dispatched is True and ep == 1:
        raise ValueError("keep_dispatched=True with ep=1: it keeps the rows an expert-parallel layer dispatched to "
                         "other ranks; set ep > 1, or leave keep_dispatched out")
    if ep != 1:
        return ep_loss_and_grads(params, cfg, input_ids, targets, policy, ep, keep_dispatched, device, timeout_s, port,
                                 start_method, trace, beside=dict(tp=tp, pp=pp, microbatches=microbatches, dp=dp,
                                                                  distribute_saved=distribute_saved))
    if (pp, microbatches, dp) != (1, 1, 1):
        job = PipelineJob(params, cfg, input_ids, targets, policy, pp, microbatches, schedule, dp,
                          1 if tp is None else tp, sp, distribute_saved, recompute_early, overlap)
        return run_pipeline_steps([job], None, device, timeout_s, port, start_method, trace)[0]
    if recompute_early:
        raise ValueError("recompute_early=True without pp: it recomputes a stage's top segment while the stage "
                         "waits for its gradient; use it with pp >= 2, or leave it out")
    job = Job(params, cfg, input_ids, targets, policy, sp, distribute_saved)
    return run_steps([job], 2 if tp is None else tp, device, timeout_s, port, start_method, trace)[0]


def check_flags(**flags):
    """Counts are numbers, not True (each layout checks its own values), and switches True or False, not
    "no": a ValueError naming the argument, before anything else."""
    for name in ("tp", "pp", "microbatches", "dp", "ep"):
        if isinstance(flags[name], bool):
            raise ValueError(f"{name}={flags[name]!r}: give a whole number of ranks (micro-batches for microbatches), "
                             f"1 or more, not True or False")
    for name in ("sp", "distribute_saved", "recompute_early", "overlap"):  # keep_dispatched: ep_job.py's check
        if not isinstance(flags[name], bool):
            raise ValueError(f"{name}={flags[name]!r}: use True or False")

"""picockpt.parallel.loss_and_grads: the single-process call, split over ranks, for any layout. Each rank (rank.py) runs
the engine's own loop over its stage's micro-batches, on a model whose layers cross ranks where the layout says;
this side checks the job, launches the ranks and puts their results together: the loss, full gradients under the
parameters' names and one report per rank (measurement.py names every key), each measurement beside its closed
form (report_forms.py: the predicted_ twin of every count).

    loss, grads, ranks = parallel.loss_and_grads(params, cfg, ids, targets, "full", Layout(tp=2, sp=True))
    loss, grads, ranks = parallel.loss_and_grads(..., Layout(pp=2, microbatches=4, dp=2))      # 4 ranks
    loss, grads, ranks = parallel.loss_and_grads(..., Layout(ep=2, tp=2, dp=2, zero=3))        # 8 ranks, stacked
    ranks[r]["peak_activation_bytes"] == ranks[r]["predicted_activation_bytes"]        # to the byte
"""
from ..model.params import EMBED, HEAD
from ..model.routing import step_routing
from .expert_parallel.ep_shard import gather_expert_grads
from .report_forms import predicted
from .job import ParallelJob, checked_job, on_cpu
from .layout import Layout
from .launch import check_timeout, ranks_generator, run_ranks, under_torchrun
from .pipeline_parallel.pp_schedules import rank_layers
from .rank import rank_steps, stage_param_names
from .tensor_parallel.tp_shard import gather_grads


def loss_and_grads(params, cfg, input_ids, targets, policy="full", layout=None, device="cpu", timeout_s=120,
                   port=None, start_method="spawn", trace=False, optimizer_step=False):
    """Mean next-token cross-entropy, the gradient of every parameter (full shapes, params' names) and [one report
    per rank], under `policy` (every policy of picockpt.loss_and_grads; budget:SIZE per rank) and `layout` (a
    Layout: layout.py says what each dimension and option does; None: Layout(tp=2)); optimizer_step=True: one AdamW
    step on ZeRO's shards after the backward. device "cpu" (gloo) or "cuda" (NCCL, one GPU per rank); timeout_s
    bounds every collective; trace=True prints each rank's engine trace to stderr."""
    job = ParallelJob(params, cfg, input_ids, targets, policy, Layout(tp=2) if layout is None else layout,
                      steps=int(optimizer_step))
    return run_jobs([job], None, device, timeout_s, port, start_method, trace)[0]


def run_jobs(jobs, world_size=None, device="cpu", timeout_s=120, port=None, start_method="spawn", trace=False):
    """[(loss, grads, reports)] of every ParallelJob, all run by one launch of world_size ranks (each job's
    dp x pp x ep x cp x tp; None: the first job's, or torchrun's WORLD_SIZE); trace as in loss_and_grads."""
    return [(out["loss"], out["grads"], out["reports"])
            for out in run_collected(jobs, world_size, device, timeout_s, port, start_method, trace)]


def run_collected(jobs, world_size=None, device="cpu", timeout_s=120, port=None, start_method="spawn", trace=False,
                  progress=None):
    """run_jobs' launch, each job's results as {"loss", "grads", "reports", "losses" (every step's loss, a float
    each), "params" (after a ZeRO job's optimizer steps, else None), "rng_state" (where it leaves the generator: the
    single process's after the same steps)}; progress(rank, rank_step's payload) as a spawned rank ends each step."""
    if not jobs:
        raise ValueError("jobs=[]: give at least one ParallelJob")
    check_timeout(timeout_s)
    if world_size is None and not under_torchrun():  # under torchrun check_ranks holds each job to its WORLD_SIZE
        world_size = jobs[0].world_size
    jobs = [checked_job(job, device, world_size) for job in jobs]
    generator = ranks_generator(device)
    before = generator.get_state()
    routings = [_routing(job, generator) for job in jobs]  # the single process's, for the closed forms
    generator.set_state(before)  # left as it was, should a rank fail
    sent = [on_cpu(job) for job in jobs]  # what the ranks receive; each moves it to its own device
    results = run_ranks(rank_steps, None if under_torchrun() else world_size, sent, trace, device=device,
                        timeout_s=timeout_s, port=port, start_method=start_method, progress=progress)
    out, state = [], jobs[-1].rng_state
    for job, routing, per_rank in zip(jobs, routings, zip(*results)):  # per_rank: each rank's results of the job
        last = [r for r in per_rank if r["report"]["stage"] == job.layout.pp - 1 and r["report"]["tp_rank"] == 0]
        loss = sum((r["loss"] for r in last[1:]), last[0]["loss"])  # the dp, ep and cp ranks' shares of the mean
        losses = [sum(r["losses"][step] for r in last).item() for step in range(len(last[0]["losses"]))]
        reports = [dict(r["report"], **predicted(job, r["report"], routing)) for r in per_rank]
        start = min(r["timeline_start"] for r in reports)  # the step: the first rank's start to the last one's end
        step = max(r["timeline_start"] + r["timeline_seconds"]["total"] for r in reports) - start
        for r in reports:  # a rank's bubble counts the whole step: a stage done early idles until the others are
            r["step_seconds"], r["bubble"] = step, 1.0 - r["computing_seconds"] / step if step > 0 else 0.0
        state = last[0]["rng_state"] if last[0]["rng_state"] is not None else job.rng_state
        out.append({"loss": loss.to(job.params[EMBED].device), "grads": _gathered(job, per_rank), "reports": reports,
                    "losses": losses, "params": _gathered(job, per_rank, "params"), "rng_state": state})
    generator.set_state(state)  # where a single process's steps would leave it
    return out


def _routing(job, generator):
    """Under ep: every layer's per-expert token counts in the single process's forward of the whole batch,
    by slices of B / (dp M ep) sequences (one per rank and micro-batch), from the job's generator state
    (the same masks and jitter noise as the step); None without experts split over ranks."""
    layout = job.layout
    if layout.ep == 1:
        return None
    generator.set_state(job.rng_state)
    return step_routing(job.params, job.cfg, job.input_ids, ranks=layout.dp * layout.microbatches * layout.ep)


def _gathered(job, per_rank, key="grads"):
    """The full gradients (or key="params": parameters, None when the ranks sent none): each stage's from its dp and
    cp rank 0, tensor- or expert-parallel parts put together, in the dtype and on the device of job.params."""
    if per_rank[0][key] is None:
        return None
    layout, cfg, grads = job.layout, job.cfg, {}
    for stage in range(layout.pp):
        layers = [k for chunk in rank_layers(cfg.layers, layout.pp, stage, layout.virtual_stages) for k in chunk]
        names = stage_param_names(cfg, layers, stage == 0, stage == layout.pp - 1)
        ranks = sorted(((r["report"]["tp_rank"], r["report"]["ep_rank"]), r[key]) for r in per_rank
                       if r["report"]["stage"] == stage and r["report"]["dp_rank"] == r["report"]["cp_rank"] == 0)
        by_ep = [[g for (_, e), g in ranks if e == ep_rank] for ep_rank in range(layout.ep)]  # each in tp rank order
        slices = [gather_grads(parts, dict.fromkeys(names)) if layout.tp > 1 else parts[0] for parts in by_ep]
        whole = gather_expert_grads(slices, dict.fromkeys(names)) if layout.ep > 1 else slices[0]
        if cfg.tie_embeddings and stage == layout.pp - 1:  # one matrix read twice: the sum of both uses' gradients
            whole[EMBED] = whole[HEAD] = whole.get(EMBED, grads.get(EMBED)) + whole[HEAD]  # as the engine adds them
        grads.update(whole)
    home = job.params[EMBED].device
    return {name: grads[name].to(job.params[name].dtype).to(home) for name in job.params if name in grads}

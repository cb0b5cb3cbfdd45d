"""Training with ZeRO on any layout: a new batch every step, every step on the same ranks, in one launch.

    losses, params, reports = zero_train(params, cfg, batches, "full", Layout(dp=2, zero=3), lr=3e-3)
    losses, params, reports = zero_train(params, cfg, batches, "full", Layout(dp=2, zero=3, tp=2, pp=2))   # 8 ranks
    losses[i]     step i's mean loss over its whole batch (the ranks' shares added), a float
    params        the parameters after the last step, whole, under their HF names, on the device and in the
                  dtype of the params given
    reports[r]    rank r's report of the last step (rank.py's, with ZeRO's bytes beside their predicted_ twins)

batches: [(input_ids, targets)], one whole (B, T) batch per step, all of one shape; each rank computes its part of
each, as in one step of the layout, its AdamW (picockpt/measurement/train.py's make_optimizer) stepping only its
shards. train.py's train_step on the same batches, in one process, reaches the same parameters up to rounding
(tests/test_parallel_zero.py says where they are bitwise and why). Every argument and batch is checked before any
rank starts. The ranks start from the caller's generator, and leave it where a single process's training would.

on_step(step, loss, seconds), if given, is called here as soon as every rank has ended step `step` (spawned ranks
only): its loss as in losses, its seconds the slowest rank's.
"""
import math

from ..device import resolve_device
from .job import ParallelJob
from .layout import Layout
from .step import run_collected


def zero_train(params, cfg, batches, policy="none", layout=Layout(dp=2, zero=1), lr=3e-3, weight_decay=0.0,
               rng_state=None, on_step=None, device="cpu", **launch):
    """(losses, params, reports): one AdamW step per batch on the ranks of `layout` (layout.py: a Layout with zero
    1, 2 or 3); launch: run_collected's timeout_s, port and start_method (step.py)."""
    for name, value, positive in (("lr", lr, True), ("weight_decay", weight_decay, False)):
        real = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        if not real or value < 0 or (positive and value == 0):
            raise ValueError(f"{name}={value!r}: AdamW's {name} must be a "
                             + ("positive number, e.g. 3e-3" if positive else "number >= 0, e.g. 0.1"))
    if not isinstance(batches, (list, tuple)) or not batches or not isinstance(batches[0], (list, tuple)) \
            or len(batches[0]) != 2:
        raise ValueError(f"batches={type(batches).__name__}: give a non-empty list of (input_ids, targets), one "
                         f"(batch, seq) pair per step")
    job = ParallelJob(params, cfg, *batches[0], policy, layout, batches=list(batches), lr=float(lr),
                      weight_decay=float(weight_decay), rng_state=rng_state)
    progress = None if on_step is None else steps_as_they_end(job.world_size, on_step)
    out = run_collected([job], None, resolve_device(device).type, progress=progress, **launch)[0]
    return out["losses"], out["params"], out["reports"]


def steps_as_they_end(world_size, on_step):
    """run_collected's progress: each rank's (job, step, loss share, seconds), put together step by step into
    on_step's call (module docstring): the loss summed over the ranks' shares in rank order, as zero_train's."""
    steps = {}  # step -> {rank: (loss share, seconds)} of the ranks that ended it so far
    def progress(rank, payload):
        _, step, share, seconds = payload
        ended = steps.setdefault(step, {})
        ended[rank] = share, seconds
        if len(ended) == world_size:
            del steps[step]
            shares = [share for _, (share, _) in sorted(ended.items()) if share is not None]
            on_step(step, sum(shares).item(), max(seconds for _, seconds in ended.values()))
    return progress

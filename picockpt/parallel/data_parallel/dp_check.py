"""What data parallelism and ZeRO refuse, before any rank starts (job.py's checked_job calls `refuses`)."""
from ..refusals import refuse_tiled_dropout
from .zero_check import check_zero


def refuses(job, policy, device):
    """The data-parallel and ZeRO fields of a picockpt.parallel job (job.py: ParallelJob), with any layout beside;
    the batch split into dp x microbatches equal micro-batches."""
    layout = job.layout
    ranks = layout.dp * layout.ep * layout.cp  # replicas: the group ZeRO shards every weight but the experts' over
    if layout.zero:  # ZeRO's fields: its values over those ranks, or its flags without it
        if not layout.overlap:
            raise ValueError(f"overlap=False with zero={layout.zero}: ZeRO reduces each unit's gradients as soon as "
                             f"they are final, always (plain data parallelism's buckets are what overlap switches); "
                             f"leave overlap out")
        check_zero(layout.zero, ranks, job.cfg, None, layout.keep_gathered, layout.prefetch)  # batch: below
    elif job.steps or job.batches:  # batches: checked_job's non-empty list, or None
        raise ValueError(f"{'batches' if job.batches else f'steps={job.steps}'} without zero: AdamW on the shards is "
                         f"ZeRO's; add zero=1, 2 or 3 (and dp >= 2), or leave it out")
    elif layout.keep_gathered or not layout.prefetch:
        raise ValueError(f"{f'keep_gathered={layout.keep_gathered!r}' if layout.keep_gathered else 'prefetch=False'} "
                         f"without zero: it changes when ZeRO-3 gathers parameters, and there is none here; add zero=3 "
                         f"(and dp >= 2), or leave it out")
    if not layout.overlap and ranks == 1:
        raise ValueError("overlap=False with dp=1, ep=1 and cp=1: it all-reduces the gradients after the backward "
                         "instead of as each is final, and there are no replicas to reduce over; set dp >= 2, or "
                         "leave overlap out")
    B, M, parts = job.input_ids.shape[0], layout.microbatches, layout.dp * layout.microbatches
    if B % parts:
        raise ValueError(f"batch={B} is not divisible into dp x microbatches = {layout.dp} x {M} = {parts} "
                         f"micro-batches of equal size; use a batch that is a multiple of {parts}")
    if parts > 1:  # a micro-batch draws at its own shape what the single process draws at the whole batch's
        refuse_tiled_dropout(job.cfg, f"dp x microbatches = {parts}", "a micro-batch's shape", "are rows of the",
                             "one micro-batch on one replica", part="micro-batch")
        if job.cfg.router_jitter > 0:
            raise ValueError(f"router_jitter={job.cfg.router_jitter} with dp x microbatches = {parts}: the jitter "
                             f"noise is drawn at a micro-batch's shape, not sliced from the whole batch's; use "
                             f"router_jitter=0 or one micro-batch on one replica")

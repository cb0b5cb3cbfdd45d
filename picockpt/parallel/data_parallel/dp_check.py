"""What data parallelism and ZeRO refuse, before any rank starts (job.py's checked_job calls `refuses`; check_zero:
ZeRO's own values, for a job and for picockpt train)."""
from ..refusals import refuse_tiled_dropout
from .zero_forms import STAGES


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


def check_zero(zero, dp, cfg, batch, keep_gathered=False, prefetch=True):
    """zero's own values; dp: the ranks the weights are sharded over (dp x ep x cp); batch: the whole batch, each
    rank's share of it whole sequences (None: the caller's layout checks how the batch splits)."""
    if isinstance(zero, bool) or zero not in STAGES:
        raise ValueError(f"zero={zero!r}: ZeRO's stages are 1 (optimizer state sharded), 2 (and gradients) and "
                         f"3 (and parameters); use one of them, or leave zero out for plain data parallelism")
    if dp == 1:
        raise ValueError(f"zero={zero} with dp=1: ZeRO shards the model state over data-parallel ranks (dp x ep x "
                         f"cp of them), and with one rank there is nothing to shard; use dp >= 2, or leave zero out")
    if not isinstance(prefetch, bool):
        raise ValueError(f"prefetch={prefetch!r}: use True or False")
    if not isinstance(keep_gathered, bool) and keep_gathered != "step":
        raise ValueError(f"keep_gathered={keep_gathered!r}: use True (a recomputed layer's gather kept for its "
                         f"backward), \"step\" (every unit kept from its first use to its last) or False")
    for refused, name in ((keep_gathered, f"keep_gathered={keep_gathered!r}"), (not prefetch, "prefetch=False")):
        if refused and zero != 3:
            raise ValueError(f"{name} with zero={zero}: only stage 3 gathers parameters (stages 1 and 2 hold them "
                             f"whole); use zero=3, or leave {name.split('=')[0]} out")
    if batch is not None and batch % dp:
        raise ValueError(f"batch={batch} is not divisible by dp={dp}: each rank computes batch/dp whole sequences; use "
                         f"a batch that is a multiple of {dp}")
    for refused, what in [(cfg.dtype not in ("float32", "float64"), f"dtype={cfg.dtype!r} (mixed precision)"),
                          (cfg.tie_embeddings, "tie_embeddings=True (one matrix in two units)"),
                          (cfg.router_jitter > 0, f"router_jitter={cfg.router_jitter} (jitter drawn per rank's rows)")]:
        if refused:
            raise ValueError(f"zero={zero} with {what} is not supported yet; what works: zero 1, 2 or 3 over 2 or more "
                             f"ranks (dp x ep x cp), fp32 or fp64, untied embeddings")
    refuse_tiled_dropout(cfg, f"zero={zero}", "the shape of a rank's batch", "equal the", "leave zero out")

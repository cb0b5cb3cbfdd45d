"""What expert parallelism refuses, before any rank starts (job.py's checked_job calls `refuses`)."""
from ..refusals import not_yet, refuse_tiled_dropout


def refuses(job, policy, device):
    """ep's part of job.py's checks (DIMENSIONS), each a ValueError naming the value and what would work; what ep
    does not stack with yet is refused by cp_check.py and pp_check.py. ep is a whole number by now (check_ranks)."""
    layout, cfg, ep, E = job.layout, job.cfg, job.layout.ep, job.cfg.experts
    if ep == 1:
        if layout.keep_dispatched:
            raise ValueError("keep_dispatched=True with ep=1: it keeps the rows an expert-parallel layer dispatched to "
                             "other ranks; set ep > 1, or leave keep_dispatched out")
        return
    if layout.distribute_saved:
        not_yet(f"ep={ep} with distribute_saved=True", "its closed forms split no expert-parallel checkpoint",
                "leave distribute_saved out with ep")
    parts = layout.dp * layout.microbatches  # the batch's micro-batches over every replica
    batch = job.input_ids.shape[0] // parts  # one micro-batch of one replica's sequences: its ep ranks split them
    if not E:
        raise ValueError(f"ep={ep} with Config.experts=0: expert parallelism splits a mixture of experts over the "
                         f"ranks, and this model's MLP is dense; set experts to a multiple of {ep}")
    fits = [n for n in range(1, E + 1) if E % n == 0 and batch % n == 0]
    if E % ep:
        raise ValueError(f"ep={ep} does not divide experts={E}: each rank holds E/ep whole experts; use ep in {fits}")
    if batch % ep:
        per = " (per replica and micro-batch)" if parts > 1 else ""
        raise ValueError(f"batch={batch}{per} is not divisible by ep={ep}: each rank computes batch/ep whole "
                         f"sequences; use a batch that is a multiple of {ep}, or ep in {fits}")
    if policy.budget is not None:
        raise ValueError(f"policy {policy.text!r} with ep={ep}: a budget is planned per rank, but a rank's bytes "
                         f"depend on the tokens routed to its experts, and every rank must recompute the same layers "
                         f"at the same time (their all-to-alls meet); use none, full or every:C, with op-level options")
    refuse_tiled_dropout(cfg, f"ep={ep}", "the shape of a rank's batch", "equal the", "ep=1")

"""What expert parallelism refuses, before any rank starts (job.py's checked_job calls `refuses`)."""
from ...recompute.policy import as_policy
from ..refusals import not_yet, refuse_tiled_dropout


def refuses(job, policy, device):
    """The expert-parallel fields of a picockpt.parallel job (job.py: ParallelJob): ep's own values, its flags
    without it, and what it does not stack with yet (cp: context_parallel/cp_check.py; interleaving and ZB-H1:
    pipeline_parallel/pp_check.py)."""
    layout = job.layout
    if layout.ep == 1:
        if layout.keep_dispatched:
            raise ValueError("keep_dispatched=True with ep=1: it keeps the rows an expert-parallel layer dispatched to "
                             "other ranks; set ep > 1, or leave keep_dispatched out")
        return
    if layout.distribute_saved:
        not_yet(f"ep={layout.ep} with distribute_saved=True", "its closed forms split no expert-parallel checkpoint",
                "leave distribute_saved out with ep")
    parts = layout.dp * layout.microbatches  # the batch's micro-batches over every replica
    check_expert_parallel(job.cfg, layout.ep, job.input_ids.shape[0] // parts, policy, parts > 1)


def check_expert_parallel(cfg, ep, batch, policy, split=False):
    """ValueError naming the parameter, the value and what would work, for every split that cannot be. batch: one
    micro-batch of one replica's sequences (its ep ranks split them); split: dp x microbatches > 1."""
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
        per = " (per replica and micro-batch)" if split else ""
        raise ValueError(f"batch={batch}{per} is not divisible by ep={ep}: each rank computes batch/ep whole "
                         f"sequences; use a batch that is a multiple of {ep}, or ep in {fits}")
    policy = as_policy(policy, cfg)
    if policy.budget is not None:
        raise ValueError(f"policy {policy.text!r} with ep={ep}: a budget is planned per rank, but a rank's bytes "
                         f"depend on the tokens routed to its experts, and every rank must recompute the same layers "
                         f"at the same time (their all-to-alls meet); use none, full or every:C, with op-level options")
    refuse_tiled_dropout(cfg, f"ep={ep}", "the shape of a rank's batch", "equal the", "ep=1")

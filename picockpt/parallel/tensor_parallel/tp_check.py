"""What tensor parallelism refuses, before any rank starts (job.py's checked_job calls `refuses`)."""
from .tp_shard import check_tensor_parallel


def refuses(job, policy, device):
    """The split itself (tp_shard.py: check_tensor_parallel) on a rank's T/cp tokens, a mixture of experts split too;
    what tp does not stack with yet is refused by the other dimension (cp_check.py, ep_check.py)."""
    layout = job.layout
    if layout.tp > 1:
        check_tensor_parallel(job.cfg, layout.tp, layout.sp, job.input_ids.shape[1] // layout.cp,
                              layout.distribute_saved, experts=True)  # T/cp tokens

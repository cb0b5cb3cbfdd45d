"""What ZeRO's own values refuse, before any rank starts (dp_check.py calls it for a job; picockpt train too)."""
from ..refusals import refuse_tiled_dropout
from .zero_forms import STAGES


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

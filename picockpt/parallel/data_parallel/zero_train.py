"""Training with ZeRO: a new batch every step, every step on the same dp ranks, in one launch.

    losses, params, reports = zero_train(params, cfg, batches, "full", dp=2, zero=3, lr=3e-3)
    losses[i]     step i's mean loss over its whole batch (the ranks' shares added), a float
    params        the parameters after the last step, whole, under their HF names (zero_params.whole), on
                  the device and in the dtype of the params given
    reports[r]    rank r's report of the last step (zero_step.py: parameter, gradient, AdamW and activation
                  bytes, gathered peaks and bytes moved per phase, each beside its predicted_ twin), and
                  step_seconds, every step's seconds on that rank

batches: [(input_ids, targets)], one whole (B, T) batch per step, all of one shape; rank r of dp computes
rows r*B/dp .. (r+1)*B/dp - 1 of each (zero_step.py: zero_rank_train), its AdamW (picockpt/train.py's
make_optimizer: lr, weight_decay) stepping only its shards. picockpt/train.py's train_step on the same
batches, in one process, reaches the same parameters up to rounding: tests/test_parallel_zero.py says
where they are bitwise and where not, and why.

Every argument and every batch is checked here, before any rank starts (a ValueError naming it). The ranks
start from the caller's generator (rng_state=None: the default CPU one, or the current CUDA device's), so
their dropout masks are the single process's, and the caller's generator is left where a single process's
training would leave it.
"""
import math
from dataclasses import dataclass

import torch

from ...batch import check_batch
from ...device import resolve_device
from ...params import check_params
from ...policy import parse_policy
from ..launch import check_rank_count, ranks_generator, run_ranks
from .zero_params import whole
from .zero_step import check_zero, zero_rank_train


@dataclass
class ZeroTraining:
    """What every rank is sent: the whole parameters and batches (on the CPU), and how to train on them."""
    params: dict
    cfg: object
    batches: list
    policy: str
    zero: int
    keep_gathered: bool
    prefetch: bool
    lr: float
    weight_decay: float
    rng_state: torch.Tensor


def zero_train(params, cfg, batches, policy="none", dp=2, zero=1, lr=3e-3, weight_decay=0.0, keep_gathered=False,
               prefetch=True, device="cpu", timeout_s=120, port=None, start_method="spawn", rng_state=None):
    """(losses, params, reports): one AdamW step per batch on dp ZeRO ranks (stage `zero`); see above."""
    job = checked_training(params, cfg, batches, policy, dp, zero, lr, weight_decay, keep_gathered, prefetch,
                           device, rng_state)
    where = resolve_device(device)
    per_rank = run_ranks(zero_rank_train, dp, job, device=where.type, timeout_s=timeout_s, port=port,
                         start_method=start_method)
    if rng_state is None:  # where the single process's training leaves the caller's generator
        ranks_generator(where).set_state(per_rank[0]["rng_state"])
    return trained(per_rank, params)


def checked_training(params, cfg, batches, policy, dp, zero, lr=3e-3, weight_decay=0.0, keep_gathered=False,
                     prefetch=True, device="cpu", rng_state=None):
    """The ZeroTraining the ranks are sent, on the CPU; a ValueError naming the argument before any rank starts."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r}: use a whole number of data-parallel ranks, 2 or more")
    check_params(params, cfg)
    if not isinstance(batches, (list, tuple)) or not batches:
        raise ValueError(f"batches={type(batches).__name__}: give a non-empty list of (input_ids, targets), "
                         f"one (batch, seq) pair per step")
    checked = []
    for step, pair in enumerate(batches):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"batches[{step}] is a {type(pair).__name__}: each step's batch is one pair "
                             f"(input_ids, targets)")
        try:
            input_ids, targets = check_batch(cfg, *pair, params)
        except ValueError as error:
            raise ValueError(f"batches[{step}]: {error}") from None
        if checked and input_ids.shape != checked[0][0].shape:
            raise ValueError(f"batches[{step}] is {tuple(input_ids.shape)}, batches[0] {tuple(checked[0][0].shape)}: "
                             f"every step's batch must have one (batch, seq) shape (the ranks plan one schedule and "
                             f"split every batch alike); draw them all at one shape")
        checked.append((input_ids.cpu(), targets.cpu()))
    B, T = checked[0][0].shape
    check_zero(zero, dp, cfg, B, keep_gathered, prefetch)
    for name, value, positive in (("lr", lr, True), ("weight_decay", weight_decay, False)):
        real = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        if not real or value < 0 or (positive and value == 0):
            raise ValueError(f"{name}={value!r}: AdamW's {name} must be a "
                             + ("positive number, e.g. 3e-3" if positive else "number >= 0, e.g. 0.1"))
    parsed = parse_policy(policy, cfg).refuse_offload("ZeRO training")
    parsed.schedule(cfg, B // dp, T)  # an impossible budget:SIZE for a rank's rows is refused here
    where = resolve_device(device)  # "auto", "cpu", "cuda" (the ranks take cuda:0 .. cuda:dp-1)
    check_rank_count("dp", dp, where)  # spawned CUDA ranks take a GPU each; under torchrun, WORLD_SIZE of them
    state = rng_state if rng_state is not None else ranks_generator(where).get_state()
    return ZeroTraining({name: tensor.detach().cpu() for name, tensor in params.items()}, cfg, checked,
                        parsed.text, zero, keep_gathered, prefetch, float(lr), float(weight_decay), state.cpu())


def trained(per_rank, params):
    """(losses, params, reports) from every rank's result: each step's loss the ranks' shares added, the
    parameters put together from the ranks' pieces, on the device and in the dtype of `params`."""
    losses = [sum(result["losses"][step] for result in per_rank).item() for step in range(len(per_rank[0]["losses"]))]
    pieces = whole([result["params"] for result in per_rank], {name: tensor.shape for name, tensor in params.items()})
    final = {name: pieces[name].to(dtype=tensor.dtype, device=tensor.device) for name, tensor in params.items()}
    return losses, final, [result["report"] for result in per_rank]


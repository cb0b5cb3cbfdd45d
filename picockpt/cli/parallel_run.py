"""What the parallel command's layouts share: the device of this process (its own GPU under
torchrun), the step itself beside the single-process reference, and a rank's failure as one line."""
import json
import os

import torch

from ..engine import loss_and_grads as single_loss_and_grads
from ..measure import make_batch
from ..params import init_params
from ..parallel import RankError, loss_and_grads, under_torchrun
from ..policy import parse_policy
from .common import check_parallel_fits, config_from_args, device_from_args, max_relative_diff


def rank_device(args):
    """The device this process computes on: under torchrun on CUDA, its own GPU (LOCAL_RANK), set as the
    current device before anything is made on it; otherwise --device as everywhere."""
    device = device_from_args(args)
    if under_torchrun() and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def prepared(args):
    """(cfg, policy, device) of the command's flags, once the whole step is known to fit there (the command
    also runs it in one process, with policy none, to check the ranks' gradients): a ValueError first."""
    cfg = config_from_args(args)
    policy = parse_policy(args.policy, cfg)
    device = rank_device(args)
    check_parallel_fits(args, cfg, parse_policy("none", cfg), device)
    return cfg, policy, device


def measured_step(args, cfg, policy, device, **layout):
    """The parallel step of `layout` and, in the process that prints (the only one, or torchrun's rank 0),
    the single-process reference: (loss, ranks, single-process loss, max relative gradient difference,
    params, input_ids), or
    None in the other torchrun processes. A rank's failure is one line naming the rank and where."""
    params = init_params(cfg, seed=args.seed, device=device)
    input_ids, targets = make_batch(cfg, args.batch, args.seq, device, args.seed)
    torch.manual_seed(args.seed)  # the dropout masks and the router jitter: the same state for both runs
    try:
        loss, grads, ranks = loss_and_grads(params, cfg, input_ids, targets, policy.text, device=device.type,
                                            timeout_s=args.timeout, port=args.port, trace=args.trace, **layout)
    except RankError as error:
        raise ValueError(f"{error}{last_frame(error)}") from None
    if under_torchrun() and os.environ.get("RANK") != "0":  # every torchrun process ran the step; one prints
        return None
    torch.manual_seed(args.seed)
    single_loss, single_grads = single_loss_and_grads(params, cfg, input_ids, targets, "none")  # every policy's
    worst = max(max_relative_diff(grads[name], single_grads[name]) for name in single_grads)
    return loss, ranks, single_loss, worst, params, input_ids


def printed(args, row, measured, print_table):
    """The command's row, completed by the step's outcome (the loss, the single process's, the gradients'
    largest relative difference, the ranks' reports): one JSON object with --json, else the table."""
    loss, ranks, single_loss, worst, _, _ = measured
    row.update(loss=loss.item(), single_process_loss=single_loss.item(), grad_max_rel_diff_vs_single=worst,
               ranks=ranks)
    if args.json:
        print(json.dumps(row, indent=1))
    else:
        print_table(row)


def last_frame(error):
    """', at FILE:LINE in FUNCTION' of the rank's last frame, from its traceback ('' without one)."""
    lines = [line.strip() for line in (error.remote_traceback or "").splitlines() if line.strip().startswith("File ")]
    return f" (rank's last frame: {lines[-1]})" if lines else ""

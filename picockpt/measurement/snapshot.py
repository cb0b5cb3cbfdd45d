"""A CUDA memory snapshot of one training step, for PyTorch's memory viewer.

    python -m picockpt measure --policy full --device cuda --memory-snapshot full.pickle
    # then open https://pytorch.org/memory_viz and drop full.pickle on the page

The file is what torch.cuda.memory._dump_snapshot writes: every allocation and free the CUDA caching allocator made
during the step, each with the Python stack that asked for it. Its "Active Memory Timeline" shows the stored activations
pile up during the forward and drain during the backward; under full or every:C the backward is a row of saw-teeth, one
per recomputed segment; under selective the tall T x T blocks come and go one layer at a time.

One unrecorded warm-up step runs first, so AdamW's moments and cuBLAS's workspace already
exist and what the file shows is the step itself, as it is in the middle of training.
The allocator only exists on CUDA: on any other device this is a ValueError.
"""
import pathlib

import torch

from .measure import make_batch
from ..model.params import init_params
from ..recompute.policy import as_policy
from .train import make_optimizer, train_step

VIEWER = "https://pytorch.org/memory_viz"


def record_snapshot(path, cfg, policy, batch, seq, device, seed=0, max_entries=1_000_000, log=print):
    """Train one warm-up step, then record one step's allocator history into `path` (a pickle)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"--memory-snapshot={str(path)!r}: a memory snapshot records the CUDA caching allocator, "
                         f"and this run is on {device}; run it on a CUDA GPU (--device cuda) or leave out "
                         f"--memory-snapshot")
    folder = pathlib.Path(path).resolve().parent
    if not folder.is_dir():
        raise ValueError(f"--memory-snapshot={str(path)!r}: the folder {folder} does not exist; "
                         f"create it or write the snapshot somewhere that exists")
    policy = as_policy(policy, cfg)
    cfg.check_seq(seq)
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)  # (B, T) each
    optimizer = make_optimizer(params)
    torch.manual_seed(seed)
    train_step(params, optimizer, cfg, input_ids, targets, policy)  # warm-up: optimizer state, cuBLAS workspace
    torch.cuda.synchronize(device)
    # python stacks only: C++ stacks would make recording many times slower
    torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=max_entries, device=device)
    try:
        train_step(params, optimizer, cfg, input_ids, targets, policy)  # the recorded step
        torch.cuda.synchronize(device)
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)  # stop, free the history
    if log:
        log(f"memory snapshot of one {policy.text} step written to {path}: open it at {VIEWER}")
    return path

"""The door of every step: the token ids and targets checked once, before any work.

    input_ids, targets = check_batch(cfg, input_ids, targets, params)

Every entry (picockpt/recompute/engine.py's loss_and_grads, and each parallel job) calls it first. It
returns the two as contiguous int64 tensors, so no op later has to ask for a layout; and it
reads the device once for the value checks (one host sync, not one per number).
"""
import torch

from ..ops.attention_fused import check_fused
from ..ops.cross_entropy import IGNORE_INDEX
from .params import EMBED

AUTOCAST_DEVICES = ("cpu", "cuda")


def check_batch(cfg, input_ids, targets, params):
    """Token ids and targets: (batch, seq) integer tensors on the parameters' device, ids in [0, vocab),
    targets in [0, vocab) or IGNORE_INDEX, at least one target counted; no torch.autocast around the
    step. Returns them as contiguous int64 tensors."""
    check_no_autocast(cfg)
    for name, tensor in (("input_ids", input_ids), ("targets", targets)):
        if not isinstance(tensor, torch.Tensor):
            dtype = getattr(tensor, "dtype", None)
            raise ValueError(f"{name} must be a torch integer tensor of token ids, got {type(tensor).__module__}."
                             f"{type(tensor).__name__}" + (f" of {dtype}" if dtype is not None else "")
                             + f": convert it with torch.as_tensor({name})")
        if tensor.dtype.is_floating_point or tensor.dtype == torch.bool or tensor.is_complex():
            raise ValueError(f"{name} must be an integer tensor of token ids, got {tensor.dtype}")
    if input_ids.dim() != 2 or input_ids.shape != targets.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and targets {tuple(targets.shape)} must both "
                         f"be (batch, seq) integer tensors of the same shape")
    if input_ids.shape[0] < 1:
        raise ValueError(f"input_ids has batch {input_ids.shape[0]}: a step needs at least one sequence")
    cfg.check_seq(input_ids.shape[1])
    device = params[EMBED].device
    if device.type == "meta":
        raise ValueError("the parameters are on the meta device (shapes only, no values): a step needs real "
                         "weights; make them with init_params(cfg, device='cpu') (or 'cuda'), or load a "
                         "state_dict that holds values")
    if input_ids.device != device or targets.device != device:
        raise ValueError(f"input_ids are on {input_ids.device} and targets on {targets.device}, the parameters on "
                         f"{device}: move them with .to({str(device)!r})")
    if cfg.attention == "fused":
        check_fused(device, cfg.torch_dtype, cfg.head_dim)
    input_ids, targets = input_ids.long().contiguous(), targets.long().contiguous()  # (B, T) each, row-major
    counted = targets != IGNORE_INDEX  # (B, T) bool
    stats = torch.stack([input_ids.min(), input_ids.max(), counted.sum(),  # five numbers, read in one sync
                         torch.where(counted, targets, torch.iinfo(torch.int64).max).min(),
                         torch.where(counted, targets, torch.iinfo(torch.int64).min).max()])
    low, high, count, target_low, target_high = stats.tolist()
    if low < 0 or high >= cfg.vocab:
        raise ValueError(f"input_ids hold token ids from {low} to {high}: they must lie in [0, vocab) = "
                         f"[0, {cfg.vocab})")
    if count == 0:
        raise ValueError(f"every target is {IGNORE_INDEX} (ignored): the mean loss would be 0/0; "
                         f"leave at least one target in [0, {cfg.vocab})")
    if target_low < 0 or target_high >= cfg.vocab:
        raise ValueError(f"targets hold token ids from {target_low} to {target_high}: they must lie in [0, vocab) = "
                         f"[0, {cfg.vocab}), or be {IGNORE_INDEX} to leave a position out of the loss")
    return input_ids, targets


def check_no_autocast(cfg):
    """torch.autocast would recompute the step's matmuls in its own dtype while every report says
    Config.dtype: refused, with the way to ask for 16-bit compute instead."""
    for device_type in AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device_type):
            dtype = str(torch.get_autocast_dtype(device_type)).replace("torch.", "")
            raise ValueError(f"torch.autocast({device_type!r}, dtype={dtype}) is on around the step: picockpt computes "
                             f"in Config.dtype={cfg.dtype!r} and its byte and FLOP figures assume it; leave the "
                             f"autocast block and set Config(dtype={dtype!r}) for {dtype} compute with fp32 master "
                             f"weights")

"""Choosing the device: 'auto' picks CUDA when there is one, the CPU otherwise."""
import torch


def resolve_device(name="auto"):
    name = str(name).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device={name!r}: CUDA was asked for, but torch.cuda.is_available() is False "
                             f"(torch {torch.__version__}). Use --device cpu, or --device auto to take CUDA "
                             f"only where there is one.")
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device={name!r}: only {torch.cuda.device_count()} CUDA device(s) here; "
                             f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        return device
    raise ValueError(f"device={name!r}: use auto, cpu, cuda or cuda:N")


def check_fits(cfg, device, batch=1, seq=1):
    """Refuse, with the numbers, a model whose weights alone would not fit the device."""
    need = cfg.num_params() * (4 + 4 + 8)  # fp32 weights, gradients and AdamW's two moments
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
        where = f"free memory on {device}"
    else:
        import os
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        where = "available RAM"
    if need > have:
        raise ValueError(f"this Config has {cfg.num_params():,} parameters: weights, gradients and AdamW "
                         f"state need {need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB of {where}. "
                         f"Use a smaller preset or shape flags (the Llama 3 presets are for `predict`).")

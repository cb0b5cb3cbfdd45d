"""Choosing the device: 'auto' picks CUDA when there is one, the CPU otherwise; and how much memory
is free there (picockpt/planning/fit.py decides whether a step fits in it).

    device = resolve_device("auto")
    have, where = available_bytes(device)      # bytes, "free memory on cuda:0 (...)" / "available RAM"
"""
import os

import torch

# The oldest torch picockpt runs on: the one GPU images ship (2.11, its CUDA path measured on an H200) and CI's
# 2.13 (tests/torch_211.py simulates on 2.13 what 2.11 lacks or does differently). pyproject.toml and
# requirements.txt declare the same floor.
TORCH_FLOOR = (2, 11)


def torch_version(version=None):
    """(major, minor) of a torch.__version__ string (None: this torch's), e.g. (2, 11) for "2.11.0+cu130"."""
    return tuple(int(part) for part in (version or torch.__version__).split("+")[0].split(".")[:2])


def check_torch(version=None):
    """A clear error on a torch older than TORCH_FLOOR (version: a torch.__version__ string; None: this one)."""
    version = version or torch.__version__
    if torch_version(version) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ValueError(f"torch {version} is older than {floor}, the oldest picockpt runs on: "
                         f"pip install 'torch>={floor}'")


def exit_if_torch_too_old():
    """A script's first check, before an import that a torch under the floor lacks fails with a traceback:
    check_torch's error as one line on stderr, exit code 1."""
    try:
        check_torch()
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


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


def available_bytes(device):
    """(bytes free for this process, where they are): on CUDA the device's free memory (the driver's) plus the
    blocks this process's caching allocator holds but has not handed out (memory_reserved - memory_allocated:
    the driver counts them as used, the next tensors take them first); else the RAM that the kernel says
    can be taken without swapping (MemAvailable)."""
    device = torch.device(device)
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # reserved, not in use
        return torch.cuda.mem_get_info(device)[0] + cached, f"free memory on {device} (with the allocator's cache)"
    try:
        with open("/proc/meminfo") as file:
            fields = dict(line.split(":", 1) for line in file)
        return int(fields["MemAvailable"].split()[0]) * 1024, "available RAM"
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "available RAM"

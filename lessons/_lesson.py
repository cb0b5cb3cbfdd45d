"""What the numbered lesson scripts share: their flags, the shape each run mode uses, and
interleaved timing. Imported as `from lessons._lesson import ...` (each script first puts the
repository root on sys.path, so this works from `python lessons/NN_name.py` and from
`python -m picockpt reproduce`, which imports the scripts by file path).

Every lesson takes the same flags:

    (nothing)        the CPU run: the `small` preset or a shape of the same cost, under a minute
    --fast           a few seconds: the shape the tests run
    --large          a bigger shape for a GPU (use with --device cuda)
    --device auto    auto | cpu | cuda | cuda:N (auto takes CUDA when there is one)
    --seed 0         weights, data and dropout masks
    --threads 1      CPU threads for torch (default 1 on the CPU). The CPU shapes are small, so
                     more threads gain little, and on a busy machine torch's worker threads wait
                     on each other whenever another program holds a core: a step can take 10x
                     longer. --threads N asks for N.
"""
import argparse
import statistics
import time

import torch

from picockpt.config import Config
from picockpt.device import resolve_device

# the --large shape: a 1B-parameter-class Llama layer stack (h=2048, GQA 16/4, SwiGLU 5632), fp32
LARGE = dict(vocab=32000, hidden=2048, layers=16, heads=16, kv_heads=4, ffn=5632, max_seq=4096)


def parse_args(doc, argv=None):
    """The lesson flags. args.mode is "fast", "cpu" or "large"; args.device a torch.device."""
    title, _, usage = doc.partition("\n")
    parser = argparse.ArgumentParser(description=title, epilog=usage,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--fast", action="store_true", help="a small shape that runs in seconds (what the tests run)")
    size.add_argument("--large", action="store_true", help="a bigger shape, meant for a GPU")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights, data and dropout (default 0)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1)")
    args = parser.parse_args(argv)
    try:
        args.device = resolve_device(args.device)
    except ValueError as error:  # e.g. --device cuda on a machine without one: one line, no traceback
        parser.error(str(error))
    if args.threads < 1:
        parser.error(f"--threads={args.threads}: use 1 or more")
    if args.device.type == "cpu":
        torch.set_num_threads(args.threads)
    args.mode = "large" if args.large else "fast" if args.fast else "cpu"
    return args


def choose(mode, fast, cpu, large):
    """The value for this run mode ("fast", "cpu" or "large"): choose(args.mode, fast=.., cpu=.., large=..)."""
    return {"fast": fast, "cpu": cpu, "large": large}[mode]


def small(**overrides):
    """The `small` preset (L=8, h=128, H=4, KV=2, f=448, V=256) with some fields changed."""
    return Config.from_preset("small", **overrides)


def large(**overrides):
    return Config(**{**LARGE, **overrides})


def device_name(device):
    """'cpu (2 threads)' or 'cuda:0 (NVIDIA H100 ...)': what a timing was measured on."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads > 1 else ''})"


def shape_line(cfg, batch, seq, device):
    return (f"L={cfg.layers} h={cfg.hidden} H={cfg.heads} KV={cfg.kv_heads} f={cfg.ffn} V={cfg.vocab} "
            f"{cfg.dtype}, batch {batch} x {seq} tokens, on {device_name(device)}")


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_seconds(steps, device, repeats):
    """Median wall seconds of each step in {name: step()}, after one warm-up call of each.
    Each repeat runs every step once, in turn, so a slow moment of a shared machine
    slows them all alike and the ratios between them stay fair."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}

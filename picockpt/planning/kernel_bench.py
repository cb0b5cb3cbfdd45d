"""Measure a KernelRates on the machine at hand: matmuls of the shapes a layout search prices, and the attention
kernel torch's sdpa picks, forward and backward, over sequence lengths (lessons/kernel_rates.py runs it).

    rates = measure_kernel_rates("cuda", gemms=[(8192, 2304, 16384)], seqs=(1024, 4096), peak=989e12)

Each kernel is timed alone, on random tensors (CUDA events on a GPU, a timer on the CPU: op_times.time_once),
after one warm-up call; its rate is its FLOPs over the median of `repeats` calls. Attention runs causal at
`heads` heads of `head_dim`, batch x seq = `tokens` (the published benchmarks' setting), its FLOPs counted as the
model counts them (a causal forward 2 x 2 x T^2 / 2 x heads x head_dim, a backward twice that).
"""
import datetime

import torch

from .kernel_rates import KernelRates, SEQ_POINTS
from .op_times import time_once


def _median_seconds(call, device, repeats):
    call()  # warm-up: kernel selection, workspaces
    return sorted(time_once(call, device) for _ in range(repeats))[repeats // 2]


def gemm_rows(gemms, device, dtype, repeats, progress=None):
    """((m, n, k, FLOP/s), ...): each (m x k) @ (k x n) product timed."""
    out = []
    for i, (m, n, k) in enumerate(gemms, 1):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out.append((m, n, k, 2 * m * n * k / _median_seconds(lambda: a @ b, device, repeats)))
        if progress and (i % 25 == 0 or i == len(gemms)):
            progress(f"timed {i}/{len(gemms)} matmul shapes")
    return tuple(out)


def attention_rows(seqs, device, dtype, repeats, heads=16, head_dim=128, tokens=16384):
    """((seq, forward FLOP/s, backward FLOP/s), ...): sdpa causal, forward alone and its backward alone."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = []
    for seq in seqs:
        batch = max(1, tokens // seq)
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        flops = 4 * batch * heads * seq * seq * head_dim // 2  # q k^T and P v, the causal half
        forward = _median_seconds(lambda: sdpa(q, k, v, is_causal=True), device, repeats)
        out_ = sdpa(q, k, v, is_causal=True)
        grad = torch.randn_like(out_)
        backward = _median_seconds(lambda: torch.autograd.grad(out_, (q, k, v), grad, retain_graph=True), device,
                                   repeats)
        out.append((seq, flops / forward, 2 * flops / backward))
    return tuple(out)


def measure_kernel_rates(device, gemms, seqs=SEQ_POINTS, dtype=torch.bfloat16, peak=None, repeats=5,
                         progress=None, tokens=16384):
    """A KernelRates measured now: gemm_efficiency is the fastest measured matmul over `peak` (the datasheet's
    FLOP/s; None: the fastest itself, efficiency 1)."""
    device = torch.device(device)
    rows = gemm_rows(gemms, device, dtype, repeats, progress)
    attention = attention_rows(seqs, device, dtype, repeats, tokens=tokens)
    best = max(rate for *_, rate in rows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    source = (f"measured on {name} with torch {torch.__version__} ({str(dtype).replace('torch.', '')}), "
              f"{datetime.date.today().isoformat()}: {len(rows)} matmul shapes, sdpa causal attention at "
              f"{len(attention)} lengths; median of {repeats}")
    return KernelRates(name, best / (peak or best), sms, attention, source, rows)

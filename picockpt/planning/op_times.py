"""A measured profile: each op of one layer's forward (and the head's), timed on this device, alone.

The ops are picockpt/model/layer.py's own functions on tensors of the step's shapes, named as
picockpt/planning/cost.py's layer_ops() names them, so a profile can stand where the roofline's seconds do
(cost.price_chain). On a GPU each call is timed by CUDA events, on the CPU by a timer. Rounds are interleaved: each
round times every op once, so a machine that slows down for a while slows every op alike; an op's time is its median
over the rounds, with the fastest and slowest beside it.

    profile = measure_op_seconds(cfg, batch=4, seq=256, repeats=7)
    profile.seconds["swiglu"], profile.spread["swiglu"]      # median, (min, max)
"""
import time
from dataclasses import dataclass

import torch

from ..model.attention import attention_core_forward
from .cost import check_dense
from ..measurement.measure import sync
from ..ops import linear_forward, rmsnorm_forward, rope_forward, swiglu_forward
from ..ops.attention import attention_probs
from ..ops.cross_entropy import cross_entropy_forward
from ..ops.rope import rope_tables


@dataclass(frozen=True)
class Profile:
    seconds: dict  # op name -> median seconds of one call
    spread: dict  # op name -> (fastest, slowest) seconds
    device: str
    repeats: int


def layer_op_calls(cfg, batch, seq, device):
    """{op name: a call that runs it once} on random tensors of one layer's shapes (and the head's)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dt, stat, B, T, h, f, hd = cfg.torch_dtype, cfg.stat_dtype, batch, seq, cfg.hidden, cfg.ffn, cfg.head_dim
    H, KV, V = cfg.heads, cfg.kv_heads, cfg.vocab

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dt)

    x, w_norm = rand(B, T, h), torch.ones(h, device=device, dtype=dt)
    wq, wk, wv, wo = rand(H * hd, h), rand(KV * hd, h), rand(KV * hd, h), rand(h, H * hd)
    w_gate, w_up, w_down, w_head = rand(f, h), rand(f, h), rand(h, f), rand(V, h)
    cos, sin = rope_tables(cfg, T, device, dt)
    q, k, v = rand(B, H, T, hd), rand(B, KV, T, hd), rand(B, KV, T, hd)
    q_rows, k_rows, context = rand(B, T, H, hd), rand(B, T, KV, hd), rand(B, T, H * hd)
    gate, up, act, logits = rand(B, T, f), rand(B, T, f), rand(B, T, f), rand(B * T, V)
    targets = torch.randint(0, V, (B * T,), generator=g).to(device)
    keep = lambda name, tensor: None  # noqa: E731 (nothing is stored: only the time counts)
    calls = {"attn_norm": lambda: rmsnorm_forward(x, w_norm, cfg.norm_eps, stat),
             "qkv": lambda: (linear_forward(x, wq), linear_forward(x, wk), linear_forward(x, wv)),
             "rope": lambda: (rope_forward(q_rows, cos, sin), rope_forward(k_rows, cos, sin)),
             "attention": lambda: attention_core_forward(q, k, v, cfg, keep),
             "o_proj": lambda: linear_forward(context, wo),
             "attn_residual": lambda: x + x,
             "mlp_norm": lambda: rmsnorm_forward(x, w_norm, cfg.norm_eps, stat),
             "gate_up": lambda: (linear_forward(x, w_gate), linear_forward(x, w_up)),
             "swiglu": lambda: swiglu_forward(gate, up),
             "down": lambda: linear_forward(act, w_down),
             "mlp_residual": lambda: x + x,
             "final_norm": lambda: rmsnorm_forward(x, w_norm, cfg.norm_eps, stat),
             "logits": lambda: linear_forward(x, w_head),
             "loss": lambda: cross_entropy_forward(logits, targets, stat)}
    if cfg.attention == "eager":
        calls["probs"] = lambda: attention_probs(q, k, stat)  # what rebuilding the probabilities runs
    return calls


def measure_op_seconds(cfg, batch, seq, device="cpu", repeats=7, progress=None):
    """A Profile of every op of layer_op_calls(): one warm-up round, then `repeats` interleaved rounds."""
    check_dense(cfg, "the measured profile")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: use a whole number of timing rounds, 1 or more (e.g. 7)")
    calls = layer_op_calls(cfg, batch, seq, device)
    times = {name: [] for name in calls}
    with torch.no_grad():
        for round_ in range(repeats + 1):
            for name, call in calls.items():
                seconds = time_once(call, device)
                if round_:  # round 0 warms up (allocations, kernel selection)
                    times[name].append(seconds)
            if progress and round_:
                progress(f"timed every op {round_}/{repeats} times")
    median = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    return Profile(median, {name: (min(ts), max(ts)) for name, ts in times.items()}, str(device), repeats)


def time_once(call, device):
    """Seconds of one call: CUDA events around it on a GPU (the kernels' time, not the launch's), else a timer."""
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
    sync(device)
    start = time.perf_counter()
    call()
    return time.perf_counter() - start

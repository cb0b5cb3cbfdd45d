"""Training: a synthetic task made in code, the optimizer step, and a small loop.

The task: token streams from a fixed random Markov chain in which every token has `branching` possible successors, all
equally likely. A model that learns the table reaches the entropy floor ln(branching); an untrained one starts near
ln(vocab). No downloads, the same batches for the same seed on every machine.
"""
import contextlib
from dataclasses import dataclass
import math
import statistics
import time

import torch

from ..device import resolve_device
from ..recompute.engine import loss_and_grads
from ..planning.step_forms import step_flops
from .tracker import PHASES, Tracker


class MarkovTask:
    def __init__(self, vocab, branching=4, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.vocab, self.branching = vocab, branching
        self.successors = torch.randint(0, vocab, (vocab, branching), generator=generator)  # (V, branching)
        self.generator = torch.Generator().manual_seed(seed + 1)

    @property
    def loss_floor(self):  # the entropy of the next token (duplicates among successors lower it slightly)
        return math.log(self.branching)

    def batch(self, batch, seq, device="cpu"):
        """input_ids (B, T) and targets (B, T): targets[b, t] = input_ids[b, t + 1] of one stream."""
        g = self.generator
        stream = torch.empty(batch, seq + 1, dtype=torch.long)  # (B, T+1)
        stream[:, 0] = torch.randint(0, self.vocab, (batch,), generator=g)
        choice = torch.randint(0, self.branching, (batch, seq), generator=g)  # (B, T)
        for t in range(seq):
            stream[:, t + 1] = self.successors[stream[:, t], choice[:, t]]
        return stream[:, :-1].to(device), stream[:, 1:].to(device)


def make_optimizer(params, lr=3e-3, weight_decay=0.0):
    """AdamW on the parameter tensors themselves; the engine's gradients are handed over
    as .grad before each step. foreach=False keeps the optimizer's working memory to one
    parameter's size, so it does not hide the activation peaks being studied."""
    unique = list({id(p): p for p in params.values()}.values())  # tied weights appear twice
    return torch.optim.AdamW(unique, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), foreach=False)


def train_step(params, optimizer, cfg, input_ids, targets, policy="none", tracker=None):
    """forward -> loss -> hand-written backward -> AdamW. Returns the loss (a float)."""
    loss, grads = loss_and_grads(params, cfg, input_ids, targets, policy, tracker=tracker)
    with tracker.phase("optimizer") if tracker is not None else contextlib.nullcontext():
        for name, param in params.items():
            param.grad = grads[name]
        optimizer.step()
        if tracker is not None:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        tracker.mark(value, "optimizer")
        for param in params.values():
            param.grad = None
    return loss.item()


@dataclass
class Monitor:
    """What train() reports, none of which changes the losses: `log` (print, or None for silence) every `every`
    steps and the last; `watch_live`, on the CPU, the live peak (every tensor watched, slow); `peak_tflops`, the
    device's dense peak (TFLOP/s) for MFU and HFU; `record`, a list receiving one dict per step."""
    log: object = print
    every: int = 1
    watch_live: bool = False
    peak_tflops: float = None
    record: list = None

    def __post_init__(self):
        every, peak_tflops = self.every, self.peak_tflops
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r}: log every N steps with N a whole number >= 1 (1 logs every step)")
        if peak_tflops is not None and (isinstance(peak_tflops, bool) or not isinstance(peak_tflops, (int, float))
                                        or not math.isfinite(peak_tflops) or peak_tflops <= 0):
            raise ValueError(f"peak_tflops={peak_tflops!r}: the device's dense peak in TFLOP/s, a positive number "
                             f"(989.5 for an H100/H200 SXM in bf16), or None for no MFU/HFU")
        if self.record is not None and not isinstance(self.record, list):
            raise ValueError(f"record={type(self.record).__name__}: pass a list (it receives one dict per step) "
                             f"or None")


def train(params, cfg, task, steps, batch, seq, policy="none", lr=3e-3, device="cpu", seed=None, optimizer=None,
          monitor=None):
    """Runs `steps` steps and returns their losses. Logs (monitor: a Monitor, None for Monitor()), per step and in a
    final summary, what the recomputation costs and saves: loss, tokens/s, the stored peak (the activation store), the
    live peak (CUDA: the allocator's max_memory_allocated above the step's start; CPU: only with watch_live), the share
    of the step's FLOPs that is recomputation (the closed form inventory.step_flops, what FlopCounterMode counts), the
    share of its time spent in the recompute phase, and, given peak_tflops, MFU and HFU as PaLM defines them (Chowdhery
    et al. 2022, appendix B): model FLOPs per second over the peak, where model FLOPs are the step's without
    recomputation (policy none), and hardware FLOPs per second over the peak, recomputation included. The summary adds
    the peaks per phase (forward, recompute, backward, optimizer). The record's dicts hold loss, seconds, the rates and
    shares above, and per phase its seconds and stored and live peaks (the curves lesson 22 reads). With a seed, the
    dropout masks are drawn from it: the same seed gives the same losses, bitwise. `optimizer`
    (make_optimizer(params, lr), or None for a new one) carries AdamW's state from an earlier call on: one run whose
    policy changes between calls is still one run (lr is then the optimizer's)."""
    monitor = Monitor() if monitor is None else monitor
    log, every, watch_live, peak_tflops, record = (monitor.log, monitor.every, monitor.watch_live,
                                                   monitor.peak_tflops, monitor.record)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer={type(optimizer).__name__}: pass a torch.optim.Optimizer over these params "
                         f"(make_optimizer(params)) or None for a new AdamW")
    device = resolve_device(device)  # "gpu" or a missing CUDA: a ValueError naming device=
    optimizer = make_optimizer(params, lr) if optimizer is None else optimizer  # carried on: its state kept
    if seed is not None:
        torch.manual_seed(seed)  # torch's default generators (CPU and every GPU), which draw the dropout masks
    flops = step_flops(cfg, batch, seq, policy)  # forward, recompute, backward of one step
    executed, model = sum(flops.values()), sum(step_flops(cfg, batch, seq, "none").values())
    peak = peak_tflops * 1e12 if peak_tflops else None
    losses, rows, phase_rows = [], [], []
    for step in range(steps):
        input_ids, targets = task.batch(batch, seq, device)
        start = time.perf_counter()
        with Tracker(device, physical=watch_live, flops=False, times=True) as tracker:
            loss = train_step(params, optimizer, cfg, input_ids, targets, policy, tracker)
        seconds = time.perf_counter() - start
        losses.append(loss)
        live = tracker.peak_cuda if tracker.cuda else tracker.peak_physical if watch_live else None
        view = "cuda" if tracker.cuda else "physical" if watch_live else None
        phases = {name: {"seconds": tracker.seconds[name], "stored": tracker.peaks.get(name, {}).get("logical", 0),
                         "live": tracker.peaks.get(name, {}).get(view, 0) if view else None} for name in PHASES}
        phase_rows.append(phases)
        rows.append(dict(tokens_per_second=batch * seq / seconds, stored=tracker.peak_logical, live=live,
                         recompute_time=tracker.seconds["recompute"] / seconds,
                         mfu=model / seconds / peak if peak else None, hfu=executed / seconds / peak if peak else None))
        if record is not None:
            record.append(dict(step=step, loss=loss, seconds=seconds, **rows[-1], model_flops=model,
                               hardware_flops=executed, recompute_flops=flops["recompute"],
                               recompute_flops_share=flops["recompute"] / executed, phases=phases))
        if log and (step % every == 0 or step == steps - 1):
            log(f"step {step:4d}  loss {loss:7.4f}  " + _line(rows[-1], flops))
    if log and steps > 1:  # the first step warms up (allocations, AdamW's state): the summary leaves it out
        middle = {key: statistics.median(row[key] for row in rows[1:]) if rows[1][key] is not None else None
                  for key in rows[1]}
        middle.update(stored=max(row["stored"] for row in rows), live=rows[-1]["live"] and max(
            row["live"] for row in rows[1:]))
        log(f"summary over steps 1..{steps - 1} (medians; peaks: largest): " + _line(middle, flops))
        state = sum(value.nbytes for values in optimizer.state.values() for value in values.values()
                    if isinstance(value, torch.Tensor))
        log(f"optimizer state (AdamW: two fp32 moments a parameter, a step count a tensor; made by step 0, kept): "
            f"{state / 2**20:.3f} MiB")
        log(f"per phase, largest over steps 1..{steps - 1}: " + "; ".join(
            f"{name} stored {max(p[name]['stored'] for p in phase_rows[1:]) / 2**20:.3f} MiB"
            + ("" if view is None else f", live {max(p[name]['live'] for p in phase_rows[1:]) / 2**20:.3f} MiB")
            for name in PHASES))
    return losses


def _line(row, flops):
    """tokens/s, peaks, recompute shares and utilisation of one step (or of the summary)."""
    share = flops["recompute"] / sum(flops.values())
    text = (f"{row['tokens_per_second']:10,.0f} tokens/s  stored {row['stored'] / 2**20:8.3f} MiB  live "
            + ("-" if row["live"] is None else f"{row['live'] / 2**20:8.3f} MiB")
            + f"  recompute {share:5.1%} of FLOPs, {row['recompute_time']:5.1%} of time")
    if row["mfu"] is not None:  # PaLM's convention: model FLOPs leave recomputation out, hardware FLOPs count it
        text += f"  MFU {row['mfu']:5.1%}  HFU {row['hfu']:5.1%}"
        if row["hfu"] > 1:  # more FLOPs a second than the peak allows: the peak given is not this device's
            text += "  (above 100%: the peak given, --peak-tflops, is below what this device just did; give its " \
                    "dense datasheet peak)"
    return text

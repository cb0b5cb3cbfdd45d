"""Training: a synthetic task made in code, the optimizer step, and a small loop.

The task: token streams from a fixed random Markov chain in which every token has
`branching` possible successors, all equally likely. A model that learns the table
reaches the entropy floor ln(branching); an untrained one starts near ln(vocab).
No downloads, the same batches for the same seed on every machine.
"""
import contextlib
import math
import time

import torch

from .engine import loss_and_grads
from .tracker import Tracker


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
    phase = tracker.phase("optimizer") if tracker is not None else contextlib.nullcontext()
    with phase:
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


def train(params, cfg, task, steps, batch, seq, policy="none", lr=3e-3, device="cpu", log=print, every=1, seed=None):
    """Runs `steps` steps; logs loss, tokens/s and the peak of stored activation bytes.
    With a seed, the dropout masks are drawn from it: the same seed gives the same losses, bitwise."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every={every!r}: log every N steps with N a whole number >= 1 (1 logs every step)")
    optimizer = make_optimizer(params, lr)
    if seed is not None:
        torch.manual_seed(seed)  # torch's default generators (CPU and every GPU), which draw the dropout masks
    losses = []
    for step in range(steps):
        input_ids, targets = task.batch(batch, seq, device)
        start = time.perf_counter()
        with Tracker(device, physical=False, flops=False) as tracker:  # only counts store events
            loss = train_step(params, optimizer, cfg, input_ids, targets, policy, tracker)
        seconds = time.perf_counter() - start
        losses.append(loss)
        if log and (step % every == 0 or step == steps - 1):
            log(f"step {step:4d}  loss {loss:7.4f}  {batch * seq / seconds:10,.0f} tokens/s  "
                f"stored activations {tracker.peak_logical / 2**20:9.3f} MiB")
    return losses


"""Before a step runs: whether it fits the device, as an estimate that errs high, with the numbers and
what to change when it does not.

    check_fits(cfg, device, batch=8, seq=2048, policy="none")   # ValueError with the numbers if not
    step_bytes(cfg, batch, seq, policy)    # {"state", "stored", "working", "largest"}
"""
import torch

from ..device import available_bytes
from .step_forms import predicted_peak_bytes
from ..model.params import copy_bytes
from ..recompute.policy import as_policy

WORKING_COPIES = 4  # working memory: this many fp32 copies of a step's largest intermediate tensor


def step_bytes(cfg, batch, seq, policy, optimizer=True):
    """The predicted peak of one training step, by part, in bytes (an estimate that errs high):

    state       fp32 weights, their gradients and AdamW's two moments (16 bytes per parameter; 8 with
                optimizer=False: a forward and backward alone, no optimizer state),
                plus the 16-bit compute copies when the activations are 16-bit: every weight's, or under
                the policy's recast the embedding's, final norm's and head's and one layer's (copy_bytes)
    stored      the activation store's exact peak under `policy` (inventory.predicted_peak_bytes)
    working     WORKING_COPIES fp32 copies of the largest tensor a step makes besides the stored
                ones: the (B, T, V) logits, the (B, H, T, T) attention scores or the (B, T, f) MLP
                product. The gradients of activations and each op's transient outputs; measured on
                the CPU (tracker, physical peak minus stored peak) at most 3.4 such copies.
    """
    policy = as_policy(policy, cfg)
    state = cfg.num_params() * (4 + 4 + (8 if optimizer else 0)) + copy_bytes(cfg, policy.recast)
    tokens = batch * seq
    logit_rows = min(tokens, getattr(cfg, "loss_chunk", 0) or tokens)  # a chunked loss makes one chunk at a time
    key_rows = seq if getattr(cfg, "attention", "eager") == "eager" else min(seq, getattr(cfg, "attention_tile", seq))
    largest = max((logit_rows * cfg.vocab, "the logits"), (batch * cfg.heads * seq * key_rows, "the attention scores"),
                  (tokens * cfg.ffn, "the MLP product"))
    return {"state": state, "stored": predicted_peak_bytes(cfg, batch, seq, policy),
            "working": WORKING_COPIES * 4 * largest[0], "largest": largest[1]}


def check_fits(cfg, device, batch=None, seq=None, policy=None, note="", advice=None, optimizer=True):
    """Refuse, with the numbers and what to change, a step that would not fit the device: with batch, seq and policy,
    the whole step (step_bytes; optimizer=False: without AdamW's state); without them, the weights and optimizer alone.
    `note` says why this policy was checked; `advice` replaces the default advice on what to change."""
    device = torch.device(device)
    have, where = available_bytes(device)
    if batch is None:
        need = cfg.num_params() * (4 + 4 + 8)  # fp32 weights, gradients and AdamW's two moments
        if need > have:
            raise ValueError(f"this Config has {cfg.num_params():,} parameters: weights, gradients and AdamW "
                             f"state need {need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB of {where}. "
                             f"Use a smaller preset or shape flags (the Llama 3 presets are for `predict`).")
        return
    policy = as_policy(policy or "none", cfg)
    parts = step_bytes(cfg, batch, seq, policy, optimizer)
    need = parts["state"] + parts["stored"] + parts["working"]
    if need <= have:
        return
    if parts["state"] >= have:  # no batch or sequence fits: the advice is the model's size, whoever asked
        advice = (f"use a smaller model (--layers, --hidden, or a smaller --preset): the weights"
                  f"{', gradients and AdamW state' if optimizer else ' and gradients'} alone need {_gib(parts['state'])}, so no --batch or "
                  f"--seq fits")
    elif advice is None:
        advice = "use a smaller --batch or --seq"
        lighter = as_policy("full+selective" if getattr(cfg, "attention", "eager") == "eager" else "full", cfg)
        stored = step_bytes(cfg, batch, seq, lighter, optimizer)["stored"]
        if stored < parts["stored"] and need - parts["stored"] + stored <= have:
            advice += f", or a recomputation policy (--policy {lighter.text} stores {_gib(stored)} here, and fits)"
        elif stored < parts["stored"]:
            advice += (f" (a recomputation policy is not enough: under --policy {lighter.text} the step still needs "
                       f"about {_gib(need - parts['stored'] + stored)})")
    raise ValueError(f"one step of batch {batch} x {seq} tokens under policy {policy.text} needs about {_gib(need)}, "
                     f"more than the {_gib(have)} of {where}: weights, gradients"
                     f"{' and AdamW state' if optimizer else ''} "
                     f"{_gib(parts['state'])} + stored activations {_gib(parts['stored'])} + working memory about "
                     f"{_gib(parts['working'])} ({WORKING_COPIES} fp32 copies of {parts['largest']}){note}. "
                     f"To fit, {advice}")


def _gib(n):
    return f"{n / 2**30:.2f} GiB"

"""One training step's forward and backward, with recomputation. No autograd.

    forward : embed -> layers 0..L-1, each kept as the policy says -> final norm, head, loss
    backward: loss -> head -> for i = L-1 .. 0:
                  if layer i's activations are gone:
                      j = nearest stored checkpoint (layer input) at or below i
                      recompute layers j..i from it (restoring the RNG state it was stored with)
                  backward of layer i (uses, then drops, its activations)
              -> embedding

    loss, grads = loss_and_grads(params, cfg, input_ids, targets, policy="every:2")
"""
import contextlib

import torch

from .head import head_backward, head_forward
from .inventory import layer_inventory
from .layer import layer_backward, layer_forward
from .ops import embedding_backward, embedding_forward, rope_tables
from .ops.attention_fused import check_fused
from .ops.cross_entropy import IGNORE_INDEX
from .params import EMBED, HEAD, check_params, compute_weights, layer_key, layer_weights
from .policy import OP_LEVEL, parse_policy
from .store import ActivationStore


class _NoTracker:  # what the engine talks to when nobody is measuring
    def phase(self, name):
        return contextlib.nullcontext()

    def on_event(self, event):
        pass

    def mark(self, tensor, category):
        pass


def loss_and_grads(params, cfg, input_ids, targets, policy="none", tracker=None, trace=False):
    """Mean next-token cross-entropy and the gradient of every parameter (same keys as params).
    targets[b, t] is the token that should follow position t: no shifting happens here; a target
    of -100 (IGNORE_INDEX) is left out of the mean, as in torch and Hugging Face.
    Autograd is off for the whole step (torch.no_grad): params that require grad, as
    LlamaForCausalLM.state_dict(keep_vars=True) gives them, build no graph beside the engine."""
    policy = parse_policy(policy, cfg)
    check_params(params, cfg)
    input_ids, targets = _check_batch(cfg, input_ids, targets, params)
    with torch.no_grad():
        return _step(params, cfg, input_ids, targets, policy, tracker, trace)


def _step(params, cfg, input_ids, targets, policy, tracker, trace):
    tracker = tracker or _NoTracker()
    say = trace if callable(trace) else print  # where --trace lines go
    B, T = input_ids.shape
    L, drop = cfg.layers, policy.drop
    schedule = policy.schedule(cfg, B, T)
    store = ActivationStore(listener=tracker)
    generator = _generator(input_ids.device)
    rng_states = {}  # layer -> RNG state just before its forward, for every stored layer input
    stored_names = list(layer_inventory(cfg, B, T))  # what a layer could keep (for --trace)

    def layer_drop(mode):  # a schedule may give one layer its own op level: "all:selective"
        return OP_LEVEL[mode.partition(":")[2]] if ":" in mode else drop

    def run_layers(first, last, x, mode_of, stop_early=False):
        """Forward layers first..last from x, each stored as mode_of(k) says; returns the output.
        stop_early: the last layer's output is not needed (a recompute sweep ends where the
        backward starts), so it stops at the last tensor its backward needs."""
        for k in range(first, last + 1):
            mode = mode_of(k)
            if mode != "none" and not store.has(k, "input"):
                store.put(k, "input", x)  # a checkpoint: recomputation can start here
                if cfg.dropout > 0:
                    rng_states[k] = generator.get_state()
            keep = store if mode.startswith("all") else None  # "all" or "all:selective" / "all:cheap"
            whole = not (stop_early and k == last)
            x = layer_forward(x, weights_of[k], cfg, rope, keep, k, layer_drop(mode), need_output=whole)
            if trace:
                dropped = [name for name in stored_names if name not in store.names(k)]
                say(f"forward layer {k} ({mode}): kept {store.names(k) or 'nothing'}, dropped {dropped or 'nothing'}")
        return x

    # ---- forward ----
    with tracker.phase("forward"):
        weights = compute_weights(params, cfg)  # 16-bit copies under mixed precision
        for tensor in weights.values():
            tracker.mark(tensor, "weights")
        rope = rope_tables(cfg, T, input_ids.device, cfg.torch_dtype)  # (T, hd) cos, sin
        weights_of = [layer_weights(weights, i) for i in range(L)]  # per layer, by role
        x = embedding_forward(input_ids, weights[EMBED])  # (B, T, h)
        x = run_layers(0, L - 1, x, lambda k: schedule.forward[k])  # (B, T, h)
        loss = head_forward(x, weights, cfg, targets, store, layer_drop(schedule.head))  # scalar
        del x
    if trace:
        say(f"loss {loss.item():.4f}; stored {store.bytes:,} bytes")

    # ---- backward ----
    grads = {}

    def keep_grad(name, grad):  # to the master weights' dtype at once (a no-op in fp32 and fp64)
        grads[name] = grad.to(cfg.param_dtype)
        tracker.mark(grads[name], "gradients")

    with tracker.phase("backward"):
        dx, head_grads = head_backward(weights, cfg, targets, store)  # (B, T, h)
        for name, grad in head_grads.items():
            keep_grad(name, grad)
        for i in reversed(range(L)):
            if not store.has(i, "attn_norm.rstd"):  # layer i's activations are gone (no policy drops rstd)
                j = next(k for k in range(i, -1, -1) if store.has(k, "input"))  # nearest checkpoint
                if trace:
                    say(f"recompute segment [{j}..{i}] from the input of layer {j}")
                with tracker.phase("recompute"), _replay_rng(generator, rng_states.get(j)):
                    run_layers(j, i, store.get(j, "input"), lambda k: schedule.sweep(k, i), schedule.stop_early)
            dx, layer_grads = layer_backward(dx, weights_of[i], cfg, rope, store, i)  # (B, T, h)
            rng_states.pop(i, None)
            if trace:
                say(f"backward layer {i}: dropped its activations; stored {store.bytes:,} bytes")
            for role, grad in layer_grads._asdict().items():
                keep_grad(layer_key(i, role), grad)
        keep_grad(EMBED, embedding_backward(dx, input_ids, weights[EMBED].shape))  # (V, h)
        if cfg.tie_embeddings:  # one matrix read twice: its gradient is the sum of both uses
            keep_grad(EMBED, grads[EMBED] + grads[HEAD])  # (V, h)
            grads[HEAD] = grads[EMBED]
    grads = {name: grads[name].to(params[name].dtype) for name in params if name in grads}  # as given
    assert store.bytes == 0, f"the store still holds {store.names(None)} after the backward"
    return loss, grads


@contextlib.contextmanager
def _replay_rng(generator, state):
    """Run the block with the generator set to `state`, then put the generator back:
    recomputed dropout masks equal the first ones, and the rest of the step is unaffected."""
    if state is None:
        yield
        return
    saved = generator.get_state()
    generator.set_state(state)
    try:
        yield
    finally:
        generator.set_state(saved)


def _generator(device):
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


def _check_batch(cfg, input_ids, targets, params):
    """Token ids and targets: (batch, seq) integer tensors on the parameters' device, ids in [0, vocab),
    targets in [0, vocab) or IGNORE_INDEX, at least one target counted. Returns them as int64."""
    for name, tensor in (("input_ids", input_ids), ("targets", targets)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype.is_floating_point or tensor.dtype == torch.bool \
                or tensor.is_complex():
            raise ValueError(f"{name} must be an integer tensor of token ids, got "
                             f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
    if input_ids.dim() != 2 or input_ids.shape != targets.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and targets {tuple(targets.shape)} must both "
                         f"be (batch, seq) integer tensors of the same shape")
    if input_ids.shape[0] < 1:
        raise ValueError(f"input_ids has batch {input_ids.shape[0]}: a step needs at least one sequence")
    cfg.check_seq(input_ids.shape[1])
    device = params[EMBED].device
    if input_ids.device != device or targets.device != device:
        raise ValueError(f"input_ids are on {input_ids.device} and targets on {targets.device}, the parameters on "
                         f"{device}: move them with .to({str(device)!r})")
    if cfg.attention == "fused":
        check_fused(device, cfg.torch_dtype)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= cfg.vocab:
        raise ValueError(f"input_ids hold token ids from {low} to {high}: they must lie in [0, vocab) = "
                         f"[0, {cfg.vocab})")
    counted = targets[targets != IGNORE_INDEX]
    if counted.numel() == 0:
        raise ValueError(f"every target is {IGNORE_INDEX} (ignored): the mean loss would be 0/0; "
                         f"leave at least one target in [0, {cfg.vocab})")
    low, high = int(counted.min()), int(counted.max())
    if low < 0 or high >= cfg.vocab:
        raise ValueError(f"targets hold token ids from {low} to {high}: they must lie in [0, vocab) = "
                         f"[0, {cfg.vocab}), or be {IGNORE_INDEX} to leave a position out of the loss")
    return input_ids.long(), targets.long()

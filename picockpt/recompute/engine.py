"""One training step's forward and backward, with recomputation. No autograd.

    forward : embed -> layers 0..L-1, each kept as the policy says -> final norm, head, loss
    backward: loss -> head -> for i = L-1 .. 0:
                  if layer i's activations are gone:
                      j = nearest stored checkpoint (layer input) at or below i
                      recompute layers j..i from it (restoring the RNG state it was stored with)
                  prefetch what layer i-1 needs from host memory (offloading policies only)
                  backward of layer i (uses, then drops, its activations)
              -> embedding

    loss, grads = loss_and_grads(params, cfg, input_ids, targets, policy="every:2")

The loop (Step) talks to the model through a few parts: embed, layer forward/backward, head forward/backward, embedding
backward, and how a layer's input is kept and fetched back. Model below gives it picockpt's single-process model;
picockpt/parallel/tensor_parallel/tp_model.py gives it one tensor-parallel rank's share of the same model (its parts
cross ranks inside, the loop does not change). A pipeline stage would be a model of layers first..last whose embed()
returns the activation it receives and whose head returns the gradient it receives.
"""
import contextlib

import torch

from ..model.batch import check_batch  # the door: ids and targets checked once (the parallel jobs too)
from ..model.head import head_backward, head_forward
from ..planning.step_forms import layer_inventory
from ..model.layer import layer_backward, layer_forward
from .offload import host_tier, offloading, prefetch_for
from ..ops import embedding_backward, embedding_forward, rope_tables
from ..model.params import (EMBED, HEAD, check_params, compute_weights, layer_key, layer_names, layer_weights,
                            model_names)
from .policy import as_policy
from .store import ActivationStore
from ..model.block_tail import RUN_TAIL, SKIP_TAIL


class _NoTracker:  # what the engine talks to when nobody is measuring
    def phase(self, name):
        return contextlib.nullcontext()

    def on_event(self, event):
        pass

    def mark(self, tensor, category):
        pass


def loss_and_grads(params, cfg, input_ids, targets, policy="none", tracker=None, trace=False):
    """Mean next-token cross-entropy and the gradient of every parameter (same keys as params). targets[b, t] is the
    token that should follow position t: no shifting happens here; a target of -100 (IGNORE_INDEX) is left out of the
    mean, as in torch and Hugging Face. Autograd is off for the whole step (torch.no_grad): params that require grad, as
    LlamaForCausalLM.state_dict(keep_vars=True) gives them, build no graph beside the engine."""
    policy = as_policy(policy, cfg)
    check_params(params, cfg)
    input_ids, targets = check_batch(cfg, input_ids, targets, params)
    B, T = input_ids.shape
    with torch.no_grad():
        model = Model(params, cfg, input_ids, targets, recast=policy.recast)
        step = Step(model, policy.schedule(cfg, B, T), policy.unstored, tracker, trace)
        loss = step.forward()
        return loss, step.backward()


class Model:
    """picockpt's model as the loop sees it, in one process: the embedding, L layers, the head. What any model gives the
    loop: cfg, params, input_ids, layers (a range) and layer_names; start(tracker), embed(), keep_input/load_input,
    layer_forward/layer_backward, head_forward/head_backward and embed_backward. recast (the policy's +recast): a
    layer's 16-bit weight copies are made each time it runs and dropped after, instead of every weight's at the start of
    the step, kept to its end."""

    def __init__(self, params, cfg, input_ids, targets, recast=False):
        self.params, self.cfg, self.input_ids, self.targets = params, cfg, input_ids, targets
        self.recast = recast
        self.layers = range(cfg.layers)  # the layers this model runs, in order
        # what a layer could keep (--trace): picockpt's layer's names, or those a parallel rank's model gives
        self.layer_names = list(layer_inventory(cfg, *input_ids.shape))

    def start(self, tracker):  # first thing in the forward: the weights of this step, the rotary tables
        cfg = self.cfg
        self.tracker = tracker
        names = model_names(cfg) if self.recast else None  # recast: the layers' come in layer_weights_for
        self.weights = self.cast(names)  # 16-bit copies under mixed precision, kept to the step's end
        self.rope = rope_tables(cfg, self.input_ids.shape[1], self.input_ids.device, cfg.torch_dtype)  # (T, hd) x2
        self.weights_of = None if self.recast else [layer_weights(self.weights, i) for i in self.layers]  # by role

    def cast(self, names):  # the master weights named (None: all) in the compute dtype, marked as weights
        weights = compute_weights(self.params, self.cfg, names)
        for tensor in weights.values():
            self.tracker.mark(tensor, "weights")
        return weights

    def layer_weights_for(self, k):  # layer k's weights for one forward or backward: kept, or cast now
        if self.weights_of is not None:
            return self.weights_of[k]
        return layer_weights(self.cast(layer_names(self.cfg, k)), k)  # freed when the caller lets go

    def embed(self):
        return embedding_forward(self.input_ids, self.weights[EMBED])  # (B, T, h)

    def keep_input(self, store, k, x, whole):  # a checkpoint; whole: the layer's activations follow
        store.put(k, "input", x)  # (B, T, h)

    def load_input(self, store, k, whole):  # the input of layer k, to recompute from
        return store.get(k, "input")  # (B, T, h)

    def layer_forward(self, k, x, store, unstored, tail):  # tail: RUN_TAIL, or SKIP_TAIL (None out;
                                                           # picockpt/model/block_tail.py)
        return layer_forward(x, self.layer_weights_for(k), self.cfg, self.rope, store, k, unstored, tail)  # (B, T, h)

    def layer_backward(self, k, dx, store):  # -> dx (B, T, h) and a LayerWeights of weight gradients
        return layer_backward(dx, self.layer_weights_for(k), self.cfg, self.rope, store, k)

    def head_forward(self, x, store, unstored):
        return head_forward(x, self.weights, self.cfg, self.targets, store, unstored)  # scalar

    def head_backward(self, store):
        return head_backward(self.weights, self.cfg, self.targets, store)  # (B, T, h), {name: grad}

    def embed_backward(self, dx):
        return embedding_backward(dx, self.input_ids, self.weights[EMBED].shape)  # (V, h)


class Step:
    """One step through `model` under a Schedule (picockpt/recompute/schedule.py): forward() then backward().
    unstored: the names the policy's op level drops; a schedule may give a layer its own."""

    def __init__(self, model, schedule, unstored=frozenset(), tracker=None, trace=False):
        self.model, self.schedule, self.unstored = model, schedule, unstored
        self.tracker = tracker or _NoTracker()
        self.trace, self.say = trace, trace if callable(trace) else print  # where --trace lines go
        host = host_tier(schedule, model.input_ids.device, self.tracker)  # None unless it offloads (offload.py)
        self.store = ActivationStore(listener=self.tracker, host=host)
        self.generator = device_generator(model.input_ids.device)
        self.rng_states = {}  # layer -> RNG state just before its forward, for every stored layer input
        self.whole = set()  # the layers whose activations are stored now: their backward needs no recompute

    def run_layers(self, first, last, x, mode_of, stop_early=False):
        """Forward layers first..last from x, each stored as mode_of(k) says; returns the output.
        stop_early: the last layer's output is not needed (a recompute sweep ends where the
        backward starts), so it skips its tail and stops at the last tensor its backward needs."""
        model, store = self.model, self.store
        for k in range(first, last + 1):
            mode = mode_of(k)  # a Mode (picockpt/recompute/schedule.py): "all", "all:cheap", "input" or "none"
            if mode.keeps_input and not store.has(k, "input"):
                model.keep_input(store, k, x, whole=mode.stored)  # a checkpoint: recomputation can start here
                if model.cfg.draws_random:  # dropout masks or router jitter: replayed when recomputed
                    self.rng_states[k] = self.generator.get_state()
            if mode.stored:
                self.whole.add(k)
            tail = SKIP_TAIL if stop_early and k == last else RUN_TAIL  # a sweep's last layer: no output read
            x = model.layer_forward(k, x, store if mode.stored else None, mode.unstored(self.unstored), tail)
            if self.trace:
                dropped = [name for name in model.layer_names if name not in store.names(k)]
                host = f" ({store.host_names(k)} on the host)" if store.host_names(k) else ""
                self.say(f"forward layer {k} ({mode}): kept {store.names(k) or 'nothing'}{host}, "
                         f"dropped {dropped or 'nothing'}")
        return x

    def forward(self):
        model, schedule, tracker = self.model, self.schedule, self.tracker
        first, last = model.layers[0], model.layers[-1]
        with tracker.phase("forward"):
            model.start(tracker)
            x = model.embed()  # (B, T, h)
            with offloading(self.store, schedule):  # the puts Schedule.host names go to host memory
                x = self.run_layers(first, last, x, lambda k: schedule.forward[k])  # (B, T, h)
            loss = model.head_forward(x, self.store, schedule.head.unstored(self.unstored))  # scalar
            del x
        if self.trace:
            self.say(f"loss {loss.item():.4f}; stored {self.store.bytes:,} bytes")
        return loss

    def recompute(self, i):
        """Bring layer i's activations back: from the nearest stored checkpoint j <= i, forward layers j..i
        again (with the RNG state j was stored with), each kept as the schedule's sweep to i says."""
        model, schedule, store = self.model, self.schedule, self.store
        j = next(k for k in range(i, model.layers[0] - 1, -1) if store.has(k, "input"))  # the nearest one
        if self.trace:
            self.say(f"recompute segment [{j}..{i}] from the input of layer {j}")
        with self.tracker.phase("recompute"), replay_rng(self.generator, self.rng_states.get(j)):
            x = model.load_input(store, j, whole=schedule.sweep(j, i).stored)  # (B, T, h)
            self.run_layers(j, i, x, lambda k: schedule.sweep(k, i), schedule.stop_early)
            del x

    def backward(self):
        model, schedule, store, tracker = self.model, self.schedule, self.store, self.tracker
        cfg, grads = model.cfg, {}

        def keep_grad(name, grad):  # to the master weights' dtype at once (a no-op in fp32 and fp64)
            grads[name] = grad.to(cfg.param_dtype)
            tracker.mark(grads[name], "gradients")

        with tracker.phase("backward"):
            prefetch_for(store, self.whole, model.layers, model.layers[-1])  # under the head's backward
            dx, head_grads = model.head_backward(store)  # (B, T, h)
            for name, grad in head_grads.items():
                keep_grad(name, grad)
            for i in reversed(model.layers):
                if i not in self.whole:  # layer i's activations are gone: recompute them
                    self.recompute(i)
                prefetch_for(store, self.whole, model.layers, i - 1)  # layer i-1's, under layer i's backward
                dx, layer_grads = model.layer_backward(i, dx, store)  # (B, T, h)
                self.whole.discard(i)
                self.rng_states.pop(i, None)
                if self.trace:
                    self.say(f"backward layer {i}: dropped its activations; stored {store.bytes:,} bytes")
                for role, grad in layer_grads._asdict().items():
                    if grad is not None:  # None: computed later, by a zero-bubble pipeline's W (parallel/)
                        keep_grad(layer_key(i, role), grad)
            keep_grad(EMBED, model.embed_backward(dx))  # (V, h)
            if cfg.tie_embeddings:  # one matrix read twice: its gradient is the sum of both uses
                keep_grad(EMBED, grads[EMBED] + grads[HEAD])  # (V, h)
                grads[HEAD] = grads[EMBED]
        params = model.params
        grads = {name: grads[name].to(params[name].dtype) for name in params if name in grads}  # as given
        assert store.bytes == store.host_bytes == 0, f"the store still holds {store.names(None)} after the backward"
        return grads


@contextlib.contextmanager
def replay_rng(generator, state):
    """Run the block with the generator set to `state`, then put the generator back: recomputed
    dropout masks and router jitter noise equal the first ones, and the rest of the step is unaffected."""
    if state is None:
        yield
        return
    saved = generator.get_state()
    generator.set_state(state)
    try:
        yield
    finally:
        generator.set_state(saved)


def device_generator(device):
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


"""One rank's model for the engine's loop, composed: the one process's Model, and the parts each parallelism replaces
when it is applied to it (as picotron's apply_tensor_parallel and apply_context_parallel change the model they are
given; rank.py's inner_model applies them, cp, then ep, then tp). The parts:

    hooks        the layer's hooks (picockpt/model/layer.py's LayerHooks): each parallelism's wrap the ones before
                 and own only their points, delegating the rest (WrappedHooks below)
    vocab        the embedding (None: the one process's; tp: vocab.py's rows)
    checkpoints  how a layer input is kept and loaded (None: whole; tp's distribute_saved: this rank's 1/t)
    positions    the global positions of the tokens it holds (None: all; cp: its chunks), for the RoPE rows
    unstored     the policy's op level here (ep also drops the dispatched rows with the experts' tensors)
"""
from ..recompute.engine import Model
from ..model.head import head_backward, head_forward
from ..model.layer import ONE_PROCESS, layer_backward, layer_forward


class WrappedHooks:
    """A parallelism's hooks over inner's (module docstring); at(store, k) tells each one which layer runs next and
    the step's store (before its forward and its backward), for what a hook keeps whatever the layer's mode."""

    def __init__(self, inner=ONE_PROCESS):
        self.inner = inner

    def __getattr__(self, name):  # a point this parallelism does not own: the hooks below it
        return getattr(self.inner, name)

    def at(self, store, k):
        if isinstance(self.inner, WrappedHooks):
            self.inner.at(store, k)


class RankModel(Model):
    """params: what the rank holds (under the full names); input_ids, targets: the rows it computes. The stage
    (pp_stage.py) sets weights, weights_of and rope before each forward, and `store` to the step's store."""

    def __init__(self, params, cfg, input_ids, targets):
        super().__init__(params, cfg, input_ids, targets)
        self.hooks, self.vocab, self.checkpoints, self.positions, self.store = WrappedHooks(), None, None, None, None
        self.unstored = lambda unstored: unstored

    @property
    def rope(self):
        return self.local_rope

    @rope.setter
    def rope(self, tables):  # the whole sequence's (T, hd) x2: the rows of the tokens held here
        self.local_rope = tables if self.positions is None else tuple(t[self.positions] for t in tables)

    def embed(self):
        return self.vocab.embed(self) if self.vocab else super().embed()

    def embed_backward(self, dx):
        return self.vocab.embed_backward(self, dx) if self.vocab else super().embed_backward(dx)

    def head_forward(self, x, store, unstored):  # picockpt/model/head.py's, crossing where the hooks say
        return head_forward(x, self.weights, self.cfg, self.targets, store, unstored, self.hooks)  # scalar

    def head_backward(self, store):
        return head_backward(self.weights, self.cfg, self.targets, store, self.hooks)  # dx, {name: grad}

    def keep_input(self, store, k, x, whole):  # tp's distribute_saved checkpoints, else the one process's
        return (self.checkpoints or super()).keep_input(store, k, x, whole)

    def load_input(self, store, k, whole):
        return (self.checkpoints or super()).load_input(store, k, whole)

    def layer_forward(self, k, x, store, unstored, tail):
        self.hooks.at(self.store, k)
        return layer_forward(x, self.weights_of[k], self.cfg, self.rope, store, k, self.unstored(unstored), tail,
                             self.hooks)

    def layer_backward(self, k, dx, store):
        self.hooks.at(self.store, k)
        return layer_backward(dx, self.weights_of[k], self.cfg, self.rope, store, k, self.hooks)

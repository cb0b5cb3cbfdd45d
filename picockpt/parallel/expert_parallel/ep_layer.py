"""One decoder layer with a mixture of experts on one expert-parallel rank: picockpt/model/layer.py's layer on this
rank's B/W sequences, its experts' block ep_moe.py's.

    h   = x + dropout(o_proj(attention(q, k, v)))       every weight here whole (replicated), own sequences
    out = h + dropout(EP-MoE(rmsnorm(h)))                 tokens to their experts' ranks and back

Stored names: layer.py's (at batch B/W), moe.py's and ep_moe.py's. Dropout masks and router jitter are the single
process's, drawn for the whole batch, this rank's sequences kept (rng.py's full_size_draws along the batch dim)."""
from functools import partial

from ..rank_model import WrappedHooks
from ..rng import full_size_draws
from .ep_moe import DISPATCHED, ep_moe_backward, ep_moe_forward


class KeptRouting:
    """What a layer keeps whatever its mode (ROUTING; DISPATCHED with keep_dispatched), in the step's own store
    under layer i (the engine hands a layer a store only when it is stored whole)."""

    def __init__(self, store, i, received_rows):
        self.store, self.i, self.received_rows = store, i, received_rows  # received_rows: {layer: rows}, for the report
        self.has, self.get = partial(store.has, i), partial(store.get, i)  # has(name), get(name): layer i's

    def put(self, name, tensor):
        self.store.put(self.i, name, tensor)
        if name == "moe.received_counts":
            self.received_rows[self.i] = int(tensor.sum())


def ep_drop(unstored):
    """The policy's op level here: moe ("drop all the experts keep") drops the dispatched rows too, their input."""
    return unstored | frozenset(DISPATCHED) if "moe.gate_up" in unstored else unstored


class ExpertParallelHooks(WrappedHooks):
    """Where picockpt/model/layer.py's layer crosses the W ranks of `comm`: its experts' block (ep_moe.py) and the
    whole-batch draws. at() points it at the layer's routing in the step's store (KeptRouting)."""

    def __init__(self, comm, cfg, first_expert, keep_dispatched, received_rows, inner):
        super().__init__(inner)
        self.comm, self.cfg, self.kept, self.received_rows = comm, cfg, None, received_rows
        self.first_expert, self.keep_dispatched = first_expert, keep_dispatched

    def at(self, store, k):
        super().at(store, k)
        self.kept = KeptRouting(store, k, self.received_rows)  # the step's store, whatever the layer's mode

    def layer_draws(self):  # dropout masks and router jitter: the whole batch's, this rank's sequences
        return full_size_draws(self.comm, dim=0, dropout=1.0 if self.cfg.draws_random else 0)

    def mlp_forward(self, xn2, w, cfg, keep, tail):  # (B_r, T, h), or None: its tail skipped
        return ep_moe_forward(xn2, w, cfg, self.comm, keep, self.kept, self.first_expert, self.keep_dispatched, tail)

    def mlp_backward(self, grad, normed, w, cfg, take):
        return ep_moe_backward(grad, normed, w, cfg, self.comm, take, self.first_expert)  # (B_r, T, h), {role: grad}

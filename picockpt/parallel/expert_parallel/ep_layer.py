"""One Llama decoder layer with a mixture of experts on one expert-parallel rank: picockpt/layer.py's
layer on this rank's B/W sequences, its experts' block from picockpt/parallel/expert_parallel/ep_moe.py.

    h   = x + dropout(o_proj(attention(q, k, v)))       every weight here whole (replicated), own sequences
    out = h + dropout(EP-MoE(rmsnorm(h)))                 tokens to their experts' ranks and back

Everything but the experts is data parallel: the same weights on every rank, each rank's own
sequences, nothing exchanged (the replicated weights' gradients are summed over the ranks at the
end of the step, by the data-parallel buckets: picockpt/parallel/data_parallel/dp_comm.py). The stored names are layer.py's (at batch B/W),
moe.py's, and the expert-parallel block's own (ep_moe.py's table).

Random draws. Dropout masks and router jitter noise must be the single process's, so each rank
draws the whole batch's tensor from the shared generator state and keeps its own sequences (as
picockpt/parallel/rng.py does for tensor parallelism, here along the batch dim): every rank's
generator then advances as the single process's, and the engine's RNG replay gives a recomputed
layer the same draws again.
"""
from ...layer import Crossings
from ..rng import full_size_draws
from .ep_moe import DISPATCHED, ROUTING, ep_moe_backward, ep_moe_forward


class KeptRouting:
    """What an expert-parallel layer keeps whatever mode the policy gives it (ep_moe.py's ROUTING, and
    with keep_dispatched the dispatched rows), in the step's store under layer i. The engine hands a
    layer a store only when it is stored whole, so the model gives this one the step's own."""

    def __init__(self, store, i, received_rows=None):
        self.store, self.i = store, i
        self.received_rows = received_rows  # {layer: rows its experts received}, filled in for the report

    def has(self, name):
        return self.store.has(self.i, name)

    def get(self, name):
        return self.store.get(self.i, name)

    def put(self, name, tensor):
        self.store.put(self.i, name, tensor)
        if name == "moe.received_counts" and self.received_rows is not None:
            self.received_rows[self.i] = int(tensor.sum())

    def keep_routing(self, keep):
        """moe.route's keep: the routing decision here, everything else the layer's way."""
        return lambda name, tensor: (self.put if name in ROUTING else keep)(name, tensor)


def ep_drop(drop):
    """The policy's op level on an expert-parallel layer: moe ("drop all the experts keep") drops the
    dispatched rows too, the experts' input."""
    return drop | frozenset(DISPATCHED) if "moe.gate_up" in drop else drop


class ExpertParallelCrossings(Crossings):
    """Where picockpt/layer.py's layer crosses the W ranks of `comm`: only its experts' block, which sends
    each token to its expert's rank and back (ep_moe.py); everything else runs on this rank's own B/W
    sequences, every random draw the whole batch's (this rank's rows kept). kept: the layer's KeptRouting."""

    def __init__(self, comm, cfg, kept, first_expert, keep_dispatched=False):
        self.comm, self.cfg, self.kept = comm, cfg, kept
        self.first_expert, self.keep_dispatched = first_expert, keep_dispatched

    def layer_draws(self):  # dropout masks and router jitter: the whole batch's, this rank's sequences
        return full_size_draws(self.comm, dim=0, dropout=1.0 if self.cfg.draws_random else 0)

    def mlp_forward(self, xn2, w, cfg, keep, tail):
        return ep_moe_forward(xn2, w, cfg, self.comm, keep, self.kept, self.first_expert, self.keep_dispatched,
                              tail)  # (B_r, T, h), or None: its tail skipped

    def mlp_backward(self, grad, normed, w, cfg, take):
        return ep_moe_backward(grad, normed, w, cfg, self.comm, take, self.first_expert)  # (B_r, T, h), {role: grad}

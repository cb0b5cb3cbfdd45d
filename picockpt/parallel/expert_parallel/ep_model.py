"""One expert-parallel rank's model, as the engine's loop sees it (picockpt/engine.py: Step).

The layout is DeepSpeed-MoE's and Megatron-LM's expert parallelism without tensor parallelism:
the batch is split over the W ranks (rank r computes sequences r*B/W .. (r+1)*B/W - 1), every
weight but the experts' is whole on every rank (data parallel), and the experts are split: rank r
holds experts r*E/W .. (r+1)*E/W - 1 of every layer. The loop is the single process's, line for
line; the layers are picockpt/layer.py's with ep_layer.py's crossings, whose expert block sends each token to its
experts' rank and back (ep_moe.py), so recomputing a layer runs its all-to-alls again.

The loss. The single process averages over the whole batch's counted targets, n of them. A rank's
head (picockpt/head.py) averages over its own, n_r, so its share of the whole mean is that times
n_r / n: the loss is the sum of the ranks' shares (the caller adds them), and every gradient out of
the head is scaled alike (by 1/2 on two ranks with equal counts: exact in floating point).

Which experts a rank holds: ep_shard.py.
"""
import torch

from ...engine import Model
from ...layer import layer_backward, layer_forward
from ...head import head_backward, head_forward
from ...ops import embedding_backward, embedding_forward
from ...ops.cross_entropy import IGNORE_INDEX
from ...params import EMBED
from .ep_inventory import ep_layer_names
from .ep_layer import ExpertParallelCrossings, KeptRouting, ep_drop

class ExpertParallelModel(Model):  # Model.start: this step's weights (this rank's), rotary tables
    """params: this rank's (shard_experts); input_ids, targets: this rank's sequences (B/W, T);
    counted: the whole batch's number of counted targets. After building the Step, give the model its
    store (model.store = step.store): every layer keeps its routing there, whatever its mode."""

    def __init__(self, params, cfg, input_ids, targets, comm, counted, keep_dispatched=False):
        self.params, self.cfg, self.input_ids, self.targets = params, cfg, input_ids, targets
        self.comm, self.keep_dispatched = comm, keep_dispatched
        self.layers = range(cfg.layers)
        self.layer_names = ep_layer_names(cfg, comm.world_size, comm.rank)  # what a layer could keep (--trace)
        self.first_expert = comm.rank * (cfg.experts // comm.world_size)  # the global id of its first expert
        here = int((targets != IGNORE_INDEX).sum())
        self.share = here / counted  # n_r / n: this rank's share of the whole batch's mean
        self.store = None
        self.received_rows = {}  # layer -> rows its experts received (the routing, as measured here)

    def embed(self):
        return embedding_forward(self.input_ids, self.weights[EMBED])  # (B_r, T, h)

    def keep_input(self, store, k, x, whole):
        store.put(k, "input", x)  # (B_r, T, h)

    def load_input(self, store, k, whole):
        return store.get(k, "input")  # (B_r, T, h)

    def layer_forward(self, k, x, store, drop, tail):
        kept = KeptRouting(self.store, k, self.received_rows)  # the step's store, whatever the layer's mode
        cross = ExpertParallelCrossings(self.comm, self.cfg, kept, self.first_expert, self.keep_dispatched)
        return layer_forward(x, self.weights_of[k], self.cfg, self.rope, store, k, ep_drop(drop), tail,
                             cross)  # (B_r, T, h)

    def layer_backward(self, k, dx, store):
        cross = ExpertParallelCrossings(self.comm, self.cfg, None, self.first_expert)  # its backward reads the store
        return layer_backward(dx, self.weights_of[k], self.cfg, self.rope, store, k, cross)

    def head_forward(self, x, store, drop):
        loss = head_forward(x, self.weights, self.cfg, self.targets, store, drop)  # mean over this rank's targets
        return loss * self.share if self.share else torch.zeros_like(loss)  # its share (none counted here: 0)

    def head_backward(self, store):
        dx, grads = head_backward(self.weights, self.cfg, self.targets, store)  # of this rank's own mean
        return dx * self.share, {name: grad * self.share for name, grad in grads.items()}  # of its share

    def embed_backward(self, dx):
        return embedding_backward(dx, self.input_ids, self.weights[EMBED].shape)  # (V, h) from its sequences

"""One expert-parallel rank's model for the engine's loop (picockpt/engine.py: Step), the single process's line for
line: rank r of W computes sequences r*B/W .. (r+1)*B/W - 1 with ep_layer.py's layers, holding ep_shard.py's weights.

The loss: as pp_stage.py's micro-batches, each rank's head mean over its n_r counted targets times n_r / n (n the
whole batch's), its gradients alike (by 1/2 on two ranks with equal counts: exact); the caller adds the shares.
"""
import torch

from ...engine import Model
from ...layer import layer_backward, layer_forward
from ...head import head_backward, head_forward
from ...ops.cross_entropy import IGNORE_INDEX
from .ep_inventory import ep_layer_names
from .ep_layer import ExpertParallelCrossings, KeptRouting, ep_drop


class ExpertParallelModel(Model):  # Model's start (this rank's weights), embed, checkpoints, embed_backward
    """params: this rank's (shard_experts); input_ids, targets: its sequences (B/W, T); counted: the whole batch's
    counted targets. Set model.store = step.store after building the Step: every layer keeps its routing there."""

    def __init__(self, params, cfg, input_ids, targets, comm, counted, keep_dispatched=False):
        super().__init__(params, cfg, input_ids, targets, ep_layer_names(cfg, comm.world_size, comm.rank))
        self.comm, self.keep_dispatched = comm, keep_dispatched
        self.first_expert = comm.rank * (cfg.experts // comm.world_size)  # the global id of its first expert
        self.share = int((targets != IGNORE_INDEX).sum()) / counted  # n_r / n: its share of the whole batch's mean
        self.store = None
        self.received_rows = {}  # layer -> rows its experts received (the routing, as measured here)

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

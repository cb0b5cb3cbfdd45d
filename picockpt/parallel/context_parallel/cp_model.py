"""What context parallelism changes in a rank's model (picockpt/parallel/rank_model.py), as the engine's loop sees it.

The rank holds every weight (replicated) and its n = T/cp tokens of every sequence (cp_layout.py). All of the layer
but attention works token by token, so picockpt/model/layer.py's layer runs here unchanged on (B, n, h); only its
attention core crosses ranks (ContextParallelHooks): round the ring (cp_attention.py), or after one all-gather of K/V
per layer, gathered again in the backward (as Megatron-LM's docs say) unless keep_kv keeps the other ranks' rows:
attn.kv_others, put in the step's store by the layer's first forward whatever its mode, read by every recompute sweep,
popped by its backward. A recompute sweep runs the layer's ring or all-gather again. RoPE: the rows of the single
process's rotary tables at this rank's global positions. The loss is the stage's (pipeline_parallel/pp_stage.py: scaled
by this rank's share of the counted targets); the dp x cp ranks sum the replicated weights' partial gradients in the
data-parallel buckets.
"""
import torch

from ...planning.step_forms import layer_inventory
from ..rank_model import WrappedHooks
from .cp_attention import (gathered_attention_backward, gathered_attention_forward, ring_attention_backward,
                           ring_attention_forward)
from .cp_comm import RINGS, gather_kv_backward, gather_kv_forward

KEPT_KV = "attn.kv_others"  # the other ranks' K/V rows, kept under cp_comm="allgather" with keep_kv


def apply_context_parallel(model, comm, layout, cp_comm="ring", keep_kv=False):
    """Make a RankModel (picockpt/parallel/rank_model.py) a context-parallel rank's: of the rows it is given it
    keeps its tokens (layout.rows), the RoPE rows at their global positions, and attention crossing the cp ranks.
    Apply it before tensor parallelism: the tp rank's names and sp's split are of these tokens."""
    model.input_ids, model.targets = layout.rows(model.input_ids, comm.rank), layout.rows(model.targets, comm.rank)
    model.positions = layout.positions(comm.rank, model.input_ids.device)  # (n,) global positions of its rows
    model.layer_names = list(layer_inventory(model.cfg, *model.input_ids.shape))  # what a layer keeps, at n tokens
    model.hooks = ContextParallelHooks(comm, layout, cp_comm, keep_kv, model.hooks)
    return model


class ContextParallelHooks(WrappedHooks):
    """The one hook of a context-parallel layer: its attention core (beside tensor parallelism, of this rank's
    heads, crossing the cp ranks of the same tp rank); at(): rank_model.py's WrappedHooks, for the kept K/V."""

    def __init__(self, comm, layout, cp_comm, keep_kv, inner):
        super().__init__(inner)
        self.group, self.layout, self.kind, self.keep_kv = comm, layout, cp_comm, keep_kv  # group: the cp ranks
        self.store, self.layer = None, None

    def at(self, store, k):
        super().at(store, k)
        self.store, self.layer = store, k

    def attention_core(self, q, k, v, cfg, keep):  # q (B, H, n, hd), k/v (B, KV, n, hd) of this rank's tokens
        if self.kind in RINGS:  # (B, H, n, hd), (B, H, n)
            out, lse = ring_attention_forward(q, k, v, cfg, self.layout, self.group, self.kind == "ring_overlap")
        else:  # a recompute sweep finds the other ranks' K/V kept (keep_kv): no all-gather
            kept = self.store.get(self.layer, KEPT_KV) if self.keep_kv and self.store.has(self.layer, KEPT_KV) else None
            out, lse = gathered_attention_forward(q, self.gathered(k, v, kept), cfg, self.layout, self.group.rank)
        keep("attn.lse", lse)  # (B, H, n) the merged log-sum-exp, as the single process's rows
        return out

    def gathered(self, k, v, others=None):
        """Every rank's K/V (2, B, KV, T, hd) in rank order: this rank's with `others` (2, B, KV, (cp-1) n, hd), the
        kept rows of every other rank, or all-gathered (under keep_kv the others' rows then go to the step's store)."""
        kv, n, r = torch.stack((k, v)), k.shape[2], self.group.rank  # (2, B, KV, n, hd)
        if others is not None:
            return torch.cat((others[:, :, :, :r * n], kv, others[:, :, :, r * n:]), dim=3)
        kv_all = gather_kv_forward(kv, self.group)  # all-gather
        if self.keep_kv:
            self.store.put(self.layer, KEPT_KV, torch.cat((kv_all[:, :, :, :r * n], kv_all[:, :, :, (r + 1) * n:]), 3))
        return kv_all

    def attention_core_backward(self, dout, q, k, v, out, cfg, take, recomputing):
        lse = take("attn.lse")  # (B, H, n)
        if self.kind in RINGS:
            return ring_attention_backward(dout, q, k, v, out, lse, cfg, self.layout, self.group, recomputing,
                                           self.kind == "ring_overlap")
        kv_all = self.gathered(k, v, take(KEPT_KV) if self.keep_kv else None)  # again: kept, or all-gathered once more
        dq, dkv_all = gathered_attention_backward(dout, q, out, lse, kv_all, cfg, self.layout, self.group.rank,
                                                  recomputing)  # (B, H, n, hd), (2, B, KV, T, hd) partial
        del kv_all
        dkv = gather_kv_backward(dkv_all, self.group)  # (2, B, KV, n, hd) reduce-scatter: this rank's rows' sum
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype)

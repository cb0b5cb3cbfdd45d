"""One context-parallel rank's model, as the engine's loop sees it (picockpt/engine.py: Step).

The rank holds every weight (replicated) and its n = T/cp tokens of every sequence (cp_layout.py). All
of the layer but attention works token by token, so picockpt/layer.py's layer runs here unchanged on
(B, n, h); only its attention core crosses ranks (ContextParallelCrossings below):

    cp_comm="ring"        ring attention: cp - 1 steps pass the K/V blocks on (cp_attention.py)
    cp_comm="allgather"   one all-gather of K/V per layer (the Llama 3 paper's choice); its backward
                          gathers them again and reduce-scatters their gradients (as Megatron-LM's docs
                          say: each GPU stores the K/V of its own chunk and gathers them again in the
                          backward), unless keep_kv keeps the other ranks' rows: attn.kv_others
                          (2, B, KV, (cp-1) n, hd), put in the step's store by the layer's first forward
                          whatever its mode, read by every recompute sweep, popped by its backward

A recompute sweep runs the layer's forward again, and so its ring or all-gather (kept K/V: none).

RoPE: the rows of the single process's (T, hd) rotary tables at this rank's global positions.
Loss: the head sees this rank's tokens, and its mean over their counted targets, times n_r / N (this
rank's counted targets over the whole batch's), is this rank's share: the shares add up to the single
process's mean (pipeline_parallel/pp_stage.py scales micro-batches so). The gradients of the (replicated)
weights are partial, from this rank's tokens: cp_step.py sums them over the ranks.
"""
import torch

from ...engine import Model
from ...head import head_backward, head_forward
from ...inventory import layer_inventory
from ...layer import Crossings, layer_backward, layer_forward
from ...ops import embedding_backward, rope_tables
from ...ops.cross_entropy import IGNORE_INDEX
from ...params import EMBED
from .cp_attention import (gathered_attention_backward, gathered_attention_forward, ring_attention_backward,
                           ring_attention_forward)
from .cp_comm import gather_kv_backward, gather_kv_forward

KEPT_KV = "attn.kv_others"  # the other ranks' K/V rows, kept under cp_comm="allgather" with keep_kv


class ContextParallelCrossings(Crossings):
    """The one crossing of a context-parallel layer: its attention core. The model sets store and layer
    before each layer runs (the kept K/V go to the step's store whatever the layer's mode)."""

    def __init__(self, comm, layout, cp_comm="ring", keep_kv=False):
        self.comm, self.layout, self.cp_comm, self.keep_kv = comm, layout, cp_comm, keep_kv
        self.store, self.layer = None, None

    def attention_core(self, q, k, v, cfg, keep):
        # q (B, H, n, hd), k/v (B, KV, n, hd) of this rank's tokens
        if self.cp_comm == "ring":
            out, lse = ring_attention_forward(q, k, v, cfg, self.layout, self.comm)  # (B, H, n, hd), (B, H, n)
        else:
            out, lse = gathered_attention_forward(q, self.gathered(k, v), cfg, self.layout, self.comm.rank)
        keep("attn.lse", lse)  # (B, H, n) the merged log-sum-exp, as the single process's rows
        return out

    def gathered(self, k, v):
        """Every rank's K/V (2, B, KV, T, hd) in rank order: all-gathered, or this rank's with the kept rest."""
        kv = torch.stack((k, v))  # (2, B, KV, n, hd)
        store, layer = self.store, self.layer
        if self.keep_kv and store.has(layer, KEPT_KV):  # a recompute sweep: no all-gather
            return self.with_own(store.get(layer, KEPT_KV), kv)  # (2, B, KV, T, hd)
        kv_all = gather_kv_forward(kv, self.comm)  # (2, B, KV, T, hd) all-gather
        if self.keep_kv:
            n, r = kv.shape[3], self.comm.rank
            store.put(layer, KEPT_KV, torch.cat((kv_all[:, :, :, :r * n], kv_all[:, :, :, (r + 1) * n:]), dim=3))
        return kv_all

    def with_own(self, others, kv):
        n, r = kv.shape[3], self.comm.rank  # others (2, B, KV, (cp-1) n, hd): every rank's rows but these
        return torch.cat((others[:, :, :, :r * n], kv, others[:, :, :, r * n:]), dim=3)  # (2, B, KV, T, hd)

    def attention_core_backward(self, dout, q, k, v, out, cfg, take, recomputing):
        lse = take("attn.lse")  # (B, H, n)
        if self.cp_comm == "ring":
            return ring_attention_backward(dout, q, k, v, out, lse, cfg, self.layout, self.comm, recomputing)
        kv = torch.stack((k, v))  # (2, B, KV, n, hd)
        # the other ranks' K/V again: kept, or all-gathered once more
        kv_all = self.with_own(take(KEPT_KV), kv) if self.keep_kv else gather_kv_forward(kv, self.comm)
        del kv
        dq, dkv_all = gathered_attention_backward(dout, q, out, lse, kv_all, cfg, self.layout, self.comm.rank,
                                                  recomputing)  # (B, H, n, hd), (2, B, KV, T, hd) partial
        del kv_all
        dkv = gather_kv_backward(dkv_all, self.comm)  # (2, B, KV, n, hd) reduce-scatter: this rank's rows' sum
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class ContextParallelModel(Model):  # Model.start: this step's weights, then the rotary rows of these tokens
    """params: every weight, whole; input_ids, targets: the whole batch (B, T), of which this rank takes its
    tokens (layout.rows). The step's store is attached (model.store = step.store) before the forward."""

    def __init__(self, params, cfg, input_ids, targets, comm, layout, cp_comm="ring", keep_kv=False):
        rank = comm.rank
        self.params, self.cfg, self.comm, self.layout = params, cfg, comm, layout
        self.positions = layout.positions(rank, input_ids.device)  # (n,) global positions of the local rows
        self.input_ids, self.targets = layout.rows(input_ids, rank), layout.rows(targets, rank)  # (B, n) each
        counted = int((targets != IGNORE_INDEX).sum())  # N: the whole batch's counted targets
        self.share = int((self.targets != IGNORE_INDEX).sum()) / counted  # n_r / N
        self.layers = range(cfg.layers)
        self.layer_names = list(layer_inventory(cfg, *self.input_ids.shape))  # for --trace
        self.cross = ContextParallelCrossings(comm, layout, cp_comm, keep_kv)
        self.store = None

    def start(self, tracker):
        super().start(tracker)  # the weights (its rotary tables, of n rows, are replaced here)
        cos, sin = rope_tables(self.cfg, self.layout.seq, self.input_ids.device, self.cfg.torch_dtype)  # (T, hd)
        self.rope = cos[self.positions], sin[self.positions]  # (n, hd) x2 the single process's rows

    def layer_forward(self, k, x, store, drop, tail):
        self.cross.store, self.cross.layer = self.store, k
        return layer_forward(x, self.weights_of[k], self.cfg, self.rope, store, k, drop, tail,
                             self.cross)  # (B, n, h)

    def layer_backward(self, k, dx, store):  # -> dx (B, n, h) and a LayerWeights of partial gradients
        self.cross.store, self.cross.layer = self.store, k
        return layer_backward(dx, self.weights_of[k], self.cfg, self.rope, store, k, self.cross)

    def head_forward(self, x, store, drop):
        loss = head_forward(x, self.weights, self.cfg, self.targets, store, drop)  # the mean over these tokens
        return loss * self.share if self.share else loss.new_zeros(())  # this rank's share of the batch's mean

    def head_backward(self, store):
        dx, grads = head_backward(self.weights, self.cfg, self.targets, store)  # for this rank's mean
        if not self.share:  # no counted target here: nothing of the loss comes from these tokens
            return dx.zero_(), {name: grad.zero_() for name, grad in grads.items()}
        return dx.mul_(self.share), {name: grad.mul_(self.share) for name, grad in grads.items()}  # the batch's

    def embed_backward(self, dx):
        return embedding_backward(dx, self.input_ids, self.weights[EMBED].shape)  # (V, h)

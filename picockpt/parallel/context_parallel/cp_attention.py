"""Causal attention over tokens that live on several ranks: blocks merged by their log-sum-exp.

A rank's queries are its chunks (cp_layout.py); the keys and values come in blocks of chunks: its own, then each
other rank's as the ring brings it (ring attention, Liu et al. 2023), or all of them after an all-gather. A query
chunk against a chunk of keys is causal (the same chunk: the single process's kernel on c x c), whole (an earlier
chunk: the kernel with causal=False) or skipped (a later one). Each block's kernel returns its normalised output O_b
and its rows' log-sum-exp lse_b, the online softmax's state (FlashAttention-2's merge of its tiles):

    lse = log(exp(lse_a) + exp(lse_b))                   = logaddexp(lse_a, lse_b)
    O   = exp(lse_a - lse) O_a + exp(lse_b - lse) O_b    (each block's softmax, re-weighted to the union's)

What is stored is the single process's on this rank's n tokens: q, k, v, the merged output and lse. The backward
needs no per-block statistic: with the merged O and lse each block's kernel backward recomputes exactly the whole
softmax's columns for its keys, and D = rowsum(dO * O) is the whole row's; dq sums here, dk_b and dv_b where the
block's owner gets them (the ring carries them home, the all-gather's reduce-scatter sums them).
"""
from functools import partial

import torch

from ...ops.attention_fused import fused_attention_backward, fused_attention_forward
from ...ops.attention_tiled import tiled_attention_backward, tiled_attention_forward
from .cp_comm import ring_backward, ring_forward, ring_post, ring_wait


def blocks(chunk, held, c):
    """[(start, end, causal)]: the rows of a block of keys (its chunks `held`, in its order, c rows each)
    that query chunk `chunk` reads: its own chunk causally, the earlier ones whole (neighbours as one)."""
    out = []
    for slot, j in enumerate(held):
        if j < chunk and out and not out[-1][2] and out[-1][1] == slot * c:  # follows an earlier chunk: one block
            out[-1] = (out[-1][0], (slot + 1) * c, False)
        elif j <= chunk:  # a later chunk is skipped
            out.append((slot * c, (slot + 1) * c, j == chunk))
    return out


def merge(state, part):
    """(O_a, lse_a) and (O_b, lse_b) -> the online softmax over both blocks' keys (the formula above)."""
    (out_a, lse_a), (out_b, lse_b) = state, part  # (B, H, c, hd), (B, H, c) in the statistics dtype
    lse = torch.logaddexp(lse_a, lse_b)  # (B, H, c) finite: every row sees its own chunk's first key
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse


def _rows(x, a, c):
    return x[:, :, a * c:(a + 1) * c].contiguous()  # (B, H, c, ...) local query chunk a (a copy)


def attend_forward(q, kv, held, mine, c, cfg, state):
    """Every local query chunk (`mine`) against the block kv (2, B, KV, m, hd) of chunks `held`: merged
    into state[a], (O, lse) of query chunk a so far (None before its first block)."""
    stat, tile = cfg.stat_dtype, cfg.attention_tile
    kernel = partial(tiled_attention_forward, stat_dtype=stat, tile_q=tile, tile_k=tile) if cfg.attention == "tiled" \
        else fused_attention_forward  # one block's: q (B, H, c, hd), k/v (B, KV, m, hd) -> O_b, lse_b (B, H, c)
    for a, chunk in enumerate(mine):
        q_a = _rows(q, a, c)  # (B, H, c, hd)
        for start, end, causal in blocks(chunk, held, c):
            out, lse = kernel(q_a, kv[0, :, :, start:end], kv[1, :, :, start:end], causal=causal)
            part = (out.to(stat), lse.to(stat))  # (B, H, c, hd), (B, H, c)
            state[a] = part if state[a] is None else merge(state[a], part)


def attend_backward(dout, q, out, lse, kv, held, mine, c, cfg, recomputing, dq, dkv):
    """The backward of attend_forward: adds each block's gradients into dq (B, H, n, hd) and dkv
    (2, B, KV, m, hd), both in the statistics dtype."""
    tile = cfg.attention_tile
    kernel = partial(tiled_attention_backward, stat_dtype=cfg.stat_dtype, tile_q=tile, tile_k=tile,
                     recomputing=recomputing) if cfg.attention == "tiled" else fused_attention_backward
    for a, chunk in enumerate(mine):
        do_a, q_a, out_a, lse_a = _rows(dout, a, c), _rows(q, a, c), _rows(out, a, c), _rows(lse, a, c)
        for start, end, causal in blocks(chunk, held, c):  # the block's kernel backward, with the merged O and lse
            dq_a, dk, dv = kernel(do_a, q_a, kv[0, :, :, start:end], kv[1, :, :, start:end], out_a, lse_a,
                                  causal=causal)  # (B, H, c, hd), (B, KV, m, hd) x2
            dq[:, :, a * c:(a + 1) * c] += dq_a
            dkv[0, :, :, start:end] += dk
            dkv[1, :, :, start:end] += dv


def _finish(state, dtype):
    out = torch.cat([o for o, _ in state], dim=2).to(dtype)  # (B, H, n, hd) the local chunks in order
    return out, torch.cat([lse for _, lse in state], dim=2)  # (B, H, n)


# ---- ring attention: cp steps, the K/V block moving on after each. overlap=False (cp_comm="ring"): each hop after
# the block's attention, one thing at a time, to read; overlap=True ("ring_overlap"): each hop of kv posted before it,
# waited for after it (cp_comm.py: ring_post): the same hops, bytes and sums in the same order, the same numbers.
def ring_attention_forward(q, k, v, cfg, layout, comm, overlap=False):
    """q (B, H, n, hd), k/v (B, KV, n, hd) of this rank's tokens -> out (B, H, n, hd), lse (B, H, n).
    At step s the block of rank r - s is here; cp - 1 ring steps move the blocks."""
    W, r, mine, kv = comm.world_size, comm.rank, layout.chunks(comm.rank), torch.stack((k, v))  # one message a step
    state = [None] * len(mine)
    for step in range(W):
        posted = ring_post([kv], comm, ["ring_kv"]) if overlap and step < W - 1 else None  # the next block, in flight
        attend_forward(q, kv, layout.chunks((r - step) % W), mine, layout.chunk, cfg, state)
        if step < W - 1:
            kv = ring_wait(posted, comm)[0] if overlap else ring_forward(kv, comm)  # rank r - step - 1's
    return _finish(state, q.dtype)


def ring_attention_backward(dout, q, k, v, out, lse, cfg, layout, comm, recomputing, overlap=False):
    """The ring again: each step's block gives dq here and its dk, dv, which ride on with it and reach
    their owner after the cp-th hop (cp_comm.py). -> dq (B, H, n, hd), dk, dv (B, KV, n, hd)."""
    W, r, mine, kv = comm.world_size, comm.rank, layout.chunks(comm.rank), torch.stack((k, v))  # (2, B, KV, n, hd)
    dq, dkv = (torch.zeros(x.shape, dtype=cfg.stat_dtype, device=q.device) for x in (q, kv))  # dkv: the block's so far
    for step in range(W):
        posted = ring_post([kv], comm, ["ring_kv"]) if overlap and step < W - 1 else None  # the next block, in flight
        attend_backward(dout, q, out, lse, kv, layout.chunks((r - step) % W), mine, layout.chunk, cfg,
                        recomputing, dq, dkv)
        if step < W - 1 and overlap:
            kv, dkv = ring_wait(posted, comm)[0], ring_backward(None, dkv, comm)  # (2, B, KV, n, hd) each
        elif step < W - 1:
            kv, dkv = ring_backward(kv, dkv, comm)  # the next block, and its gradient from the ranks before
    dkv = ring_backward(None, dkv, comm)  # (2, B, KV, n, hd) home: this rank's own block's whole gradient
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


# ---- all-gather attention: every rank's K/V at once ------------------------------------------------
def gathered_attention_forward(q, kv_all, cfg, layout, rank):
    """q (B, H, n, hd), kv_all (2, B, KV, T, hd) every rank's rows in rank order -> out, lse."""
    state = [None] * len(layout.chunks(rank))
    attend_forward(q, kv_all, layout.gathered(), layout.chunks(rank), layout.chunk, cfg, state)
    return _finish(state, q.dtype)


def gathered_attention_backward(dout, q, out, lse, kv_all, cfg, layout, rank, recomputing):
    """-> dq (B, H, n, hd) in q's dtype, dkv_all (2, B, KV, T, hd) this rank's partial gradient, statistics dtype."""
    dq, dkv_all = (torch.zeros(x.shape, dtype=cfg.stat_dtype, device=q.device) for x in (q, kv_all))
    attend_backward(dout, q, out, lse, kv_all, layout.gathered(), layout.chunks(rank), layout.chunk, cfg,
                    recomputing, dq, dkv_all)
    return dq.to(q.dtype), dkv_all

"""The attention core of a layer, by kind (Config.attention): what each keeps, and its backward.

The layer (picockpt/model/layer.py) keeps q, k, v and the output (as attn.context) for every kind; the core keeps what
its own backward needs besides, through keep(name, tensor), and takes it back through take(name, rebuild):

    kind    the core keeps                              its backward
    eager   attn.probs (B, H, T, T)                     uses them, or rebuilds them from q, k when a policy
            + with dropout: attn.probs_mask (bool),     (selective, cheap) dropped them
              attn.probs_dropped (B, H, T, T)
    tiled   attn.lse (B, H, T), statistics dtype        recomputes every tile of probabilities from q, k, lse
            + with dropout: attn.dropout_seed (8 bytes) and regenerates each tile's mask from the seed
    fused   attn.lse (B, H, T), statistics dtype        torch's kernel recomputes them the same way

So under tiled and fused the T x T tensors are never stored, nor ever whole: FlashAttention is
selective recomputation done inside the op, and the `selective` policy has nothing left to drop.
"""
from ..ops import attention_backward, attention_forward, attention_probs, dropout_forward, dropout_mask
from ..ops.attention_fused import fused_attention_backward, fused_attention_forward
from ..ops.attention_tiled import draw_seed, tiled_attention_backward, tiled_attention_forward


def attention_core_forward(q, k, v, cfg, keep):
    """q (B, H, T, hd), k/v (B, KV, T, hd) -> out (B, H, T, hd); keep(name, tensor) what the backward needs."""
    B, H, T, hd = q.shape
    p, stat = cfg.dropout, cfg.stat_dtype
    if cfg.attention == "eager":
        mask = dropout_mask((B, H, T, T), p, q.device) if p > 0 else None  # (B, H, T, T) bool
        out, probs, dropped = attention_forward(q, k, v, stat, mask, p)  # (B, H, T, hd), (B, H, T, T) x2
        keep("attn.probs", probs)
        if mask is not None:
            keep("attn.probs_mask", mask)
            keep("attn.probs_dropped", dropped)
        return out
    if cfg.attention == "tiled":
        seed = draw_seed(q.device) if p > 0 else None  # () int64: every tile's mask comes from it
        tile = cfg.attention_tile
        out, lse = tiled_attention_forward(q, k, v, stat, tile, tile, p, seed)  # (B, H, T, hd), (B, H, T)
        if seed is not None:
            keep("attn.dropout_seed", seed)
    else:  # fused
        out, lse = fused_attention_forward(q, k, v)  # (B, H, T, hd), (B, H, T)
    keep("attn.lse", lse)
    return out


def attention_core_backward(dout, q, k, v, out, cfg, take, recomputing):
    """dout (B, H, T, hd) -> dq (B, H, T, hd), dk, dv (B, KV, T, hd). `out` is the forward's output
    (None under eager, which does not need it); `recomputing()` marks the tiled kernel's rebuilds."""
    p, stat = cfg.dropout, cfg.stat_dtype
    if cfg.attention == "eager":
        probs = take("attn.probs", rebuild=lambda: attention_probs(q, k, stat))  # (B, H, T, T)
        mask, dropped = None, probs
        if p > 0:
            mask = take("attn.probs_mask")  # (B, H, T, T) bool
            dropped = take("attn.probs_dropped", rebuild=lambda: dropout_forward(probs, mask, p))  # (B, H, T, T)
        return attention_backward(dout, q, k, v, probs, dropped, stat, mask, p)
    lse = take("attn.lse")  # (B, H, T)
    if cfg.attention == "tiled":
        seed = take("attn.dropout_seed") if p > 0 else None  # ()
        tile = cfg.attention_tile
        return tiled_attention_backward(dout, q, k, v, out, lse, stat, tile, tile, p, seed, recomputing)
    return fused_attention_backward(dout, q, k, v, out, lse)

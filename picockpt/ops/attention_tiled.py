"""Causal grouped-query attention as FlashAttention-2 does it, written out in PyTorch (Dao 2023).

Never materialises the (T, T) probabilities. The forward walks over tiles of query rows and, for each, over the tiles of
key rows at or before them (tiles wholly above the diagonal are skipped: causal), keeping a running row max m and row
sum l of exp(S - m) (the online softmax). It stores only what the backward needs: q, k, v, the output O and one
log-sum-exp per row, lse = m + log l, O(B*H*T) numbers instead of B*H*T^2. The backward walks the same tiles again and
*recomputes* each tile of probabilities from q, k and lse,

    S = q_i k_j^T / sqrt(hd),   P = exp(S - lse_i)           (exactly the softmax of the forward)

which is selective recomputation, done inside the op: the attention core's s^2 tensors are
rebuilt at the price of one extra q k^T, tile by tile, and no more than one tile pair of T x T
values is alive at any moment. The softmax backward needs rowsum(dP * P) per row; with
O = P V it equals D = rowsum(dO * O), computed once from the stored output (also with dropout).

Grouped-query attention: as in attention.py, the G = H / KV query heads of a group are stacked
as G*t rows that read the same key/value tile.

Dropout on the probabilities: no mask is stored either. One random base seed (a tiny int64
tensor, drawn from the device's default generator, so the engine's RNG replay redraws the same
one) makes a generator per tile pair, and the backward regenerates each tile's mask from it.
"""
import contextlib

import torch


def tile_pairs(T, tile_q, tile_k, causal=True, keys=None):
    """The (query tile, key tile) pairs causal attention computes, in forward order:
    [(i, i0, i1, j, j0, j1)], rows i0..i1-1 against keys j0..j1-1, every key tile that starts at or
    before the tile's last query row (a key tile entirely above the diagonal is skipped).
    causal=False: every tile of `keys` key rows (default T), for keys that all come before the queries
    (context parallelism's blocks of earlier tokens, picockpt/parallel/context_parallel/cp_attention.py)."""
    keys = T if keys is None else keys
    rows = [(i, i0, min(i0 + tile_q, T)) for i, i0 in enumerate(range(0, T, tile_q))]  # the query tiles
    return [(i, i0, i1, j, j0, min(j0 + tile_k, keys)) for i, i0, i1 in rows
            for j, j0 in enumerate(range(0, i1 if causal else keys, tile_k))]


def _rows(x, i0, i1):
    # (B, KV, G, T, n) -> the query rows i0..i1-1 of every head of each group: (B, KV, G*t, n)
    B, KV, G, _, n = x.shape
    return x[:, :, :, i0:i1].reshape(B, KV, G * (i1 - i0), n)


def _causal(scores, i0, i1, j0, j1, G):
    """-inf where key j > query row i (only tiles that cross the diagonal have any)."""
    if j1 - 1 <= i0:
        return scores  # every key of the tile is at or before every row: nothing to hide
    rows = torch.arange(i0, i1, device=scores.device).repeat(G)  # (G*t,) the position of each stacked row
    cols = torch.arange(j0, j1, device=scores.device)  # (u,)
    return scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))  # (B, KV, G*t, u)


def tile_mask(seed, pair_index, shape, p, device):
    """The dropout mask of one tile pair, regenerated from the base seed, a host int (True: kept)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 2**20 + pair_index)  # one stream per tile pair; no device read here
    return torch.rand(shape, generator=generator, device=device) >= p  # (shape) bool


def draw_seed(device):
    """The base seed of one attention call's dropout masks, from the default generator (replayable)."""
    return torch.randint(0, 2**31, (), device=device)  # () int64: the only "mask" stored


def tiled_attention_forward(q, k, v, stat_dtype, tile_q=128, tile_k=128, p=0.0, seed=None, causal=True):
    """q (B, H, T, hd), k/v (B, KV, T, hd) -> out (B, H, T, hd), lse (B, H, T) in stat_dtype.
    causal=False: no mask, every row sees all Tk keys of k/v (B, KV, Tk, hd) (see tile_pairs)."""
    B, H, T, hd = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    G = H // KV
    qg = q.view(B, KV, G, T, hd)  # (B, KV, G, T, hd) the heads of a group side by side
    out = torch.empty_like(qg)  # (B, KV, G, T, hd)
    lse = torch.empty(B, KV, G, T, dtype=stat_dtype, device=q.device)  # (B, KV, G, T)
    scale = hd ** -0.5
    seed = int(seed) if p > 0 else None  # the stored () tensor read once per call (one host sync), not per tile
    index = 0  # the tile pair's number, in tile_pairs() order: its dropout stream
    for i0 in range(0, T, tile_q):  # a tile of query rows ...
        i1 = min(i0 + tile_q, T)
        q_i = _rows(qg, i0, i1)  # (B, KV, G*t, hd)
        m = torch.full(q_i.shape[:-1], float("-inf"), dtype=stat_dtype, device=q.device)  # (B, KV, G*t) row max
        l = torch.zeros_like(m)  # (B, KV, G*t) row sum of exp(S - m)
        acc = torch.zeros(q_i.shape, dtype=stat_dtype, device=q.device)  # (B, KV, G*t, hd) sum of exp(S - m) v
        for j0 in range(0, i1 if causal else Tk, tile_k):  # ... against every key tile at or before its last row
            j1 = min(j0 + tile_k, Tk)
            scores = (q_i @ k[:, :, j0:j1].transpose(-1, -2)) * scale  # (B, KV, G*t, u) as eager: matmul dtype
            scores = _causal(scores.to(stat_dtype), i0, i1, j0, j1, G) if causal else scores.to(stat_dtype)
            m_new = torch.maximum(m, scores.amax(-1))  # (B, KV, G*t) finite: key 0 is in every row's first tile
            probs = torch.exp(scores - m_new[..., None])  # (B, KV, G*t, u) unnormalised, against the new max
            del scores
            correction = torch.exp(m - m_new)  # (B, KV, G*t) rescales what was summed under the old max
            l = l * correction + probs.sum(-1)  # (B, KV, G*t)
            if p > 0:  # dropout acts on the probabilities; l, the softmax's denominator, is taken before it
                probs = probs * tile_mask(seed, index, probs.shape, p, q.device) / (1 - p)  # (B, KV, G*t, u)
            acc = acc * correction[..., None] + (probs.to(v.dtype) @ v[:, :, j0:j1]).to(stat_dtype)  # (B, KV, G*t, hd)
            del probs, correction
            m = m_new
            index += 1
        t = i1 - i0
        out[:, :, :, i0:i1] = (acc / l[..., None]).to(q.dtype).view(B, KV, G, t, hd)  # O = sum(P v) / sum(P)
        lse[:, :, :, i0:i1] = (m + torch.log(l)).view(B, KV, G, t)  # log sum_j exp(S_ij)
        del q_i, m, l, acc
    return out.view(B, H, T, hd), lse.view(B, H, T)


def tiled_attention_backward(dout, q, k, v, out, lse, stat_dtype, tile_q=128, tile_k=128, p=0.0, seed=None,
                             recomputing=contextlib.nullcontext, causal=True):
    """Gradients of O = dropout(P) V, P = softmax(S), S = q k^T / sqrt(hd), one tile pair at a time.

    Per tile pair (rows i, keys j), with P_ij recomputed from S_ij and lse_i:
        dV_j += (P_ij * Z / (1-p))^T dO_i           (Z: the tile's dropout mask, regenerated)
        dP_ij = (dO_i V_j^T) * Z / (1-p)
        dS_ij = P_ij * (dP_ij - D_i),   D_i = rowsum(dO_i * O_i)   (softmax backward)
        dQ_i += dS_ij K_j / sqrt(hd),   dK_j += dS_ij^T Q_i / sqrt(hd)
    Sums over the G heads of a group happen inside the matmuls (they are rows of one matrix).
    `recomputing()` is a context manager around the rebuild of each tile (the tracker's
    "recompute" phase), so the FLOPs of the extra q k^T are counted apart. causal: as the forward's.
    """
    B, H, T, hd = q.shape
    KV = k.shape[1]
    G = H // KV
    scale = hd ** -0.5
    seed = int(seed) if p > 0 else None  # read once per call (one host sync), not per tile pair
    group = lambda x: x.reshape(B, KV, G, T, x.shape[-1])  # noqa: E731 (B, H, T, n) -> (B, KV, G, T, n)
    qg, dog = group(q), group(dout)  # (B, KV, G, T, hd) each
    D = (dout.to(stat_dtype) * out.to(stat_dtype)).sum(-1)  # (B, H, T) rowsum(dO * O)
    Dg, lse_g = D.view(B, KV, G, T, 1), lse.reshape(B, KV, G, T, 1)  # (B, KV, G, T, 1) each
    dq = torch.zeros(qg.shape, dtype=stat_dtype, device=q.device)  # (B, KV, G, T, hd)
    dk = torch.zeros(k.shape, dtype=stat_dtype, device=q.device)  # (B, KV, T, hd)
    dv = torch.zeros(v.shape, dtype=stat_dtype, device=q.device)  # (B, KV, T, hd)
    pairs = list(enumerate(tile_pairs(T, tile_q, tile_k, causal, k.shape[2])))
    for index, (i, i0, i1, j, j0, j1) in sorted(pairs, key=lambda pair: pair[1][3]):  # key tiles outer (FA-2)
        q_i, do_i = _rows(qg, i0, i1), _rows(dog, i0, i1)  # (B, KV, G*t, hd) each
        with recomputing():  # S and P of this tile again, from q, k and lse: the recomputation
            scores = (q_i @ k[:, :, j0:j1].transpose(-1, -2)) * scale  # (B, KV, G*t, u)
            scores = _causal(scores.to(stat_dtype), i0, i1, j0, j1, G) if causal else scores.to(stat_dtype)
            probs = torch.exp(scores - _rows(lse_g, i0, i1))  # (B, KV, G*t, u) the forward's P, exactly
            del scores
        mask = tile_mask(seed, index, probs.shape, p, q.device) if p > 0 else None  # (B, KV, G*t, u) bool
        dropped = probs if mask is None else probs * mask / (1 - p)  # (B, KV, G*t, u)
        dv[:, :, j0:j1] += (dropped.to(v.dtype).transpose(-1, -2) @ do_i).to(stat_dtype)  # (B, KV, u, hd)
        del dropped
        dprobs = (do_i @ v[:, :, j0:j1].transpose(-1, -2)).to(stat_dtype)  # (B, KV, G*t, u) d(dropped P)
        if mask is not None:
            dprobs = dprobs * mask / (1 - p)  # (B, KV, G*t, u) dropout backward
        dscores = (probs * (dprobs - _rows(Dg, i0, i1))).to(q.dtype) * scale  # (B, KV, G*t, u)
        del probs, dprobs, mask
        t = i1 - i0
        dq[:, :, :, i0:i1] += (dscores @ k[:, :, j0:j1]).to(stat_dtype).view(B, KV, G, t, hd)  # (B, KV, G, t, hd)
        dk[:, :, j0:j1] += (dscores.transpose(-1, -2) @ q_i).to(stat_dtype)  # (B, KV, u, hd)
        del dscores
    return dq.view(B, H, T, hd).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def tiled_dropout_mask(seed, shape, p, tile_q, tile_k, device="cpu"):
    """The whole (B, H, T, T) mask the tiles drew (False above the diagonal and where dropped): for
    tests and lessons that compare with eager attention under the very same mask."""
    B, H, T, _ = shape
    seed = int(seed)  # a () tensor or an int
    mask = torch.zeros(shape, dtype=torch.bool, device=device)  # (B, H, T, T)
    for index, (i, i0, i1, j, j0, j1) in enumerate(tile_pairs(T, tile_q, tile_k)):
        # the op draws (B, KV, G*t, u): the same numbers, in the same order, as (B, H, t, u)
        mask[:, :, i0:i1, j0:j1] = tile_mask(seed, index, (B, H, i1 - i0, j1 - j0), p, device)
    return mask

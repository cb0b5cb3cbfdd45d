"""Which slice of each weight a tensor-parallel rank holds, the checks that make the split possible, and the
gradients put back together under the full parameters' names.

Megatron-LM's split (Shoeybi et al. 2019), for t ranks, rank r:

    weight (HF name)                    shape       split           rank r holds
    self_attn.q_proj.weight             (h, h)      column-parallel rows of query heads r*H/t .. (r+1)*H/t - 1
    self_attn.k_proj / v_proj.weight    (KV*hd, h)  column-parallel rows of key/value heads r*KV/t ..
    self_attn.o_proj.weight             (h, h)      row-parallel    columns of the same query heads
    mlp.gate_proj / up_proj.weight      (f, h)      column-parallel rows r*f/t .. (r+1)*f/t - 1
    mlp.down_proj.weight                (h, f)      row-parallel    columns r*f/t ..
    model.embed_tokens.weight           (V, h)      vocab-parallel  rows (token ids) r*V/t .. (r+1)*V/t - 1
    lm_head.weight                      (V, h)      vocab-parallel  rows r*V/t ..
    the three RMSNorm weights           (h,)        replicated      all of it

A column-parallel linear y = x W^T splits W's rows: rank r computes its columns of y from the whole x. A row-parallel
one splits W's columns: rank r computes the partial product of its slice of x; the ranks' partial products sum to y.
With grouped-query attention query head j reads key/value head j // (H/KV), so rank r's query heads read just its
key/value heads: t must divide H and KV (Megatron replicates key/value heads beyond KV ranks; picockpt refuses).
"""
import torch

from ...params import EMBED, FINAL_NORM, HEAD, LAYER_NAMES, LayerWeights

SPLIT_DIM = LayerWeights(attn_norm=None, q=0, k=0, v=0, o=1, mlp_norm=None, gate=0, up=0, down=1)  # by role


def split_dim(name):
    """The dim a parameter is split along across ranks, or None for a replicated one."""
    if name in (EMBED, HEAD):
        return 0  # vocabulary rows
    if name == FINAL_NORM:
        return None
    role = LAYER_NAMES._fields[LAYER_NAMES.index(name.split(".", 3)[3])]  # "model.layers.{i}.<name>" -> role
    return getattr(SPLIT_DIM, role)


def shard_params(params, rank, tp, device=None):
    """{name: rank's slice} of every parameter (a copy of its own, so the full tensors can go)."""
    dims = {name: split_dim(name) for name in params}
    shards = {name: tensor if dims[name] is None else tensor.chunk(tp, dims[name])[rank]  # (.., n/t, ..) a view
              for name, tensor in params.items()}
    return {name: shard.to(device).clone() if device is not None else shard.clone() for name, shard in shards.items()}


def gather_grads(per_rank, params):
    """Every rank's gradient slices -> full gradients under the params' names, in their order (replicated: rank 0's)."""
    dims = {name: split_dim(name) for name in params}
    return {name: per_rank[0][name] if dim is None else torch.cat([g[name] for g in per_rank], dim)  # (full shape)
            for name, dim in dims.items()}


def check_tensor_parallel(cfg, tp, sp=False, seq=None, distribute_saved=False):
    """ValueError naming the parameter, the value and what would work, for every split that cannot be."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r}: use a whole number of tensor-parallel ranks, 1 or more")
    if getattr(cfg, "experts", 0):
        raise ValueError(f"Config.experts={cfg.experts}: tensor parallelism here splits the dense MLP; a mixture "
                         f"of experts is not split over tensor-parallel ranks: split its experts over ranks with "
                         f"expert parallelism (ep=N, --ep N), or use experts=0")
    H, KV = cfg.heads, cfg.kv_heads
    fits = [t for t in range(1, KV + 1) if H % t == 0 and KV % t == 0 and cfg.ffn % t == 0 and cfg.vocab % t == 0]
    if tp > KV:
        raise ValueError(f"tp={tp} is larger than allowed: at most kv_heads={KV} ranks (heads={H}), since every "
                         f"rank computes whole key/value heads; use tp in {fits}")
    if H % tp or KV % tp:
        raise ValueError(f"tp={tp} must divide both heads={H} and kv_heads={KV} (each rank computes whole query "
                         f"heads and the key/value heads they read); use tp in {fits}")
    for name, what in (("ffn", "the MLP is"), ("vocab", "the embedding and LM head are")):
        if getattr(cfg, name) % tp:
            raise ValueError(f"tp={tp} does not divide {name}={getattr(cfg, name)}: {what} split in t equal parts; "
                             f"use tp in {fits}, or {name} a multiple of {tp}")
    if sp and seq is not None and seq % tp:
        raise ValueError(f"seq={seq} is not divisible by tp={tp}: sequence parallelism gives each rank seq/tp "
                         f"tokens; use a seq that is a multiple of {tp}, or sp=False")
    if sp and distribute_saved:
        raise ValueError("distribute_saved=True with sp=True: under sequence parallelism every layer input is "
                         "already split over the ranks; use distribute_saved with sp=False only")
    if tp > 1 and cfg.attention == "tiled" and cfg.dropout > 0:
        raise ValueError(f"attention='tiled' with dropout={cfg.dropout} and tp={tp}: each tile's mask comes from a "
                         f"generator seeded by the tile's index at the shape of a rank's heads, so no rank's masks "
                         f"equal a slice of the single process's; use attention='eager' (its masks are sliced from "
                         f"the single process's), dropout=0, or tp=1")
    return tp

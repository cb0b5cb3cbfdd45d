"""Which slice of each weight a tensor-parallel rank holds, the checks that make the split possible, and the gradients
put back together under the full parameters' names.

Megatron-LM's split (Shoeybi et al. 2019), for t ranks, rank r:

    weight (HF name)                    shape       split           rank r holds
    self_attn.q_proj.weight             (h, h)      column-parallel rows of query heads r*H/t .. (r+1)*H/t - 1
    self_attn.k_proj / v_proj.weight    (KV*hd, h)  column-parallel rows of key/value heads r*KV/t ..
    self_attn.o_proj.weight             (h, h)      row-parallel    columns of the same query heads
    mlp.gate_proj / up_proj.weight      (f, h)      column-parallel rows r*f/t .. (r+1)*f/t - 1
    mlp.down_proj.weight                (h, f)      row-parallel    columns r*f/t ..
    model.embed_tokens.weight, lm_head  (V, h)      vocab-parallel  rows (token ids) r*V/t .. (r+1)*V/t - 1
    the three RMSNorm weights           (h,)        replicated      all of it
  with a mixture of experts, every expert split as the MLP is (Megatron's expert tensor parallelism):
    mlp.experts.gate_up_proj            (E, 2f, h)  column-parallel rows r*f/t .. of its gate half and of its up half
    mlp.experts.down_proj               (E, h, f)   row-parallel    columns r*f/t ..
    mlp.shared_experts.* (fs)                       as the MLP's gate, up, down
    mlp.gate.weight (the router)        (E, h)      replicated      all of it (its gradient summed: tp_layer.py)

A column-parallel linear splits W's rows: rank r computes its columns of y from the whole x. A row-parallel one splits
W's columns: the ranks' partial products sum to y. Query head j reads key/value head j // (H/KV), so t must divide H and
KV (Megatron replicates key/value heads beyond KV ranks; picockpt refuses)."""
import torch

from ...model.params import EMBED, FINAL_NORM, HEAD, ROLE_NAMES
from ..refusals import refuse_tiled_dropout

SPLIT_DIM = dict(attn_norm=None, q=0, k=0, v=0, o=1, mlp_norm=None, gate=0, up=0, down=1, router=None,
                 experts_gate_up=1, experts_down=2, shared_gate=0, shared_up=0, shared_down=1)  # by role
ROLES = {name: role for role, name in ROLE_NAMES.items()}
HALVES = "mlp.experts.gate_up_proj"  # [gate; up] along dim 1: a rank's slice of each half


def slice_of(tensor, name, rank, tp):
    """rank's slice of a parameter (a view; of [gate; up] its rows of each half, side by side: a copy)."""
    dim = split_dim(name)
    if dim is None:
        return tensor
    if name.endswith(HALVES):
        return torch.cat([half.chunk(tp, dim)[rank] for half in tensor.chunk(2, dim)], dim)
    return tensor.chunk(tp, dim)[rank]


def split_dim(name):
    """The dim a parameter is split along across ranks, or None for a replicated one."""
    if name in (EMBED, HEAD, FINAL_NORM):
        return None if name == FINAL_NORM else 0  # replicated, or the vocabulary's rows
    return SPLIT_DIM[ROLES[name.split(".", 3)[3]]]  # "model.layers.{i}.<name>" -> its role's dim


def shard_params(params, rank, tp):
    """{name: rank's slice} of every parameter (a copy of its own, so the full tensors can go)."""
    return {name: slice_of(tensor, name, rank, tp).clone() for name, tensor in params.items()}  # (.., n/t, ..)


def gather_grads(per_rank, params):
    """Every rank's gradient slices -> full gradients under the params' names, in their order (replicated: rank 0's)."""
    def whole(name, dim):
        if name.endswith(HALVES):  # every rank's gate rows, then every rank's up rows
            return torch.cat([torch.cat([g[name].chunk(2, dim)[half] for g in per_rank], dim) for half in (0, 1)], dim)
        return torch.cat([g[name] for g in per_rank], dim)
    return {name: per_rank[0][name] if split_dim(name) is None else whole(name, split_dim(name)) for name in params}


def check_tensor_parallel(cfg, tp, sp=False, seq=None, distribute_saved=False, experts=False):
    """ValueError naming the parameter, the value and what would work, for every split that cannot be. experts:
    the caller splits a mixture of experts too (a parallel job does; the closed forms of predict's tables not)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r}: use a whole number of tensor-parallel ranks, 1 or more")
    if getattr(cfg, "experts", 0) and experts and cfg.shared_expert_ffn % tp:
        raise ValueError(f"tp={tp} does not divide shared_expert_ffn={cfg.shared_expert_ffn}: the shared expert is "
                         f"split as the MLP is; use a tp that divides it")
    if getattr(cfg, "experts", 0) and not experts:
        raise ValueError(f"Config.experts={cfg.experts}: these tensor-parallel closed forms split the dense MLP; a "
                         f"mixture of experts split over tp (each expert's f, beside ep) runs as a parallel job "
                         f"(`python -m picockpt parallel --ep N --tp t`), not here; or use experts=0")
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
    if tp > 1:
        refuse_tiled_dropout(cfg, f"tp={tp}", "the shape of a rank's heads", "equal a slice of the", "tp=1",
                             eager=" (its masks are sliced from the single process's)")
    return tp

"""Closed forms: the bytes picockpt stores and the FLOPs it computes, from the shape alone.

These are the formulas the tests and notebooks hold the engine to, exactly, for every attention
kind (eager / tiled / fused, picockpt/attention.py) and loss chunking (picockpt/head.py):

    layer_inventory(cfg, B, T, drop)    name -> (shape, dtype, bytes) of one stored layer
    predicted_peak_bytes(cfg, B, T, p)  the activation store's peak during one step
    step_flops(cfg, B, T, p)            matmul FLOPs of forward / recompute / backward

With X the bytes of one layer input (B*T*h*e), A the bytes of one fully stored layer
(input included), F the model-level bytes (final norm and logits), and segments of
C layers (n = ceil(L/C) of them, the k-th holding n_k layers):

    store everything      peak = L*A + F                         (end of the forward)
    every:C (full: C=1)   peak = max( n*X + F,                   (end of the forward: checkpoints + F)
                                      max_k (k*X + n_k*A) )      (segment k just recomputed, below it
                                                                  the k checkpoints of segments 0..k-1)
"""
import math

from .policy import parse_policy

_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "bool": 1, "int64": 8}


def layer_inventory(cfg, batch, seq, drop=frozenset()):
    """What one fully stored layer keeps (including its input, the checkpoint)."""
    B, T, h, f = batch, seq, cfg.hidden, cfg.ffn
    H, KV, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
    act, stat = cfg.dtype, str(cfg.stat_dtype).replace("torch.", "")
    rows = [("input", (B, T, h), act), ("attn_norm.rstd", (B, T, 1), stat), ("attn_norm.output", (B, T, h), act),
            ("attn.q", (B, H, T, hd), act), ("attn.k", (B, KV, T, hd), act), ("attn.v", (B, KV, T, hd), act)]
    if cfg.attention == "eager":  # the T x T probabilities (and their dropout mask and result)
        rows += [("attn.probs", (B, H, T, T), act)]
        if cfg.dropout > 0:
            rows += [("attn.probs_mask", (B, H, T, T), "bool"), ("attn.probs_dropped", (B, H, T, T), act)]
    else:  # tiled / fused: one log-sum-exp per row; tiled's dropout keeps one seed, not a mask
        rows += [("attn.lse", (B, H, T), stat)]
        if cfg.dropout > 0:
            rows += [("attn.dropout_seed", (), "int64")]
    rows += [("attn.context", (B, T, h), act)]
    if cfg.dropout > 0:
        rows += [("attn.dropout_mask", (B, T, h), "bool")]
    rows += [("mlp_norm.input", (B, T, h), act), ("mlp_norm.rstd", (B, T, 1), stat),
             ("mlp_norm.output", (B, T, h), act), ("mlp.gate", (B, T, f), act), ("mlp.up", (B, T, f), act),
             ("mlp.act", (B, T, f), act)]
    if cfg.dropout > 0:
        rows += [("mlp.dropout_mask", (B, T, h), "bool")]
    return {name: (shape, dtype, math.prod(shape) * _BYTES[dtype]) for name, shape, dtype in rows
            if name not in drop}


def head_inventory(cfg, batch, seq, drop=frozenset()):
    """What the model keeps around the layers: final norm, and the logits (or, chunked, their log-sum-exp)."""
    B, T, h, act = batch, seq, cfg.hidden, cfg.dtype
    stat = str(cfg.stat_dtype).replace("torch.", "")
    rows = [("final_norm.input", (B, T, h), act), ("final_norm.rstd", (B, T, 1), stat),
            ("final_norm.output", (B, T, h), act)]
    if cfg.loss_chunk == 0:
        rows += [("lm_head.logits", (B, T, cfg.vocab), act)]
    else:  # chunked: the logits are recomputed chunk by chunk from final_norm.output and this
        rows += [("lm_head.lse", (B, T), stat)]
    return {name: (shape, dtype, math.prod(shape) * _BYTES[dtype]) for name, shape, dtype in rows
            if name not in drop}


def total(inventory):
    return sum(nbytes for _, _, nbytes in inventory.values())


def chain_sizes(cfg, batch, seq, drop=frozenset()):
    """(X, A, F): one layer input, one fully stored layer, the model-level tensors."""
    layer = layer_inventory(cfg, batch, seq, drop)
    return layer["input"][2], total(layer), total(head_inventory(cfg, batch, seq, drop))


def predicted_peak_bytes(cfg, batch, seq, policy):
    """The exact peak of the activation store over one step under `policy`."""
    policy = parse_policy(policy, cfg)
    if policy.budget is not None:
        from .planner import plan_model
        return plan_model(cfg, batch, seq, policy.budget, policy.drop).peak_bytes
    X, A, F = chain_sizes(cfg, batch, seq, policy.drop)
    L = cfg.layers
    if policy.segment is None:
        return L * A + F
    C = policy.segment
    sizes = [min(C, L - start) for start in range(0, L, C)]  # layers per segment
    return max(len(sizes) * X + F, max(k * X + n_k * A for k, n_k in enumerate(sizes)))


def attention_matmul_flops(cfg, batch, seq):
    """FLOPs of one of the attention core's two T x T matmuls (q k^T, or P v) in one layer's forward.
    eager and fused compute the whole square (the causal half is masked, not skipped); tiled skips
    the key tiles wholly above the diagonal, so it computes the tile pairs of tile_pairs()."""
    factor = 2 * batch * cfg.heads * cfg.head_dim
    if cfg.attention != "tiled":
        return factor * seq * seq
    from .ops.attention_tiled import tile_pairs
    tile = cfg.attention_tile
    return factor * sum((i1 - i0) * (j1 - j0) for _, i0, i1, _, j0, j1 in tile_pairs(seq, tile, tile))


def layer_flops(cfg, batch, seq):
    """Matmul FLOPs (2 per multiply-add) of one layer's forward, by part."""
    BT, h, f = batch * seq, cfg.hidden, cfg.ffn
    core = attention_matmul_flops(cfg, batch, seq)
    return {"qkvo": 2 * BT * h * (2 * h + 2 * cfg.kv_dim), "mlp": 2 * BT * h * f * 3,
            "scores": core,   # q k^T
            "values": core}   # P v


def inner_recompute_flops(cfg, batch, seq):
    """(per layer, head): what the backward recomputes inside an op whatever the policy, counted as
    "recompute": tiled attention's q k^T of every tile, and a chunked head's logits (2 B T h V)."""
    layer = layer_flops(cfg, batch, seq)["scores"] if cfg.attention == "tiled" else 0
    head = 2 * batch * seq * cfg.hidden * cfg.vocab if cfg.loss_chunk else 0
    return layer, head


def step_flops(cfg, batch, seq, policy="none"):
    """forward, recompute, backward matmul FLOPs of one step (what FlopCounterMode counts).
    Backward is 2x forward for every matmul y = a b (it needs da = dy b^T and db = a^T dy), but for
    fused attention: its kernel's backward counts 5 T x T matmuls against the forward's 2, the fifth
    being the q k^T it recomputes inside (FlopCounterMode cannot see it apart, so it stays "backward");
    tiled attention's recomputed q k^T is counted as "recompute" (inner_recompute_flops)."""
    policy = parse_policy(policy, cfg)
    parts = layer_flops(cfg, batch, seq)
    layer = sum(parts.values())
    head = 2 * batch * seq * cfg.hidden * cfg.vocab
    forward = cfg.layers * layer + head
    backward = 2 * forward + (cfg.layers * parts["scores"] if cfg.attention == "fused" else 0)
    inner_layer, inner_head = inner_recompute_flops(cfg, batch, seq)
    if policy.budget is not None:
        from .planner import plan_model
        recompute = plan_model(cfg, batch, seq, policy.budget, policy.drop).recompute_flops
    else:
        rebuild = parts["scores"] if "attn.probs" in policy.drop and cfg.attention == "eager" else 0
        recomputed_layers = 0 if policy.segment is None else cfg.layers  # every layer once
        recompute = recomputed_layers * layer + cfg.layers * (rebuild + inner_layer) + inner_head
    return {"forward": forward, "recompute": recompute, "backward": backward}

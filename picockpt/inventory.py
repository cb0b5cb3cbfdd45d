"""Closed forms: the bytes picockpt stores and the FLOPs it computes, from the shape alone.

These are the formulas the tests and notebooks hold the engine to, exactly:

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

_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "bool": 1}


def layer_inventory(cfg, batch, seq, drop=frozenset()):
    """What one fully stored layer keeps (including its input, the checkpoint)."""
    B, T, h, f = batch, seq, cfg.hidden, cfg.ffn
    H, KV, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
    act, stat = cfg.dtype, str(cfg.stat_dtype).replace("torch.", "")
    rows = [("input", (B, T, h), act), ("attn_norm.rstd", (B, T, 1), stat), ("attn_norm.output", (B, T, h), act),
            ("attn.q", (B, H, T, hd), act), ("attn.k", (B, KV, T, hd), act), ("attn.v", (B, KV, T, hd), act),
            ("attn.probs", (B, H, T, T), act)]
    if cfg.dropout > 0:
        rows += [("attn.probs_mask", (B, H, T, T), "bool"), ("attn.probs_dropped", (B, H, T, T), act)]
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
    """What the model keeps around the layers: final norm and logits."""
    B, T, h, act = batch, seq, cfg.hidden, cfg.dtype
    stat = str(cfg.stat_dtype).replace("torch.", "")
    rows = [("final_norm.input", (B, T, h), act), ("final_norm.rstd", (B, T, 1), stat),
            ("final_norm.output", (B, T, h), act), ("lm_head.logits", (B, T, cfg.vocab), act)]
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


def layer_flops(cfg, batch, seq):
    """Matmul FLOPs (2 per multiply-add) of one layer's forward, by part."""
    BT, h, f, T = batch * seq, cfg.hidden, cfg.ffn, seq
    return {"qkvo": 2 * BT * h * (2 * h + 2 * cfg.kv_dim), "mlp": 2 * BT * h * f * 3,
            "scores": 2 * batch * cfg.heads * T * T * cfg.head_dim,  # q k^T
            "values": 2 * batch * cfg.heads * T * T * cfg.head_dim}  # P v


def step_flops(cfg, batch, seq, policy="none"):
    """forward, recompute, backward matmul FLOPs of one step (what FlopCounterMode counts).
    Backward is exactly 2x forward: each matmul y = a b needs da = dy b^T and db = a^T dy."""
    policy = parse_policy(policy, cfg)
    parts = layer_flops(cfg, batch, seq)
    layer = sum(parts.values())
    head = 2 * batch * seq * cfg.hidden * cfg.vocab
    forward = cfg.layers * layer + head
    rebuild = parts["scores"] if "attn.probs" in policy.drop else 0  # selective/cheap rebuild q k^T
    if policy.budget is not None:
        from .planner import plan_model
        plan = plan_model(cfg, batch, seq, policy.budget, policy.drop)
        recompute = plan.recompute_flops
    else:
        recomputed_layers = 0 if policy.segment is None else cfg.layers  # every layer once
        recompute = recomputed_layers * layer + cfg.layers * rebuild
    return {"forward": forward, "recompute": recompute, "backward": 2 * forward}

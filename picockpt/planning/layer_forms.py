"""Closed forms of one layer and of the head: the bytes each stored tensor takes, by name, and the FLOPs of each matmul,
from the shape alone. picockpt/planning/step_forms.py puts them together into a step's peak and FLOPs per phase (and
re-exports these); its docstring lists the formulas the tests and notebooks hold the engine to, exactly.

    layer_inventory(cfg, B, T, unstored)    name -> (shape, dtype, bytes) of one stored layer

Mixture-of-experts layers (Config.experts > 0, picockpt/model/moe.py) keep one set of tensors per expert that got
tokens, so their rows depend on the step's per-expert token counts, which only the data decides: layer_inventory takes
them (`counts`, E ints summing to B*T*k; picockpt.model.routing.step_routing gives every layer's), predicted_peak_bytes
takes every layer's (`routing`). Without them the rows assume balanced routing (B*T*k/E tokens per expert, the remainder
to the first experts), and say so: the bytes per expert are then an assumption. The totals are not: every token is kept
k times, whichever experts it goes to, and no token is dropped (no capacity limit, as in Mixtral), so a layer's total,
the peak and the FLOPs are the same for every routing; the counts decide only how a layer's bytes split among its
experts (expert_bytes: what an expert-parallel rank would hold).
"""
import math

from ..model.config import BYTES


def dropped(name, unstored):
    """Is `name` dropped by `unstored`? An expert's tensor, "moe.act[3]", goes with its kind, "moe.act"."""
    return name.partition("[")[0] in unstored


def balanced_counts(cfg, batch, seq):
    """Tokens per expert under balanced routing: the B*T*k (token, expert) pairs spread evenly."""
    pairs, E = batch * seq * cfg.experts_per_token, cfg.experts
    return [pairs // E + (1 if e < pairs % E else 0) for e in range(E)]


def check_counts(cfg, batch, seq, counts):
    """counts: E whole numbers, each at most B*T (a token goes to an expert at most once), summing to B*T*k."""
    N, E, k = batch * seq, cfg.experts, cfg.experts_per_token
    if (not isinstance(counts, (list, tuple)) or len(counts) != E
            or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= N for n in counts)
            or sum(counts) != N * k):
        raise ValueError(f"counts={counts!r}: give the tokens routed to each of the E={E} experts, E whole numbers "
                         f"from 0 to B*T={N} summing to B*T*k={N * k} "
                         f"(e.g. picockpt.model.routing.step_routing(...)[layer])")
    return list(counts)


def layer_inventory(cfg, batch, seq, unstored=frozenset(), counts=None):
    """What one fully stored layer keeps (including its input, the checkpoint). A mixture-of-experts
    layer keeps one row per expert that got tokens: `counts` (E ints) says how many each got; None
    assumes balanced routing (balanced_counts)."""
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
             ("mlp_norm.output", (B, T, h), act)]
    if cfg.experts:
        rows += _moe_rows(cfg, B, T, counts)
    else:
        rows += [("mlp.gate", (B, T, f), act), ("mlp.up", (B, T, f), act), ("mlp.act", (B, T, f), act)]
    if cfg.dropout > 0:
        rows += [("mlp.dropout_mask", (B, T, h), "bool")]
    return {name: (shape, dtype, math.prod(shape) * BYTES[dtype]) for name, shape, dtype in rows
            if not dropped(name, unstored)}


def _moe_rows(cfg, B, T, counts):
    """The rows of picockpt/model/moe.py's table: the router's, then each expert's that got tokens, the shared one's."""
    N, h, f, fs, act = B * T, cfg.hidden, cfg.ffn, cfg.shared_expert_ffn, cfg.dtype
    counts = balanced_counts(cfg, B, T) if counts is None else check_counts(cfg, B, T, counts)
    rows = [("moe.jitter", (B, T, h), act)] if cfg.router_jitter > 0 else []
    rows += [("moe.router_probs", (N, cfg.experts), str(cfg.stat_dtype).replace("torch.", "")),
             ("moe.expert_index", (N, cfg.experts_per_token), "int64")]
    for e, n in enumerate(counts):
        if n:
            rows += [(f"moe.gate_up[{e}]", (n, 2 * f), act), (f"moe.act[{e}]", (n, f), act)]
    if fs:
        rows += [("moe.shared_gate", (N, fs), act), ("moe.shared_up", (N, fs), act), ("moe.shared_act", (N, fs), act)]
    return rows


def counts_from_puts(cfg, puts, layer):
    """Tokens per expert of one layer as the store saw them: puts is (layer, name) -> bytes of every put
    (measure.PutRecorder); expert e's moe.gate_up[e] has n_e rows of 2f elements, none if it got no token.
    Needs the gate/up projections stored (any policy but moe)."""
    row = 2 * cfg.ffn * BYTES[cfg.dtype]
    return [puts.get((layer, f"moe.gate_up[{e}]"), 0) // row for e in range(cfg.experts)]


def expert_bytes(cfg, batch, seq, counts=None, unstored=frozenset()):
    """[bytes] each expert's tensors take in one stored layer: what an expert-parallel rank holding that
    expert alone would keep of it (besides the tensors every rank has). counts None: balanced."""
    inventory = layer_inventory(cfg, batch, seq, unstored, counts)
    return [sum(nbytes for name, (_, _, nbytes) in inventory.items() if name.endswith(f"[{e}]"))
            for e in range(cfg.experts)]


def head_inventory(cfg, batch, seq, unstored=frozenset()):
    """What the model keeps around the layers: final norm, and the logits (or, chunked, their log-sum-exp)."""
    B, T, h, act, stat = batch, seq, cfg.hidden, cfg.dtype, str(cfg.stat_dtype).replace("torch.", "")
    rows = [("final_norm.input", (B, T, h), act), ("final_norm.rstd", (B, T, 1), stat),
            ("final_norm.output", (B, T, h), act)]
    if cfg.loss_chunk == 0:
        rows += [("lm_head.logits", (B, T, cfg.vocab), act)]
    else:  # chunked: the logits are recomputed chunk by chunk from final_norm.output and this
        rows += [("lm_head.lse", (B, T), stat)]
    return {name: (shape, dtype, math.prod(shape) * BYTES[dtype]) for name, shape, dtype in rows
            if not dropped(name, unstored)}


def total(inventory):
    return sum(nbytes for _, _, nbytes in inventory.values())


def chain_sizes(cfg, batch, seq, unstored=frozenset()):
    """(X, A, F): one layer input, one fully stored layer, the model-level tensors."""
    layer = layer_inventory(cfg, batch, seq, unstored)
    return layer["input"][2], total(layer), total(head_inventory(cfg, batch, seq, unstored))


def attention_matmul_flops(cfg, batch, seq):
    """FLOPs of one of the attention core's two T x T matmuls (q k^T, or P v) in one layer's forward.
    eager and fused compute the whole square (the causal half is masked, not skipped); tiled skips
    the key tiles wholly above the diagonal, so it computes the tile pairs of tile_pairs()."""
    factor = 2 * batch * cfg.heads * cfg.head_dim
    if cfg.attention != "tiled":
        return factor * seq * seq
    from ..ops.attention_tiled import tile_pairs
    tile = cfg.attention_tile
    return factor * sum((i1 - i0) * (j1 - j0) for _, i0, i1, _, j0, j1 in tile_pairs(seq, tile, tile))


def layer_flops(cfg, batch, seq):
    """Matmul FLOPs (2 per multiply-add) of one layer's forward, by part. A mixture of experts: the
    router (h -> E per token), the experts (each token through k of them: B*T*k rows of gate/up and
    down, whatever the routing), the shared expert."""
    BT, h, f = batch * seq, cfg.hidden, cfg.ffn
    core = attention_matmul_flops(cfg, batch, seq)
    if not cfg.experts:
        mlp = {"mlp": 2 * BT * h * f * 3}
    else:
        mlp = {"router": 2 * BT * h * cfg.experts, "experts": 2 * BT * cfg.experts_per_token * h * f * 3,
               "shared_expert": 2 * BT * h * cfg.shared_expert_ffn * 3}
    return {"qkvo": 2 * BT * h * (2 * h + 2 * cfg.kv_dim), **mlp,
            "scores": core,   # q k^T
            "values": core}   # P v


def tail_flops(cfg, batch, seq):
    """The down projection(s) a recompute sweep's last layer skips (its output is not needed)."""
    BT, h = batch * seq, cfg.hidden
    if not cfg.experts:
        return 2 * BT * cfg.ffn * h
    return 2 * BT * h * (cfg.experts_per_token * cfg.ffn + cfg.shared_expert_ffn)


def rebuild_flops(cfg, batch, seq, unstored):
    """Matmul FLOPs one layer's backward spends rebuilding what `unstored` dropped: the q k^T of the
    attention probabilities (eager), the experts' gate/up projections (moe: B*T*k rows of h -> 2f), the
    shared expert's (shared_experts), the router's linear (router: B*T rows of h -> E). Norm outputs
    and SwiGLU products are rebuilt elementwise: 0."""
    BT, h, parts = batch * seq, cfg.hidden, layer_flops(cfg, batch, seq)
    flops = parts["scores"] if "attn.probs" in unstored and cfg.attention == "eager" else 0
    if cfg.experts and "moe.gate_up" in unstored:
        flops += 2 * BT * cfg.experts_per_token * h * 2 * cfg.ffn
    if cfg.experts and "moe.shared_gate" in unstored:
        flops += 2 * BT * h * 2 * cfg.shared_expert_ffn
    if cfg.experts and "moe.router_probs" in unstored:  # router: the router's linear again, h -> E
        flops += 2 * BT * h * cfg.experts
    return flops


def inner_recompute_flops(cfg, batch, seq):
    """(per layer, head): what the backward recomputes inside an op whatever the policy, counted as
    "recompute": tiled attention's q k^T of every tile, and a chunked head's logits (2 B T h V)."""
    layer = layer_flops(cfg, batch, seq)["scores"] if cfg.attention == "tiled" else 0
    head = 2 * batch * seq * cfg.hidden * cfg.vocab if cfg.loss_chunk else 0
    return layer, head


def segments_peak(inputs, layers, head, C, always=None):
    """The store's peak under every:C (full: C = 1), the one formula every layout uses: inputs[k] and
    layers[k] the bytes of layer k's checkpoint and of layer k stored whole (its input included), head
    the model-level bytes, segments of C layers; always[k]: what layer k's first forward keeps whatever
    its mode (an expert-parallel layer's routing; none elsewhere), included in layers[k]:
        peak = max( checkpoints + always + head,                       (end of the forward)
                    max_k ( checkpoints and always below segment k + its layers stored whole ) )"""
    always = always or [0] * len(layers)
    starts = range(0, len(layers), C)  # the first layer of each segment
    return max(sum(inputs[start] for start in starts) + sum(always) + head,
               max(sum(inputs[s] for s in starts if s < start) + sum(always[:start]) + sum(layers[start:start + C])
                   for start in starts))

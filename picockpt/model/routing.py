"""The routing of a whole step, for the closed forms and the lessons: what a forward routes, and routers
set by hand so that token ids alone decide each expert's load.

    step_routing(params, cfg, input_ids)   every layer's per-expert token counts in a forward
    route_by_token(params, cfg)            params whose routers send token v to experts v mod E, ...
    token_counts(cfg, input_ids)           the per-expert counts route_by_token's routers give
"""
import torch

from .layer import layer_forward
from ..ops import embedding_forward, rope_tables
from .params import EMBED, compute_weights, layer_key, layer_weights


def step_routing(params, cfg, input_ids, ranks=None):
    """The per-expert token counts of every layer in a forward of input_ids: a list of L lists of E ints
    (ranks=W: of L lists of W lists, one per expert-parallel rank's B/W sequences). Runs the first forward
    as the engine does (each layer's tensors seen, then let go): with router jitter, seed the generator the
    same way before this and before the step, and both route alike."""
    class Counter:  # a store that keeps nothing: it reads the routing decision as the layer keeps it
        def put(self, layer, name, tensor):
            if name == "moe.expert_index":  # (N, k), N = B*T tokens in batch order
                parts = tensor.view(ranks or 1, -1)  # (W, N k / W) rank r's tokens' pairs
                per_rank = [torch.bincount(part, minlength=cfg.experts).tolist() for part in parts]
                counts[layer] = per_rank if ranks else per_rank[0]

    counts = {}
    with torch.no_grad():
        weights = compute_weights(params, cfg)
        rope = rope_tables(cfg, input_ids.shape[1], input_ids.device, cfg.torch_dtype)  # (T, hd) x2
        x = embedding_forward(input_ids, weights[EMBED])  # (B, T, h)
        for i in range(cfg.layers):
            x = layer_forward(x, layer_weights(weights, i), cfg, rope, Counter(), i)  # (B, T, h)
    return [counts[i] for i in range(cfg.layers)]


def route_by_token(params, cfg, strength=20.0):
    """A copy of params whose routers send token id v to experts c, c+1, .., c+k-1 (mod E), c = v mod E,
    in every layer: routing set by the weights, so a batch's token ids alone decide each expert's count
    (balanced, skewed, all to one; token_counts). The embedding writes `strength` on coordinate c of
    token v, which then dominates the normed residual stream (about sqrt(h) there, small elsewhere); router
    row e reads coordinate c with weight 2^-j when e = c + j, j < k, and nothing else: expert c + j
    scores sqrt(h) 2^-j, the others about 0. Needs hidden >= experts."""
    E, k, V = cfg.experts, cfg.experts_per_token, cfg.vocab
    if not E or cfg.hidden < E:
        raise ValueError(f"route_by_token needs a mixture of experts with hidden >= experts, got experts={E}, "
                         f"hidden={cfg.hidden}")
    params = dict(params)
    embed = params[EMBED].clone()  # (V, h)
    device = embed.device  # the routers go where the embedding is (cuda too)
    tokens, experts = torch.arange(V, device=device), torch.arange(E, device=device)  # (V,), (E,)
    embed[tokens, tokens % E] += strength
    params[EMBED] = embed
    router = torch.zeros(E, cfg.hidden, dtype=embed.dtype, device=device)  # (E, h)
    for j in range(k):
        router[(experts + j) % E, experts] = 2.0 ** -j  # expert c + j reads coordinate c
    for i in range(cfg.layers):
        params[layer_key(i, "router")] = router.clone()
    return params


def token_counts(cfg, input_ids):
    """The per-expert token counts route_by_token's routers give input_ids: E ints."""
    E, k = cfg.experts, cfg.experts_per_token
    classes = torch.bincount(input_ids.flatten() % E, minlength=E)  # (E,) tokens of each class c
    return [sum(int(classes[(e - j) % E]) for j in range(k)) for e in range(E)]

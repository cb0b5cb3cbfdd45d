"""The same model as an ordinary autograd nn.Module: the oracle for gradients and the peer for torch.utils.checkpoint.

Written independently of picockpt/ops (plain torch ops, Hugging Face's repeat_kv for grouped-query attention), with the
same parameter names, so ReferenceLlama(cfg).load_state_dict(params) runs the very same weights. Dropout masks come from
the same helper and in the same order as in picockpt/model/layer.py, so with the same seed both draw the same masks; the
router jitter of a mixture of experts too.

Mixed precision as picockpt's params.compute_weights does it: at the start of each forward every fp32 master weight is
cast once to the activation dtype, and every use (a checkpoint's recomputation in the backward included) shares that
copy. (torch.autocast keeps its casts only until the forward's autocast region exits, so a checkpoint's recompute
casts again: lesson 21 counts it.) Cast at every use instead, autograd would save a fresh 16-bit copy of each
weight per layer call, and a memory comparison would count those copies as activations.

    model = ReferenceLlama(cfg, params)
    loss = model(input_ids, targets)                      # plain autograd
    loss = model(input_ids, targets, run_layers=per_layer_checkpoint)
    loss.backward(); model.release_weights()              # drop this step's 16-bit copies
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..ops import dropout_mask, rope_tables


class WeightCasts:
    """The compute copies of one model's master weights, for the step under way.

    make(weights) casts each weight to the activation dtype once (a copy with an autograd edge back to the fp32 weight,
    so its gradient arrives in fp32); casts(weight) returns that copy. In fp32 the "copy" is the weight itself. A weight
    used outside a step is cast where it is used."""

    def __init__(self, dtype):
        self.dtype, self.copies = dtype, {}  # copies: id(master weight) -> its compute copy

    def make(self, weights):
        self.copies = {}  # the previous step's copies go first: never two sets at once
        with torch.enable_grad():  # a graph back to the fp32 weights, even if the caller runs no_grad
            self.copies = {id(w): w.to(self.dtype) for w in weights}
        return list(self.copies.values())

    def __call__(self, weight):
        copy = self.copies.get(id(weight))
        return weight.to(self.dtype) if copy is None else copy

    def release(self):
        self.copies = {}


class RMSNorm(nn.Module):
    def __init__(self, cfg, casts):
        super().__init__()
        self.cfg, self.casts = cfg, casts
        self.weight = nn.Parameter(torch.ones(cfg.hidden, dtype=cfg.param_dtype))

    def forward(self, x):
        xs = x.to(self.cfg.stat_dtype)  # (B, T, h)
        xs = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)  # (B, T, h)
        return self.casts(self.weight) * xs.to(x.dtype)  # (B, T, h)


class Linear(nn.Module):
    def __init__(self, inp, out, cfg, casts):
        super().__init__()
        self.casts = casts
        self.weight = nn.Parameter(torch.zeros(out, inp, dtype=cfg.param_dtype))

    def forward(self, x):
        return F.linear(x, self.casts(self.weight))  # (..., out)


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg, casts):
        super().__init__()
        self.cfg = cfg
        h, kv = cfg.hidden, cfg.kv_dim
        self.q_proj, self.k_proj = Linear(h, h, cfg, casts), Linear(h, kv, cfg, casts)
        self.v_proj, self.o_proj = Linear(h, kv, cfg, casts), Linear(h, h, cfg, casts)

    def forward(self, x):
        cfg, (B, T, h) = self.cfg, x.shape
        H, KV, hd, p = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dropout
        cos, sin = rope_tables(cfg, T, x.device, x.dtype)  # (T, hd)
        q = self.q_proj(x).view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.v_proj(x).view(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=1)  # (B, H, T, hd) as HF's repeat_kv
        v = v.repeat_interleave(H // KV, dim=1)  # (B, H, T, hd)
        scores = (q @ k.transpose(-1, -2)) * hd ** -0.5  # (B, H, T, T)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=cfg.stat_dtype).to(x.dtype)  # (B, H, T, T)
        if p > 0:
            probs = probs * dropout_mask((B, H, T, T), p, x.device) / (1 - p)
        out = (probs @ v).transpose(1, 2).reshape(B, T, h)  # (B, T, h)
        out = self.o_proj(out)
        if p > 0:
            out = out * dropout_mask((B, T, h), p, x.device) / (1 - p)
        return out


class MLP(nn.Module):
    def __init__(self, cfg, casts):
        super().__init__()
        self.cfg = cfg
        h, f = cfg.hidden, cfg.ffn
        self.gate_proj, self.up_proj = Linear(h, f, cfg, casts), Linear(h, f, cfg, casts)
        self.down_proj = Linear(f, h, cfg, casts)

    def forward(self, x):
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, h)
        p = self.cfg.dropout
        if p > 0:
            out = out * dropout_mask(out.shape, p, x.device) / (1 - p)
        return out


class Experts(nn.Module):
    """E SwiGLU experts as Hugging Face's MixtralExperts holds them: 3-d tensors, [gate; up] fused."""

    def __init__(self, cfg, casts):
        super().__init__()
        self.casts, f, h, E = casts, cfg.ffn, cfg.hidden, cfg.experts
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * f, h, dtype=cfg.param_dtype))
        self.down_proj = nn.Parameter(torch.zeros(E, h, f, dtype=cfg.param_dtype))

    def forward(self, e, x):
        gate, up = F.linear(x, self.casts(self.gate_up_proj)[e]).chunk(2, dim=-1)  # (n, f) each
        return F.linear(F.silu(gate) * up, self.casts(self.down_proj)[e])  # (n, h)


class SharedExpert(MLP):
    """An always-on SwiGLU of its own width (DeepSeek's names: shared_experts.gate_proj ...)."""

    def __init__(self, cfg, casts):
        super().__init__(cfg.replace(ffn=cfg.shared_expert_ffn, dropout=0.0), casts)


class MoE(nn.Module):
    """Mixtral's sparse MoE block: jitter, router (fp32 softmax, top-k, renormalised), the experts on their
    tokens, weighted sum (and a shared expert). Autograd differentiates through topk's values."""

    def __init__(self, cfg, casts):
        super().__init__()
        self.cfg = cfg
        self.gate = Linear(cfg.hidden, cfg.experts, cfg, casts)  # the router
        self.experts = Experts(cfg, casts)
        if cfg.shared_expert_ffn:
            self.shared_experts = SharedExpert(cfg, casts)

    def forward(self, x):
        cfg, (B, T, h) = self.cfg, x.shape
        j, p = cfg.router_jitter, cfg.dropout
        if j > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - j, 1.0 + j)  # (B, T, h)
        x = x.reshape(B * T, h)  # (N, h)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=cfg.stat_dtype)  # (N, E)
        top, index = probs.topk(cfg.experts_per_token, dim=-1)  # (N, k)
        weights = top / top.sum(dim=-1, keepdim=True)  # (N, k)
        out = torch.zeros_like(x)  # (N, h)
        for e in range(cfg.experts):
            tokens, slot = torch.where(index == e)  # (n_e,) each
            if len(tokens):
                y = self.experts(e, x[tokens])  # (n_e, h)
                out = out.index_add(0, tokens, (y.to(weights.dtype) * weights[tokens, slot, None]).to(x.dtype))
        if cfg.shared_expert_ffn:
            out = out + self.shared_experts(x)  # (N, h)
        out = out.view(B, T, h)
        if p > 0:
            out = out * dropout_mask(out.shape, p, out.device) / (1 - p)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg, casts):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(cfg, casts), Attention(cfg, casts)
        self.post_attention_layernorm = RMSNorm(cfg, casts)
        self.mlp = MoE(cfg, casts) if cfg.experts else MLP(cfg, casts)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def run_plain(layers, x):
    for layer in layers:
        x = layer(x)
    return x


class ReferenceLlama(nn.Module):
    def __init__(self, cfg, params=None):
        super().__init__()
        self.cfg = cfg
        self.casts = WeightCasts(cfg.torch_dtype)  # shared by every module below
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden, dtype=cfg.param_dtype)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, self.casts) for _ in range(cfg.layers))
        self.model.norm = RMSNorm(cfg, self.casts)
        if not cfg.tie_embeddings:
            self.lm_head = Linear(cfg.hidden, cfg.vocab, cfg, self.casts)
        if params is not None:
            self.load_state_dict({k: v for k, v in params.items() if k != "lm_head.weight" or not cfg.tie_embeddings})

    def forward(self, input_ids, targets, run_layers=run_plain):
        """Mean cross-entropy; run_layers(layers, x) lets a peer wrap the layers in checkpoints."""
        self.cast_weights()
        x = run_layers(self.model.layers, self.embed(input_ids))  # (B, T, h)
        return self.head_loss(x, targets)

    def cast_weights(self):
        """This step's compute copy of every weight (each cast once); returns the copies, which a
        tracker marks "weights". forward() calls it; a caller that runs the parts itself does too."""
        return self.casts.make(self.parameters())

    def release_weights(self):
        """Drop this step's compute copies (after the backward; the next forward makes new ones)."""
        self.casts.release()

    def embed(self, input_ids):
        return F.embedding(input_ids, self.casts(self.model.embed_tokens.weight))  # (B, T, h)

    def logits(self, x):
        weight = self.model.embed_tokens.weight if self.cfg.tie_embeddings else self.lm_head.weight
        return F.linear(self.model.norm(x), self.casts(weight))  # (B, T, V)

    def head_loss(self, x, targets):
        logits = self.logits(x)  # (B, T, V)
        return F.cross_entropy(logits.to(self.cfg.stat_dtype).flatten(0, 1), targets.flatten())

    def grads(self):
        """{name: gradient} under the same names as picockpt's params."""
        grads = {name: p.grad for name, p in self.named_parameters()}
        if self.cfg.tie_embeddings:
            grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
        return grads

"""The same model as an ordinary autograd nn.Module: the oracle for gradients and the peer
for torch.utils.checkpoint.

Written independently of picockpt/ops (plain torch ops, Hugging Face's repeat_kv for
grouped-query attention), with the same parameter names, so
ReferenceLlama(cfg).load_state_dict(params) runs the very same weights. Dropout masks
come from the same helper and in the same order as in picockpt/layer.py, so with the
same seed both draw the same masks.

    model = ReferenceLlama(cfg, params)
    loss = model(input_ids, targets)                      # plain autograd
    loss = model(input_ids, targets, run_layers=per_layer_checkpoint)
"""
import torch
import torch.nn.functional as F
from torch import nn

from .ops import dropout_mask, rope_tables


def _cast(weight, cfg):
    return weight.to(cfg.torch_dtype)  # 16-bit compute copy of an fp32 master weight (autograd casts back)


class RMSNorm(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.ones(cfg.hidden, dtype=cfg.param_dtype))

    def forward(self, x):
        xs = x.to(self.cfg.stat_dtype)  # (B, T, h)
        xs = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)  # (B, T, h)
        return _cast(self.weight, self.cfg) * xs.to(x.dtype)  # (B, T, h)


class Linear(nn.Module):
    def __init__(self, inp, out, cfg):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(out, inp, dtype=cfg.param_dtype))

    def forward(self, x):
        return F.linear(x, _cast(self.weight, self.cfg))


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        h, kv = cfg.hidden, cfg.kv_dim
        self.q_proj, self.k_proj = Linear(h, h, cfg), Linear(h, kv, cfg)
        self.v_proj, self.o_proj = Linear(h, kv, cfg), Linear(h, h, cfg)

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
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate_proj, self.up_proj = Linear(cfg.hidden, cfg.ffn, cfg), Linear(cfg.hidden, cfg.ffn, cfg)
        self.down_proj = Linear(cfg.ffn, cfg.hidden, cfg)

    def forward(self, x):
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, h)
        p = self.cfg.dropout
        if p > 0:
            out = out * dropout_mask(out.shape, p, x.device) / (1 - p)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(cfg), Attention(cfg)
        self.post_attention_layernorm, self.mlp = RMSNorm(cfg), MLP(cfg)

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
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden, dtype=cfg.param_dtype)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.model.norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = Linear(cfg.hidden, cfg.vocab, cfg)
        if params is not None:
            self.load_state_dict({k: v for k, v in params.items() if k != "lm_head.weight"
                                  or not cfg.tie_embeddings})

    def head_weight(self):
        return self.model.embed_tokens.weight if self.cfg.tie_embeddings else self.lm_head.weight

    def forward(self, input_ids, targets, run_layers=run_plain):
        """Mean cross-entropy; run_layers(layers, x) lets a peer wrap the layers in checkpoints."""
        x = run_layers(self.model.layers, self.embed(input_ids))  # (B, T, h)
        return self.head_loss(x, targets)

    def embed(self, input_ids):
        return F.embedding(input_ids, _cast(self.model.embed_tokens.weight, self.cfg))  # (B, T, h)

    def logits(self, x):
        return F.linear(self.model.norm(x), _cast(self.head_weight(), self.cfg))  # (B, T, V)

    def head_loss(self, x, targets):
        logits = self.logits(x)  # (B, T, V)
        return F.cross_entropy(logits.to(self.cfg.stat_dtype).flatten(0, 1), targets.flatten())

    def grads(self):
        """{name: gradient} under the same names as picockpt's params."""
        grads = {name: p.grad for name, p in self.named_parameters()}
        if self.cfg.tie_embeddings:
            grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
        return grads

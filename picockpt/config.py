"""The shape of the model: one small dataclass, a few presets, and the checks.

A Config holds everything that decides how many bytes an activation takes:
sizes (vocab, hidden, layers, heads, kv_heads, ffn), the longest sequence the
rotary table allows, the dropout probability and the compute dtype. Every
invalid value raises ValueError naming the field, the value and what would work.

    cfg = Config.from_preset("small")
    cfg = Config(vocab=256, hidden=48, layers=3, heads=6, kv_heads=2, ffn=96)
    cfg = Config.from_hf(LlamaConfig(...).to_dict())
    cfg = cfg.replace(layers=12, dtype="bf16")
"""
import dataclasses
import math
from dataclasses import dataclass, field

import torch

DTYPES = {  # accepted spellings -> canonical name
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float64": "float64", "fp64": "float64", "double": "float64",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}

PRESETS = {
    # tiny: unit tests; every op and every policy in milliseconds.
    "tiny": dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=80, max_seq=64),
    # small: the CPU lessons; one training step of batch 4 x 128 tokens takes a few tens of ms.
    "small": dict(vocab=256, hidden=128, layers=8, heads=4, kv_heads=2, ffn=448, max_seq=512),
    # The true shapes of Llama 3 / 3.1 (Meta's config.json). Analytic use only: never allocated here.
    "llama3-8b": dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336,
                      max_seq=131072, rope_theta=500000.0, norm_eps=1e-5),
    "llama3-70b": dict(vocab=128256, hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672,
                       max_seq=131072, rope_theta=500000.0, norm_eps=1e-5),
    "llama3-405b": dict(vocab=128256, hidden=16384, layers=126, heads=128, kv_heads=8, ffn=53248,
                        max_seq=131072, rope_theta=500000.0, norm_eps=1e-5),
}


@dataclass(frozen=True)
class Config:
    vocab: int = 256            # V: number of token ids
    hidden: int = 128           # h: width of the residual stream
    layers: int = 8             # L: number of decoder layers
    heads: int = 4              # H: query heads; head_dim = hidden / heads
    kv_heads: int = 2           # KV: key/value heads (grouped-query attention when < heads)
    ffn: int = 448              # f: SwiGLU intermediate size
    max_seq: int = 512          # longest sequence the rotary table covers
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6      # RMSNorm epsilon
    dropout: float = 0.0        # on attention probabilities and on both residual branches
    dtype: str = "float32"      # activation/compute dtype; 16-bit dtypes keep fp32 master weights
    tie_embeddings: bool = False
    rope_scaling: dict = field(default=None, compare=False, hash=False)  # None or Llama 3.1 "llama3"

    def __post_init__(self):
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "max_seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Config.{name}={value!r}: must be a positive integer")
        if self.hidden % self.heads:
            raise ValueError(f"Config.hidden={self.hidden} is not divisible by heads={self.heads}: "
                             f"use a multiple of heads (e.g. hidden={self.heads * max(1, round(self.hidden / self.heads))})"
                             f" or heads among {_divisors(self.hidden)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"Config.kv_heads={self.kv_heads} does not divide heads={self.heads}: "
                             f"use kv_heads among {_divisors(self.heads)}")
        if self.head_dim % 2:
            raise ValueError(f"Config.hidden/heads = head_dim = {self.head_dim} is odd: rotary embeddings "
                             f"rotate pairs, so head_dim must be even (e.g. hidden={self.heads * (self.head_dim + 1)})")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"Config.rope_theta={self.rope_theta!r}: must be a positive number (e.g. 10000.0)")
        if not (self.norm_eps > 0):
            raise ValueError(f"Config.norm_eps={self.norm_eps!r}: must be positive (e.g. 1e-6)")
        if not (0.0 <= self.dropout < 1.0):
            raise ValueError(f"Config.dropout={self.dropout!r}: must be in [0, 1)")
        if self.dtype not in DTYPES:
            raise ValueError(f"Config.dtype={self.dtype!r}: use one of {sorted(set(DTYPES))}")
        object.__setattr__(self, "dtype", DTYPES[self.dtype])
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"Config.rope_scaling type {kind!r} is not implemented: "
                             f"use None (plain RoPE) or a Llama 3.1 'llama3' scaling dict")

    # -- derived sizes -----------------------------------------------------
    @property
    def head_dim(self):                 # hd
        return self.hidden // self.heads

    @property
    def kv_dim(self):                   # width of k and v: KV * hd
        return self.kv_heads * self.head_dim

    @property
    def torch_dtype(self):              # dtype of activations and matmuls
        return getattr(torch, self.dtype)

    @property
    def param_dtype(self):              # master weights: fp32 under 16-bit compute (mixed precision)
        return torch.float64 if self.dtype == "float64" else torch.float32

    @property
    def stat_dtype(self):               # RMSNorm / softmax statistics: never below fp32
        return self.param_dtype

    def check_seq(self, seq):
        """Sequence lengths must fit the rotary table."""
        if not isinstance(seq, int) or seq <= 0:
            raise ValueError(f"seq={seq!r}: must be a positive integer")
        if seq > self.max_seq:
            raise ValueError(f"seq={seq} is longer than Config.max_seq={self.max_seq}: "
                             f"use seq <= {self.max_seq} or raise max_seq")

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def num_params(self):
        h, f, V = self.hidden, self.ffn, self.vocab
        per_layer = h * (h + 2 * self.kv_dim + h) + 3 * h * f + 2 * h
        return V * h * (1 if self.tie_embeddings else 2) + self.layers * per_layer + h

    # -- constructors ------------------------------------------------------
    @classmethod
    def from_preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError(f"preset={name!r} is unknown: use one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_hf(cls, d, **overrides):
        """From a Hugging Face LlamaConfig.to_dict() (transformers 4.x or 5.x spelling)."""
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r}: picockpt's MLP is SwiGLU (silu)")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ValueError(f"{flag}=True: picockpt's linears have no bias (Llama has none)")
        heads = d["num_attention_heads"]
        if d.get("head_dim") not in (None, d["hidden_size"] // heads):
            raise ValueError(f"head_dim={d['head_dim']}: picockpt needs head_dim = hidden_size / "
                             f"num_attention_heads = {d['hidden_size'] // heads}")
        if d.get("attention_dropout", 0.0):
            raise ValueError(f"attention_dropout={d['attention_dropout']}: picockpt's dropout also drops the "
                             "residual branches; load with dropout 0 and set Config.dropout yourself")
        rope = d.get("rope_parameters") or {}            # transformers 5.x
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or rope
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
        fields = dict(vocab=d["vocab_size"], hidden=d["hidden_size"], layers=d["num_hidden_layers"],
                      heads=heads, kv_heads=d.get("num_key_value_heads") or heads,
                      ffn=d["intermediate_size"], max_seq=d["max_position_embeddings"],
                      rope_theta=float(theta), norm_eps=d["rms_norm_eps"],
                      tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                      dtype=str(dtype).replace("torch.", ""), rope_scaling=scaling)
        return cls(**{**fields, **overrides})


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]

"""The shape of the model: one small dataclass, a few presets, and the checks.

A Config holds everything that decides how many bytes an activation takes: sizes (vocab, hidden, layers, heads,
kv_heads, ffn), the longest sequence the rotary table allows, the dropout probability and the compute dtype; for a
mixture of experts (picockpt/model/moe.py) also the number of experts, the top-k, an optional shared expert's width and
the router jitter. Every invalid value raises ValueError naming the field, the value and what would work.

    cfg = Config.from_preset("small")
    cfg = Config(vocab=256, hidden=48, layers=3, heads=6, kv_heads=2, ffn=96)
    cfg = Config.from_hf(LlamaConfig(...).to_dict())      # or a MixtralConfig
    cfg = Config.from_preset("tiny", experts=4, experts_per_token=2)   # Mixtral-style MoE layers
    cfg = cfg.replace(layers=12, dtype="bf16")
"""
import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .hf import check_rope_scaling, fields_from_hf

DTYPES = {  # accepted spellings -> canonical name
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float64": "float64", "fp64": "float64", "double": "float64",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}

ATTENTIONS = ("eager", "tiled", "fused")  # see picockpt/ops/attention*.py
BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "bool": 1, "int64": 8}  # per element, by dtype name

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
    # Mixtral 8x7B (Mistral AI's config.json): 8 experts of f=14336, top-2. Analytic use only.
    "mixtral-8x7b": dict(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, experts=8,
                         experts_per_token=2, max_seq=32768, rope_theta=1e6, norm_eps=1e-5),
}


@dataclass(frozen=True)
class Config:
    vocab: int = 256            # V: number of token ids
    hidden: int = 128           # h: width of the residual stream
    layers: int = 8             # L: number of decoder layers
    heads: int = 4              # H: query heads; head_dim = hidden / heads
    kv_heads: int = 2           # KV: key/value heads (grouped-query attention when < heads)
    ffn: int = 448              # f: SwiGLU intermediate size (of each expert, with experts > 0)
    max_seq: int = 512          # longest sequence the rotary table covers
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6      # RMSNorm epsilon
    dropout: float = 0.0        # on attention probabilities and on both residual branches
    dtype: str = "float32"      # activation/compute dtype; 16-bit dtypes keep fp32 master weights
    tie_embeddings: bool = False
    attention: str = "eager"    # eager | tiled | fused: how attention is computed and what it stores
    attention_tile: int = 128   # tiled: query and key rows per tile
    loss_chunk: int = 0         # tokens per chunk of the LM head and loss; 0: all B*T at once
    rope_scaling: dict = field(default=None, compare=False, hash=False)  # None or Llama 3.1 "llama3"
    # mixture of experts (picockpt/model/moe.py), as Hugging Face's Mixtral
    experts: int = 0            # E: routed experts per layer (num_local_experts); 0: the dense MLP
    experts_per_token: int = 2  # k: each token goes to its k most probable experts (num_experts_per_tok)
    shared_expert_ffn: int = 0  # width of an always-on shared expert beside the routed ones; 0: none
    router_jitter: float = 0.0  # j: the MoE input times U(1 - j, 1 + j) noise in training (router_jitter_noise)

    def __post_init__(self):
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "max_seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Config.{name}={value!r}: must be a positive integer")
        if self.hidden % self.heads:
            raise ValueError(f"Config.hidden={self.hidden} is not divisible by heads={self.heads}: "
                             f"use a multiple of 2 x heads, so head_dim is even (e.g. hidden="
                             f"{2 * self.heads * max(1, round(self.hidden / (2 * self.heads)))}), or heads among "
                             f"{[d for d in _divisors(self.hidden) if self.hidden // d % 2 == 0]}")
        if self.heads % self.kv_heads:
            raise ValueError(f"Config.kv_heads={self.kv_heads} does not divide heads={self.heads}: "
                             f"use kv_heads among {_divisors(self.heads)}")
        if self.head_dim % 2:
            raise ValueError(f"Config.hidden/heads = head_dim = {self.head_dim} is odd: rotary embeddings "
                             f"rotate pairs, so head_dim must be even (e.g. hidden={self.heads * (self.head_dim + 1)})")
        for name in ("rope_theta", "norm_eps", "dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"Config.{name}={value!r}: must be a finite number")
        if not self.rope_theta > 0:
            raise ValueError(f"Config.rope_theta={self.rope_theta!r}: must be a positive number (e.g. 10000.0)")
        if not (self.norm_eps > 0):
            raise ValueError(f"Config.norm_eps={self.norm_eps!r}: must be positive (e.g. 1e-6)")
        if not (0.0 <= self.dropout < 1.0):
            raise ValueError(f"Config.dropout={self.dropout!r}: must be in [0, 1)")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"Config.attention={self.attention!r}: use one of {', '.join(ATTENTIONS)} "
                             f"(eager stores the T x T probabilities; tiled and fused recompute them)")
        for name in ("attention_tile", "loss_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "attention_tile" else 0):
                raise ValueError(f"Config.{name}={value!r}: must be a whole number"
                                 + (" >= 1 (e.g. 128)" if name == "attention_tile" else " >= 0 (0: no chunking)"))
        if self.attention == "fused" and self.dropout > 0:
            raise ValueError(f"Config.attention='fused' with dropout={self.dropout}: torch's fused CPU kernel has "
                             f"no dropout, and picockpt does not replay a CUDA kernel's own mask under recomputation; "
                             f"use attention='tiled' (its masks are regenerated from a stored seed) or dropout=0")
        if self.dtype not in DTYPES:
            raise ValueError(f"Config.dtype={self.dtype!r}: use one of {sorted(set(DTYPES))}")
        object.__setattr__(self, "dtype", DTYPES[self.dtype])
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"Config.tie_embeddings={self.tie_embeddings!r}: must be True or False")
        check_rope_scaling(self.rope_scaling, self.rope_theta)
        self._check_experts()

    def _check_experts(self):
        for name, least in (("experts", 0), ("experts_per_token", 1), ("shared_expert_ffn", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Config.{name}={value!r}: must be a whole number >= {least}")
        jitter = self.router_jitter
        if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not 0.0 <= jitter < 1.0:
            raise ValueError(f"Config.router_jitter={jitter!r}: must be a number in [0, 1) (the noise is "
                             f"U(1 - j, 1 + j); Switch Transformer used 0.01)")
        E, k = self.experts, self.experts_per_token
        if E == 0:  # a dense model: the MoE fields must keep their defaults, not be ignored in silence
            for name, default in (("experts_per_token", 2), ("shared_expert_ffn", 0), ("router_jitter", 0.0)):
                if getattr(self, name) != default:
                    raise ValueError(f"Config.{name}={getattr(self, name)!r} with experts=0: it belongs to a mixture "
                                     f"of experts and a dense MLP has none; set experts > 0 (e.g. experts=8) "
                                     f"or leave {name} at {default!r}")
        elif k > E:
            raise ValueError(f"Config.experts_per_token={k} is larger than experts={E}: each token goes to k "
                             f"different experts; use 1 <= experts_per_token <= {E}")

    # -- derived sizes -----------------------------------------------------
    @property
    def head_dim(self):                 # hd
        return self.hidden // self.heads

    @property
    def kv_dim(self):                   # width of k and v: KV * hd
        return self.kv_heads * self.head_dim

    @property
    def draws_random(self):             # a step draws random numbers: dropout masks or router jitter
        return self.dropout > 0 or self.router_jitter > 0

    @property
    def torch_dtype(self):              # dtype of activations and matmuls
        return getattr(torch, self.dtype)

    @property
    def param_dtype(self):              # master weights: fp32 under 16-bit compute (mixed precision)
        return torch.float64 if self.dtype == "float64" else torch.float32

    @property
    def dtype_names(self):              # (activations, statistics, master weights): keys of BYTES
        return self.dtype, str(self.stat_dtype).replace("torch.", ""), str(self.param_dtype).replace("torch.", "")

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
        h, f, V, E = self.hidden, self.ffn, self.vocab, self.experts
        mlp = 3 * h * f if E == 0 else E * h + E * 3 * h * f + 3 * h * self.shared_expert_ffn  # router, experts
        per_layer = h * (h + 2 * self.kv_dim + h) + mlp + 2 * h
        return V * h * (1 if self.tie_embeddings else 2) + self.layers * per_layer + h

    # -- constructors ------------------------------------------------------
    @classmethod
    def from_preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError(f"preset={name!r} is unknown: use one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_hf(cls, d, **overrides):
        """From a Hugging Face LlamaConfig or MixtralConfig .to_dict() (transformers 4.x or 5.x spelling);
        any other model family, and any key that would change the computation, is refused (picockpt/model/hf.py)."""
        return cls(**{**fields_from_hf(d), **overrides})


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]

"""Parameters under Hugging Face LlamaForCausalLM state-dict names, and their shapes.

    params = init_params(cfg, seed=0)   # {"model.embed_tokens.weight": (V, h), ...}

A real LlamaForCausalLM.state_dict() is a valid params dict as it is. With Config.experts = E > 0
the MLP of every layer is a mixture of experts (picockpt/model/moe.py) named as MixtralForCausalLM
names it, so a Mixtral state_dict() is valid too:

    model.layers.{i}.mlp.gate.weight              (E, h)       the router
    model.layers.{i}.mlp.experts.gate_up_proj     (E, 2f, h)   rows 0..f-1 gate, f..2f-1 up, per expert
    model.layers.{i}.mlp.experts.down_proj        (E, h, f)
  with a shared expert (Config.shared_expert_ffn = fs > 0; Mixtral has none; named as DeepSeek-V2/V3
  name their ungated shared experts):
    model.layers.{i}.mlp.shared_experts.{gate_proj,up_proj}.weight (fs, h), .down_proj.weight (h, fs)
"""
import math
from collections import namedtuple

import torch

from .config import Config
from ..device import resolve_device

# the weights of one decoder layer, by role; values are tensors (weights or their gradients)
LayerWeights = namedtuple("LayerWeights", "attn_norm q k v o mlp_norm gate up down")

LAYER_NAMES = LayerWeights(  # role -> name inside "model.layers.{i}."
    attn_norm="input_layernorm.weight", q="self_attn.q_proj.weight", k="self_attn.k_proj.weight",
    v="self_attn.v_proj.weight", o="self_attn.o_proj.weight", mlp_norm="post_attention_layernorm.weight",
    gate="mlp.gate_proj.weight", up="mlp.up_proj.weight", down="mlp.down_proj.weight")

# a mixture-of-experts layer: the same attention roles, then the router and the experts
MoeLayerWeights = namedtuple("MoeLayerWeights", "attn_norm q k v o mlp_norm router experts_gate_up experts_down")
SharedMoeLayerWeights = namedtuple("SharedMoeLayerWeights", MoeLayerWeights._fields + ("shared_gate", "shared_up",
                                                                                       "shared_down"))
ROLE_NAMES = {**LAYER_NAMES._asdict(), "router": "mlp.gate.weight", "experts_gate_up": "mlp.experts.gate_up_proj",
              "experts_down": "mlp.experts.down_proj", "shared_gate": "mlp.shared_experts.gate_proj.weight",
              "shared_up": "mlp.shared_experts.up_proj.weight", "shared_down": "mlp.shared_experts.down_proj.weight"}

EMBED, FINAL_NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def layer_key(i, role):
    return f"model.layers.{i}.{ROLE_NAMES[role]}"


def layer_shapes(cfg):
    """role -> shape of one layer's weights (the dense MLP's, or the router's and experts')."""
    h, f, kv, E, fs = cfg.hidden, cfg.ffn, cfg.kv_dim, cfg.experts, cfg.shared_expert_ffn
    shapes = dict(attn_norm=(h,), q=(h, h), k=(kv, h), v=(kv, h), o=(h, h), mlp_norm=(h,))
    if E == 0:
        return {**shapes, "gate": (f, h), "up": (f, h), "down": (h, f)}
    shapes.update(router=(E, h), experts_gate_up=(E, 2 * f, h), experts_down=(E, h, f))
    if fs:
        shapes.update(shared_gate=(fs, h), shared_up=(fs, h), shared_down=(h, fs))
    return shapes


def param_shapes(cfg):
    """name -> shape, in state-dict order."""
    shapes = {EMBED: (cfg.vocab, cfg.hidden)}
    shapes.update({layer_key(i, role): shape for i in range(cfg.layers) for role, shape in layer_shapes(cfg).items()})
    shapes[FINAL_NORM] = (cfg.hidden,)
    if not cfg.tie_embeddings:
        shapes[HEAD] = (cfg.vocab, cfg.hidden)
    return shapes


def init_params(cfg, seed=0, device="cpu"):
    """Normal(0, 0.02) matrices (router and expert tensors too) and unit norm weights, as Hugging Face initialises Llama
    and Mixtral. Stored in cfg.param_dtype (fp32 master weights under 16-bit compute)."""
    if not isinstance(cfg, Config):
        raise ValueError(f"init_params(cfg=...) takes a picockpt Config (e.g. Config.from_preset('tiny')), "
                         f"got {type(cfg).__name__}")
    check_seed(seed)
    if str(device) != "meta":  # meta: shapes only, no values
        device = resolve_device(device)  # "gpu" or a missing CUDA: a ValueError naming device=, not torch's message
    generator = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=cfg.param_dtype)  # (h,) norm weight
        else:
            tensor = torch.randn(shape, generator=generator, dtype=torch.float32).to(cfg.param_dtype) * 0.02
        params[name] = tensor.to(device)
    return params


SEED_LIMIT = 2 ** 64  # torch.Generator.manual_seed takes 0 .. 2**64 - 1


def check_seed(seed, name="seed"):
    """A whole number torch.Generator.manual_seed takes; ValueError naming it otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{name}={seed!r}: must be a whole number from 0 to 2**64 - 1 "
                         f"(what torch.Generator.manual_seed takes), e.g. {name}=0")


def check_params(params, cfg):
    """Every expected name with its shape, and nothing else; a clear error otherwise."""
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict of name -> tensor (e.g. init_params(cfg) or a "
                         f"LlamaForCausalLM state_dict()), got {type(params).__name__}")
    expected = param_shapes(cfg)
    extra = sorted(set(params) - set(expected))
    if cfg.tie_embeddings and HEAD in extra and torch.equal(params[HEAD], params.get(EMBED, params[HEAD])):
        extra.remove(HEAD)  # a tied model's state_dict lists the shared matrix under both names
    if extra:
        raise ValueError(f"params has {len(extra)} name(s) this Config has no use for, e.g. {extra[0]!r}: picockpt "
                         f"refuses them rather than ignore them (a bias or an extra layer would change the model); "
                         f"check the Config (layers, tie_embeddings) or remove them")
    for name, shape in expected.items():
        if name not in params:
            raise ValueError(f"params is missing {name!r} (expected shape {shape}) for this Config")
        if not isinstance(params[name], torch.Tensor) or not params[name].is_floating_point():
            raise ValueError(f"params[{name!r}] must be a floating-point tensor, got "
                             f"{getattr(params[name], 'dtype', type(params[name]).__name__)}")
        if tuple(params[name].shape) != shape:
            raise ValueError(f"params[{name!r}] has shape {tuple(params[name].shape)}, Config says {shape}")
    embed = params[EMBED]
    for name in expected:  # one device and one dtype: torch would mix a meta or CPU weight in without a word
        tensor = params[name]
        if tensor.device != embed.device or tensor.dtype != embed.dtype:
            raise ValueError(f"params[{name!r}] is {str(tensor.dtype).replace('torch.', '')} on {tensor.device}, "
                             f"params[{EMBED!r}] {str(embed.dtype).replace('torch.', '')} on {embed.device}: give "
                             f"every parameter the same device and dtype, e.g. "
                             f"{{k: v.to({str(embed.device)!r}, torch.{str(embed.dtype).replace('torch.', '')}) "
                             f"for k, v in params.items()}}")
    if not cfg.tie_embeddings and HEAD in params and _same_memory(params[HEAD], embed):
        raise ValueError(f"params[{HEAD!r}] is the same tensor as params[{EMBED!r}] but Config.tie_embeddings=False: "
                         f"an untied model would give the one matrix two separate gradients; use "
                         f"tie_embeddings=True (as tie_word_embeddings=True in Hugging Face), or give lm_head a copy")


def _same_memory(a, b):
    return a is b or (a.device.type != "meta" and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                      and a.storage_offset() == b.storage_offset())


def compute_weights(params, cfg, names=None):
    """The weights the step computes with: the master weights cast to the activation dtype
    (a no-op in fp32/fp64; one 16-bit copy per step under mixed precision). names: only these
    (model_names(cfg) or layer_names(cfg, i), for the policy's recast); None: every weight."""
    dtype = cfg.torch_dtype
    weights = {name: params[name].to(dtype) for name in (param_shapes(cfg) if names is None else names)}
    if cfg.tie_embeddings and EMBED in weights:
        weights[HEAD] = weights[EMBED]
    return weights


def model_names(cfg):
    """The weights outside the layers: the embedding, the final norm, the head (unless tied)."""
    return [name for name in param_shapes(cfg) if not name.startswith("model.layers.")]


def layer_names(cfg, i):
    """Layer i's weights, under their full names."""
    return [layer_key(i, role) for role in layer_shapes(cfg)]


def copy_bytes(cfg, recast=False):
    """The bytes of 16-bit weight copies live at once in a step: every weight's when the step keeps them
    (2 bytes a parameter), the model's (embedding, final norm, head) and one layer's when it casts each
    layer at its use (recast); 0 in fp32/fp64, which computes with the master weights themselves."""
    if cfg.torch_dtype == cfg.param_dtype:
        return 0
    size = torch.empty((), dtype=cfg.torch_dtype).element_size()  # 2
    layer = sum(math.prod(shape) for shape in layer_shapes(cfg).values())
    shapes = param_shapes(cfg)
    model = sum(math.prod(shapes[name]) for name in model_names(cfg))
    return size * (model + (1 if recast else cfg.layers) * layer)


def layer_weights(weights, i):
    """Layer i's weights by role: a LayerWeights, or a (Shared)MoeLayerWeights when it has a router."""
    kind = LayerWeights
    if layer_key(i, "router") in weights:
        kind = SharedMoeLayerWeights if layer_key(i, "shared_gate") in weights else MoeLayerWeights
    return kind(*(weights[layer_key(i, role)] for role in kind._fields))

"""Hugging Face transformers' LlamaForCausalLM (MixtralForCausalLM for an MoE Config) with the same
weights: the model people actually train.

    model = hf_llama(cfg, params, attention="sdpa", checkpointing=True)
    loss = hf_loss(model, input_ids, targets); loss.backward()

attention "eager" materialises the probabilities as picockpt's eager does; "sdpa" calls
torch.nn.functional.scaled_dot_product_attention, whose fused kernels recompute them in the backward (as picockpt's
fused does). checkpointing=True turns on Hugging Face's activation checkpointing (`gradient_checkpointing_enable()`,
renamed `activation_checkpointing_enable()` in transformers 5), non-reentrant torch.utils.checkpoint around every
decoder layer: the peer of picockpt's `full`. The loss is picockpt's: the mean cross-entropy of the logits against
targets (no shifting inside). transformers is needed only here (a test dependency, not a package one).
"""
import torch


def available():
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def check_supported(cfg, autocast=False):
    """The shapes a LlamaForCausalLM computes exactly as picockpt does (else a ValueError saying why); with
    autocast, a 16-bit Config too: the model's fp32 master weights, its forward under torch.autocast."""
    if cfg.dropout > 0:
        raise ValueError(f"dropout={cfg.dropout}: Hugging Face's Llama has no residual dropout, so it cannot run "
                         f"the same model; compare with dropout 0")
    if cfg.experts and cfg.shared_expert_ffn:
        raise ValueError(f"shared_expert_ffn={cfg.shared_expert_ffn}: Mixtral has no shared expert, so no Hugging Face "
                         f"model computes this one; compare with shared_expert_ffn=0")
    if cfg.dtype not in ("float32", "float64") and not autocast:
        raise ValueError(f"dtype={cfg.dtype}: the Hugging Face peers run in fp32/fp64 only (picockpt's mixed "
                         f"precision keeps fp32 master weights, which a plain .to(bf16) model would not)")


def hf_llama(cfg, params, attention="sdpa", checkpointing=False, device="cpu", autocast=False):
    """A LlamaForCausalLM (MixtralForCausalLM when cfg.experts) holding picockpt's params, in training mode.
    autocast=True with a bf16/fp16 Config: mixed precision as Hugging Face's Trainer runs it, fp32 weights (picockpt's
    master weights) and the forward under torch.autocast(cfg's dtype), which casts each weight at its use."""
    import transformers
    check_supported(cfg, autocast)
    shape = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn, num_hidden_layers=cfg.layers,
                 num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                 max_position_embeddings=cfg.max_seq, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
                 tie_word_embeddings=cfg.tie_embeddings, attention_dropout=0.0, rope_scaling=cfg.rope_scaling)
    if cfg.experts:  # Mixtral: the same attention, a sparse MoE MLP
        config = transformers.MixtralConfig(**shape, num_local_experts=cfg.experts,
                                            num_experts_per_tok=cfg.experts_per_token,
                                            router_jitter_noise=cfg.router_jitter, output_router_logits=False)
        config._experts_implementation = "eager"  # each expert on its tokens, as picockpt's moe.py
        family = transformers.MixtralForCausalLM
    else:
        config = transformers.LlamaConfig(**shape)
        family = transformers.LlamaForCausalLM
    config._attn_implementation = attention
    model = family(config).to(device=device, dtype=cfg.param_dtype)
    model.load_state_dict(params, strict=not cfg.tie_embeddings)  # a tied model has no lm_head of its own
    model.config.use_cache = False
    model.autocast_dtype = cfg.torch_dtype if autocast and cfg.dtype in ("bfloat16", "float16") else None
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    return model.train()


def hf_loss(model, input_ids, targets):
    """picockpt's loss on the model's logits: mean cross-entropy over all B*T positions (in fp32)."""
    dtype = getattr(model, "autocast_dtype", None)  # hf_llama(..., autocast=True): the forward in 16 bits
    with torch.autocast(input_ids.device.type, dtype=dtype, enabled=dtype is not None):
        logits = model(input_ids=input_ids, use_cache=False).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def hf_grads(model, tie_embeddings=False):
    """{name: gradient} under picockpt's (and the state dict's) names."""
    grads = {name: p.grad for name, p in model.named_parameters()}
    if tie_embeddings:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return grads

"""Reading a Hugging Face config: exactly the models picockpt computes, and nothing else.

    cfg = Config.from_hf(LlamaForCausalLM(...).config.to_dict())
    cfg = Config.from_hf(MixtralForCausalLM(...).config.to_dict())

A config dict is accepted only when picockpt would compute the very same model: model_type "llama" (or no model_type at
all, for a dict written by hand) or "mixtral", no biases, SiLU, plain or Llama 3.1 RoPE, head_dim = hidden / heads.
Every other key is either one picockpt reads, or metadata and generation settings that do not change a training step;
anything else is refused by name, since picockpt cannot tell whether it changes the computation (a Qwen2 config's q/k/v
biases, a Mistral config's sliding window, ...). Both transformers 4.x and 5.x spellings are read.

Mixtral (picockpt/model/moe.py): num_local_experts, num_experts_per_tok and router_jitter_noise become
experts, experts_per_token and router_jitter (Hugging Face applies the jitter in training mode only;
a picockpt step is always a training step). Two Mixtral features are refused rather than ignored:
  - sliding_window set: picockpt's attention is full causal (Mixtral 8x7B's own config says null);
  - output_router_logits true: that adds router_aux_loss_coef x the load-balancing loss (Switch
    Transformer's) to the loss, which picockpt does not compute. router_aux_loss_coef alone is read
    and has no effect, as in Hugging Face when output_router_logits is false.
"""

SUPPORTED_TYPES = ("llama", "mixtral")
MIXTRAL = {"num_local_experts", "num_experts_per_tok", "router_jitter_noise", "output_router_logits",
           "router_aux_loss_coef", "sliding_window"}  # keys a Mixtral config adds to Llama's

# keys picockpt reads (4.x and 5.x spellings)
READ = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
        "rope_parameters", "tie_word_embeddings", "dtype", "torch_dtype", "hidden_act", "head_dim",
        "attention_bias", "mlp_bias", "attention_dropout", "model_type", "pretraining_tp"}

# keys that describe the checkpoint, the tokenizer or text generation: no effect on a training step
METADATA = {
    "_name_or_path", "architectures", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "id2label", "label2id", "num_labels", "problem_type",
    "initializer_range", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "tie_encoder_decoder", "chunk_size_feed_forward", "tokenizer_class", "prefix", "task_specific_params",
    "finetuning_task", "torchscript", "pruned_heads", "tf_legacy_loss", "use_bfloat16", "_attn_implementation",
    "_attn_implementation_autoset", "_commit_hash", "quantization_config",
    # generation settings (transformers 4.x kept them in every config)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "generation_config",
}

ROPE_KINDS = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def fields_from_hf(d):
    """The Config fields of a Hugging Face config dict; ValueError for anything picockpt does not compute."""
    if not isinstance(d, dict):
        raise ValueError(f"Config.from_hf takes a dict (config.to_dict()), got {type(d).__name__}")
    kind = d.get("model_type", "llama")
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"model_type={kind!r}: picockpt implements {' and '.join(SUPPORTED_TYPES)} only; a "
                         f"{kind} model computes something else (biases, windows, other norms), so it is refused")
    family = "Mixtral" if kind == "mixtral" else "Llama"
    unknown = sorted(set(d) - READ - METADATA - (MIXTRAL if kind == "mixtral" else set()))
    if unknown:
        raise ValueError(f"config key(s) {', '.join(map(repr, unknown))} are not part of a {family} config: picockpt "
                         f"cannot tell whether they change the computation; remove them if they do not")
    moe = _mixtral_fields(d) if kind == "mixtral" else {}
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={d['hidden_act']!r}: picockpt's MLP is SwiGLU (silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag):
            raise ValueError(f"{flag}={d[flag]!r}: picockpt's linears have no bias (Llama has none)")
    missing = [key for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size", "max_position_embeddings", "rms_norm_eps") if key not in d]
    if missing:
        raise ValueError(f"the config lacks {', '.join(missing)}: give a complete LlamaConfig.to_dict()")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if isinstance(d[key], bool) or not isinstance(d[key], int) or d[key] < 1:  # before head_dim divides by one
            raise ValueError(f"{key}={d[key]!r}: a {family} config's sizes are whole numbers >= 1")
    heads = d["num_attention_heads"]
    if d.get("head_dim") not in (None, d["hidden_size"] // heads):
        raise ValueError(f"head_dim={d['head_dim']}: picockpt needs head_dim = hidden_size / "
                         f"num_attention_heads = {d['hidden_size'] // heads}")
    if d.get("attention_dropout", 0.0):
        raise ValueError(f"attention_dropout={d['attention_dropout']}: picockpt's dropout also drops the "
                         "residual branches; load with dropout 0 and set Config.dropout yourself")
    rope = d.get("rope_parameters") or {}  # transformers 5.x
    for key in set(rope) | set(d.get("rope_scaling") or {}):
        if key not in ("rope_type", "type", "rope_theta") + LLAMA3_KEYS:
            raise ValueError(f"rope parameter {key!r} is not implemented: picockpt's RoPE is plain or Llama 3.1's "
                             f"'llama3' scaling ({', '.join(LLAMA3_KEYS)})")
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    kv = d.get("num_key_value_heads")  # None (or absent) means heads, as in transformers; 0 is an error, not heads
    if kv == 0:
        raise ValueError(f"num_key_value_heads=0: a model needs at least one key/value head; use None for "
                         f"num_attention_heads={heads} (as transformers reads it) or a divisor of {heads}")
    return dict(vocab=d["vocab_size"], hidden=d["hidden_size"], layers=d["num_hidden_layers"], heads=heads,
                kv_heads=heads if kv is None else kv, ffn=d["intermediate_size"],
                max_seq=d["max_position_embeddings"], rope_theta=float(theta), norm_eps=d["rms_norm_eps"],
                tie_embeddings=d.get("tie_word_embeddings", False), dtype=str(dtype).replace("torch.", ""),
                rope_scaling=scaling, **moe)


def _mixtral_fields(d):
    """experts, experts_per_token and router_jitter of a MixtralConfig dict; its unimplemented features refused."""
    if d.get("sliding_window") is not None:
        raise ValueError(f"sliding_window={d['sliding_window']}: picockpt's attention is full causal, it has no "
                         f"sliding window; set sliding_window=None (Mixtral 8x7B's config has null)")
    if d.get("output_router_logits"):
        raise ValueError("output_router_logits=True: Hugging Face then adds router_aux_loss_coef x the load-balancing "
                         "loss to the loss, and picockpt computes no auxiliary loss; set output_router_logits=False")
    for key in ("num_local_experts", "num_experts_per_tok"):
        if key not in d:
            raise ValueError(f"the Mixtral config lacks {key}: give a complete MixtralConfig.to_dict()")
    return dict(experts=d["num_local_experts"], experts_per_token=d["num_experts_per_tok"],
                router_jitter=float(d.get("router_jitter_noise") or 0.0))


def check_rope_scaling(scaling, theta):
    """None, or a Llama 3.1 "llama3" dict with its four numbers (the checks Config runs); every other
    key refused by name, and a rope_theta inside it (transformers 5's rope_parameters form) must equal
    theta, Config.rope_theta, the one base the rotary tables use."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ValueError(f"Config.rope_scaling={scaling!r}: use None or a dict such as {{'rope_type': 'llama3', "
                         f"'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, "
                         f"'original_max_position_embeddings': 8192}}")
    unknown = sorted(set(scaling) - {"rope_type", "type", "rope_theta", *LLAMA3_KEYS}, key=str)
    if unknown:
        raise ValueError(f"Config.rope_scaling key {unknown[0]!r} is not implemented: picockpt's RoPE reads "
                         f"rope_type, rope_theta and Llama 3.1's {', '.join(LLAMA3_KEYS)}, as Config.from_hf does")
    if "rope_theta" in scaling and scaling["rope_theta"] != theta:
        raise ValueError(f"Config.rope_scaling['rope_theta']={scaling['rope_theta']!r} but "
                         f"Config.rope_theta={theta!r}: the rotary base is Config.rope_theta; "
                         f"set rope_theta={scaling['rope_theta']!r} "
                         f"(Config.from_hf reads rope_parameters' rope_theta into it)")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ValueError(f"Config.rope_scaling type {kind!r} is not implemented: "
                         f"use None (plain RoPE) or a Llama 3.1 'llama3' scaling dict")
    if kind == "default":
        return
    for key in LLAMA3_KEYS:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"Config.rope_scaling[{key!r}]={value!r}: a llama3 scaling needs a positive number "
                             f"for each of {', '.join(LLAMA3_KEYS)}")
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(f"Config.rope_scaling: high_freq_factor={scaling['high_freq_factor']} must exceed "
                         f"low_freq_factor={scaling['low_freq_factor']} (Llama 3.1 uses 4.0 and 1.0)")

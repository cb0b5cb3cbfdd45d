"""Inputs that used to give a different model or a false number without a word: refused, or made exact."""
import pytest
import torch
from torch.testing import assert_close

from picockpt import Config, init_params, loss_and_grads
from picockpt.measure import make_batch
from picockpt.ops import embedding_backward
from picockpt.policy import parse_size
from picockpt.reference import ReferenceLlama
from picockpt.tracker import Tracker

transformers = pytest.importorskip("transformers")

SMALL_HF = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=128)


# ---- Config.from_hf: exactly Llama ---------------------------------------------------------------------

def test_llama_configs_are_read_in_both_spellings():
    cfg = Config.from_hf(transformers.LlamaConfig(**SMALL_HF, rope_theta=5000.0).to_dict())
    assert (cfg.vocab, cfg.hidden, cfg.kv_heads, cfg.rope_theta) == (97, 48, 2, 5000.0)
    older = {**SMALL_HF, "model_type": "llama", "rope_theta": 5000.0, "rope_scaling": None, "rms_norm_eps": 1e-5,
             "torch_dtype": "bfloat16", "pretraining_tp": 1, "num_beams": 1, "temperature": 1.0,
             "transformers_version": "4.45.0", "architectures": ["LlamaForCausalLM"]}  # a 4.x config.json
    assert Config.from_hf(older).dtype == "bfloat16"


@pytest.mark.parametrize("family,kwargs,message", [
    ("Qwen2Config", {}, "model_type='qwen2': picockpt implements llama and mixtral only"),
    ("MistralConfig", {"sliding_window": 64}, "model_type='mistral'"),
    ("LlamaConfig", {"attention_bias": True}, "attention_bias=True: picockpt's linears have no bias"),
    ("LlamaConfig", {"mlp_bias": True}, "mlp_bias=True"),
    ("LlamaConfig", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("LlamaConfig", {"head_dim": 16}, "head_dim=16: picockpt needs head_dim = hidden_size / num_attention_heads = 8"),
])
def test_other_models_are_refused(family, kwargs, message):
    d = getattr(transformers, family)(**SMALL_HF, **kwargs).to_dict()
    with pytest.raises(ValueError, match=message):
        Config.from_hf(d)


def test_unknown_keys_and_rope_kinds_are_refused_by_name():
    d = transformers.LlamaConfig(**SMALL_HF).to_dict()
    with pytest.raises(ValueError, match="'sliding_window' are not part of a Llama config"):
        Config.from_hf({**d, "sliding_window": 4096})
    with pytest.raises(ValueError, match="rope parameter 'partial_rotary_factor' is not implemented"):
        Config.from_hf({**d, "rope_parameters": {**d["rope_parameters"], "partial_rotary_factor": 0.5}})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not implemented"):
        Config.from_hf({**d, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})


@pytest.mark.parametrize("field,value,message", [
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, r"rope_scaling\['low_freq_factor'\]=None"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                      "original_max_position_embeddings": 16}, "high_freq_factor=1.0 must exceed"),
    ("rope_scaling", "llama3", "rope_scaling='llama3': use None or a dict"),
    ("tie_embeddings", "no", "tie_embeddings='no': must be True or False"),
    ("dropout", "0.1", "dropout='0.1': must be a finite number"),
])
def test_malformed_config_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        Config.from_preset("tiny", **{field: value})


# ---- params: nothing ignored, no autograd graph --------------------------------------------------------

def test_parameters_with_unexpected_names_are_refused():
    cfg = Config.from_preset("tiny")
    params = init_params(cfg)
    ids, targets = make_batch(cfg, 2, 8, "cpu")
    params["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(cfg.hidden)
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj.bias'.*refuses them rather than ignore"):
        loss_and_grads(params, cfg, ids, targets)


def test_a_tied_state_dict_may_list_the_shared_matrix_twice():
    cfg = Config.from_preset("tiny", tie_embeddings=True)
    params = init_params(cfg)
    ids, targets = make_batch(cfg, 2, 8, "cpu")
    loss, grads = loss_and_grads({**params, "lm_head.weight": params["model.embed_tokens.weight"]}, cfg, ids, targets)
    assert torch.equal(loss, loss_and_grads(params, cfg, ids, targets)[0])
    with pytest.raises(ValueError, match="'lm_head.weight'"):  # a different head is not a tied model
        loss_and_grads({**params, "lm_head.weight": torch.zeros(cfg.vocab, cfg.hidden)}, cfg, ids, targets)


def test_params_that_require_grad_build_no_graph():
    """What LlamaForCausalLM.state_dict(keep_vars=True) gives: the step must measure what it says."""
    cfg = Config.from_preset("tiny")
    params = init_params(cfg)
    leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
    ids, targets = make_batch(cfg, 2, 16, "cpu")
    peaks = []
    for given in (params, leaves):
        with Tracker() as tracker:
            loss, grads = loss_and_grads(given, cfg, ids, targets, "full", tracker=tracker)
        assert loss.grad_fn is None and all(g.grad_fn is None for g in grads.values())
        peaks.append((tracker.peak_logical, tracker.peak_physical))
    assert peaks[0] == peaks[1]


# ---- the batch ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,message", [
    (lambda ids, t: (ids + 64, t), r"input_ids hold token ids from \d+ to \d+: they must lie in \[0, vocab\) = \[0, 64\)"),
    (lambda ids, t: (ids, t - 1000), r"targets hold token ids from -\d+ to -\d+: .* or be -100"),
    (lambda ids, t: (ids.float(), t), "input_ids must be an integer tensor of token ids, got torch.float32"),
    (lambda ids, t: (ids, t > 3), "targets must be an integer tensor"),
    (lambda ids, t: (ids[:0], t[:0]), "input_ids has batch 0"),
    (lambda ids, t: (ids, torch.full_like(t, -100)), "every target is -100"),
    (lambda ids, t: (ids[0], t[0]), "must both be \\(batch, seq\\)"),
])
def test_bad_batches_are_refused_before_any_work(change, message):
    cfg = Config.from_preset("tiny")
    ids, targets = make_batch(cfg, 2, 8, "cpu")
    ids, targets = change(ids.clone(), targets.clone())
    with pytest.raises(ValueError, match=message):
        loss_and_grads(init_params(cfg), cfg, ids, targets)


def test_ignored_targets_as_in_torch_and_transformers():
    cfg = Config.from_preset("tiny", dtype="fp64")
    params = init_params(cfg)
    ids, targets = make_batch(cfg, 2, 12, "cpu")
    targets = targets.clone()
    targets[0, :5] = -100
    loss, grads = loss_and_grads(params, cfg, ids, targets, "every:2")
    reference = ReferenceLlama(cfg, params)
    expect = reference(ids, targets)  # torch's cross_entropy: mean over the targets that are not -100
    expect.backward()
    assert_close(loss, expect.detach(), rtol=1e-12, atol=0)
    for name, grad in reference.grads().items():
        assert_close(grads[name], grad, rtol=1e-10, atol=1e-14)


def test_ids_of_another_integer_type_are_taken_as_int64():
    cfg = Config.from_preset("tiny")
    params = init_params(cfg)
    ids, targets = make_batch(cfg, 2, 8, "cpu")
    assert torch.equal(loss_and_grads(params, cfg, ids.int(), targets.int())[0],
                       loss_and_grads(params, cfg, ids, targets)[0])


# ---- the embedding's gradient: deterministic, at least fp32 -------------------------------------------

def test_embedding_gradient_sums_in_order_and_in_fp32():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (3, 40), generator=g)
    dy = torch.randn(3, 40, 8, generator=g).to(torch.bfloat16)
    grad = embedding_backward(dy, ids, (7, 8))
    assert grad.dtype == torch.float32  # not summed in bf16
    expect = torch.zeros(7, 8, dtype=torch.float64).index_add_(0, ids.flatten(), dy.flatten(0, 1).double())
    assert_close(grad.double(), expect, rtol=1e-6, atol=1e-6)
    assert grad[5:].abs().max() == 0  # ids never read: zero rows
    assert torch.equal(grad, embedding_backward(dy, ids, (7, 8)))  # the same order every time


def test_sizes_that_overflow_are_refused():
    with pytest.raises(ValueError, match="size '1e999' is too large to be a number of bytes"):
        parse_size("1e999")

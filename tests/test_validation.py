"""Inputs that used to give a different model or a false number without a word: refused, or made exact."""
import pytest
import torch
from torch.testing import assert_close

from picockpt import Config, init_params, loss_and_grads
from picockpt.measurement.measure import make_batch
from picockpt.ops import embedding_backward
from picockpt.recompute.policy import parse_size
from picockpt.measurement.reference import ReferenceLlama
from picockpt.measurement.tracker import Tracker

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


# ---- inputs that computed something else without a word (issue: six silent-wrong inputs) -------------------

def test_a_parameter_on_another_device_or_dtype_is_refused_by_name():
    cfg = Config.from_preset("tiny")
    ids = torch.zeros(2, 8, dtype=torch.long)
    params = init_params(cfg)
    params["model.norm.weight"] = params["model.norm.weight"].to("meta")  # torch would read uninitialised memory
    with pytest.raises(ValueError, match=r"params\['model.norm.weight'\] is float32 on meta, "
                                         r"params\['model.embed_tokens.weight'\] float32 on cpu: give every parameter "
                                         r"the same device and dtype"):
        loss_and_grads(params, cfg, ids, ids)
    params = init_params(cfg)
    params["model.layers.1.mlp.up_proj.weight"] = params["model.layers.1.mlp.up_proj.weight"].double()
    with pytest.raises(ValueError, match=r"params\['model.layers.1.mlp.up_proj.weight'\] is float64 on cpu"):
        loss_and_grads(params, cfg, ids, ids)


def test_parameters_on_the_meta_device_are_refused_with_real_advice():
    cfg = Config.from_preset("tiny")
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"the parameters are on the meta device \(shapes only, no values\): a step "
                                         r"needs real weights; make them with init_params\(cfg, device='cpu'\)"):
        loss_and_grads(init_params(cfg, device="meta"), cfg, ids, ids)


def test_an_untied_config_with_one_matrix_for_embedding_and_head_is_refused():
    cfg = Config.from_preset("tiny")
    params = init_params(cfg)
    params["lm_head.weight"] = params["model.embed_tokens.weight"]  # the same object: two gradients for one matrix
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"is the same tensor as params\['model.embed_tokens.weight'\] but "
                                         r"Config.tie_embeddings=False: .* use tie_embeddings=True"):
        loss_and_grads(params, cfg, ids, ids)
    tied = cfg.replace(tie_embeddings=True)
    loss_and_grads(params, tied, ids, ids)  # told it is tied: one matrix, one summed gradient


def test_rope_theta_inside_rope_scaling_must_be_config_s_rope_theta():
    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # transformers 5's rope_parameters
    with pytest.raises(ValueError, match=r"Config.rope_scaling\['rope_theta'\]=500000.0 but Config.rope_theta=10000.0: "
                                         r"the rotary base is Config.rope_theta; set rope_theta=500000.0"):
        Config(rope_scaling=scaling)
    assert Config(rope_scaling=scaling, rope_theta=500000.0).rope_theta == 500000.0
    with pytest.raises(ValueError, match=r"Config.rope_scaling key 'beta_fast' is not implemented"):
        Config(rope_scaling={**scaling, "beta_fast": 32}, rope_theta=500000.0)
    hf = transformers.LlamaConfig(**SMALL_HF, rope_theta=500000.0, rope_scaling={**scaling, "rope_theta": 500000.0})
    assert Config.from_hf(hf.to_dict()).rope_theta == 500000.0  # from_hf reads the same dict the same way


def test_zero_key_value_heads_is_refused_not_read_as_heads():
    with pytest.raises(ValueError, match=r"num_key_value_heads=0: a model needs at least one key/value head; use None "
                                         r"for num_attention_heads=6"):
        Config.from_hf({**SMALL_HF, "rms_norm_eps": 1e-6, "num_key_value_heads": 0})
    assert Config.from_hf({**SMALL_HF, "rms_norm_eps": 1e-6, "num_key_value_heads": None}).kv_heads == 6


def test_an_ambient_autocast_is_refused():
    cfg, params = Config.from_preset("tiny"), init_params(Config.from_preset("tiny"))
    ids = torch.zeros(2, 8, dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match=r"torch.autocast\('cpu', dtype=bfloat16\) is on around the step: picockpt "
                                             r"computes in Config.dtype='float32' .* set Config\(dtype='bfloat16'\)"):
            loss_and_grads(params, cfg, ids, ids)


def test_column_major_ids_give_the_row_major_loss_and_gradients():
    cfg, params = Config.from_preset("tiny"), init_params(Config.from_preset("tiny"))
    ids, targets = make_batch(cfg, 3, 16, "cpu", 0)
    loss, grads = loss_and_grads(params, cfg, ids, targets, "full")
    strided = loss_and_grads(params, cfg, ids.t().contiguous().t(), targets.t().contiguous().t(), "full")
    assert torch.equal(strided[0], loss) and all(torch.equal(strided[1][k], grads[k]) for k in grads)


def test_numpy_ids_are_named_as_numpy_arrays():
    np = pytest.importorskip("numpy")
    cfg, params = Config.from_preset("tiny"), init_params(Config.from_preset("tiny"))
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids must be a torch integer tensor of token ids, got numpy.ndarray of "
                                         r"int64: convert it with torch.as_tensor\(input_ids\)"):
        loss_and_grads(params, cfg, np.zeros((2, 8), dtype=np.int64), ids)


@pytest.mark.parametrize("segment", [-1, 0, 2.0, True])
def test_segmented_backward_refuses_a_segment_that_is_not_a_layer_count(segment):
    from picockpt.recompute.bridge import segmented_backward
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    x = torch.randn(1, 2, 4, requires_grad=True)
    with pytest.raises(ValueError, match=rf"segment={segment!r}: the layers per recomputed segment must be a whole "
                                         rf"number >= 1 \(1: every layer its own checkpoint; 3 or more: the 3 layers "
                                         rf"as one\)"):
        segmented_backward(layers, x, lambda y: y.sum(), segment)


@pytest.mark.parametrize("call,message", [
    (dict(seed=2**64), "seed=18446744073709551616: must be a whole number from 0 to 2**64 - 1"),
    (dict(seed=1.5), "seed=1.5: must be a whole number"),
    (dict(seed=-1), "seed=-1: must be a whole number"),
    (dict(cfg="tiny"), "init_params(cfg=...) takes a picockpt Config (e.g. Config.from_preset('tiny')), got str"),
])
def test_init_params_checks_its_arguments(call, message):
    with pytest.raises(ValueError) as error:
        init_params(**{"cfg": Config.from_preset("tiny"), **call})
    assert str(error.value).startswith(message)


def test_route_by_token_keeps_the_embedding_s_device():
    from picockpt.model.routing import route_by_token
    cfg = Config.from_preset("tiny", experts=4, experts_per_token=2)
    params = route_by_token(init_params(cfg, device="meta"), cfg)  # meta stands in for cuda here
    assert {t.device.type for t in params.values()} == {"meta"}

"""Mixture-of-experts layers: the same loss and gradients as Hugging Face's MixtralForCausalLM and as
the autograd reference, bitwise the same under every recomputation choice, and clear errors."""
import pytest
import torch
from torch.testing import assert_close

from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import layer_inventory, predicted_peak_bytes
from picockpt.measurement.measure import make_batch
from picockpt.model.routing import step_routing
from picockpt.model.params import param_shapes
from picockpt.recompute.policy import parse_policy
from picockpt.measurement.reference import ReferenceLlama
from conftest import random_norms

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")


def hf_mixtral(**kw):
    config = transformers.MixtralConfig(vocab_size=97, max_position_embeddings=128, rope_theta=5000.0,
                                        rms_norm_eps=1e-5, tie_word_embeddings=False, **kw)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the loop over experts read for this port (grouped_mm is the default)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).float()
    return random_norms(model)


# ---- against transformers ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [
    dict(hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
         num_local_experts=4, num_experts_per_tok=2),                       # GQA 6/2, top-2 of 4
    dict(hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
         num_local_experts=6, num_experts_per_tok=1),                       # MHA, top-1 of 6
    dict(hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
         num_local_experts=5, num_experts_per_tok=3, router_jitter_noise=0.1),  # jitter, in training mode
], ids=["E4k2-gqa", "E6k1-mha", "E5k3-jitter"])
def test_same_loss_and_grads_as_transformers_mixtral(shape):
    model = hf_mixtral(**shape)
    cfg = Config.from_hf(model.config.to_dict(), dtype="float32")
    assert (cfg.experts, cfg.experts_per_token, cfg.router_jitter) == (
        shape["num_local_experts"], shape["num_experts_per_tok"], shape.get("router_jitter_noise", 0.0))
    params = {k: v.detach() for k, v in model.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in params.items()} == param_shapes(cfg)  # the weights load as they are
    ids, targets = torch.randint(0, 97, (2, 29)), torch.randint(0, 97, (2, 29))

    model.train()  # Hugging Face applies the jitter in training mode only (a picockpt step always)
    torch.manual_seed(5)  # both draw the jitter noise from the default generator, in the same order
    logits = model(input_ids=ids, output_router_logits=False).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    torch.manual_seed(5)
    ours, grads = loss_and_grads(params, cfg, ids, targets)
    assert_close(ours, loss.detach(), rtol=1e-5, atol=1e-6)
    hf_grads = {k: p.grad for k, p in model.named_parameters()}
    assert set(grads) == set(hf_grads)
    for name, g in hf_grads.items():
        if cfg.experts_per_token == 1 and name.endswith("mlp.gate.weight"):
            # top-1, renormalised: w = t / t = 1 whatever the router says, so its gradient is exactly 0
            # (Hugging Face's autograd leaves rounding noise, dw/t - dw t/t^2)
            assert torch.count_nonzero(grads[name]) == 0 and g.norm() < 1e-8 * hf_grads["lm_head.weight"].norm()
            continue
        rel = ((grads[name] - g).norm() / g.norm()).item()
        assert rel <= 1e-4, f"{name}: relative error {rel:.2e}"


# ---- against the autograd reference, fp64 --------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    dict(experts=4, experts_per_token=2),
    dict(experts=5, experts_per_token=3, shared_expert_ffn=24, router_jitter=0.2, dropout=0.1, kv_heads=1),
    dict(experts=3, experts_per_token=1, shared_expert_ffn=16, attention="tiled", attention_tile=4),
])
def test_gradients_equal_the_autograd_reference_fp64(fields):
    cfg = Config.from_preset("tiny", dtype="float64", **fields)
    params = init_params(cfg, seed=1)
    ids, targets = make_batch(cfg, 2, 13, "cpu", seed=1)
    torch.manual_seed(3)
    loss, grads = loss_and_grads(params, cfg, ids, targets, "none")
    reference = ReferenceLlama(cfg, params)
    torch.manual_seed(3)  # the same dropout masks and jitter noise, drawn in the same order
    expected = reference(ids, targets)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-12
    for name, g in reference.grads().items():
        if cfg.experts_per_token == 1 and name.endswith("mlp.gate.weight"):  # w = t / t = 1: no gradient at all
            assert torch.count_nonzero(grads[name]) == 0 and g.norm() < 1e-16
            continue
        rel = ((grads[name] - g).norm() / g.norm()).item()
        assert rel <= 1e-10, f"{name}: relative error {rel:.2e}"


# ---- every recomputation choice: bitwise the gradients of storing everything --------------------------

POLICIES = ["full", "every:2", "every:3", "selective", "cheap", "moe_act", "moe", "shared_experts", "router",
            "selective+moe", "cheap+moe+shared_experts+router", "full+moe", "every:2+moe_act", "every:2+cheap+moe",
            "full+router", "budget:60KiB+router",
            "budget:60KiB", "budget:60KiB+moe_act", "budget:36KiB"]


def run_all(cfg, policies, seq=13):
    params = init_params(cfg, seed=2)
    ids, targets = make_batch(cfg, 2, seq, "cpu", seed=2)
    results = {}
    for policy in ["none"] + policies:
        torch.manual_seed(7)  # the same first-forward draws (dropout, jitter) for every policy
        results[policy] = loss_and_grads(params, cfg, ids, targets, policy)
    return results


def assert_bitwise(results):
    loss, grads = results.pop("none")
    for policy, (other_loss, other) in results.items():
        assert torch.equal(other_loss, loss), policy
        for name in grads:
            assert torch.equal(other[name], grads[name]), f"{policy}: {name} differs"


@pytest.mark.parametrize("fields", [
    dict(experts=4, experts_per_token=2, shared_expert_ffn=24, router_jitter=0.05, dropout=0.1),
    dict(experts=3, experts_per_token=1, shared_expert_ffn=16, attention="tiled", attention_tile=8),
])
def test_every_policy_is_bitwise_equal_to_none(fields):
    cfg = Config.from_preset("tiny", layers=4, **fields)
    assert_bitwise(run_all(cfg, POLICIES))


def test_router_jitter_alone_is_replayed_under_layer_recomputation():
    """With jitter and no dropout the only random draw is the MoE's: a recomputed layer must draw the
    same noise again (the engine saves the generator state with each checkpoint when cfg.draws_random)."""
    cfg = Config.from_preset("tiny", layers=4, experts=4, experts_per_token=2, router_jitter=0.1)
    assert cfg.draws_random and cfg.dropout == 0
    assert_bitwise(run_all(cfg, ["full", "every:2", "full+moe", "budget:36KiB"]))


def test_op_level_choices_store_and_recompute_what_they_say():
    cfg = Config.from_preset("tiny", experts=4, shared_expert_ffn=24)
    B, T = 2, 13
    names = {policy: set(layer_inventory(cfg, B, T, parse_policy(policy).unstored)) for policy in
             ("none", "moe_act", "moe", "shared_experts", "cheap", "router")}
    experts = {f"moe.{kind}[{e}]" for kind in ("gate_up", "act") for e in range(4)}
    assert experts | {"moe.router_probs", "moe.expert_index"} <= names["none"]
    assert names["none"] - names["moe_act"] == {f"moe.act[{e}]" for e in range(4)}
    assert names["none"] - names["moe"] == experts  # only the router output and the routing decision stay
    assert names["none"] - names["shared_experts"] == {"moe.shared_gate", "moe.shared_up", "moe.shared_act"}
    assert names["none"] - names["router"] == {"moe.router_probs"}  # the routing decision stays
    assert {f"moe.act[{e}]" for e in range(4)} | {"moe.shared_act"} <= names["none"] - names["cheap"]


# ---- clear errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,message", [
    (dict(experts=4, experts_per_token=5), "experts_per_token=5 is larger than experts=4: .*use 1 <= "
                                           "experts_per_token <= 4"),
    (dict(experts=4, experts_per_token=0), "experts_per_token=0: must be a whole number >= 1"),
    (dict(experts=-1), "experts=-1: must be a whole number >= 0"),
    (dict(experts_per_token=1), "experts_per_token=1 with experts=0: .*set experts > 0"),
    (dict(shared_expert_ffn=16), "shared_expert_ffn=16 with experts=0"),
    (dict(router_jitter=0.01), "router_jitter=0.01 with experts=0"),
    (dict(experts=4, router_jitter=1.5), r"router_jitter=1.5: must be a number in \[0, 1\)"),
])
def test_bad_expert_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Config.from_preset("tiny", **fields)


@pytest.mark.parametrize("policy,fields,message", [
    ("moe", {}, "policy 'moe': moe recomputes parts of a mixture of experts, and this model's MLP is dense"),
    ("full+moe_act", {}, "moe_act recomputes parts of a mixture of experts"),
    ("shared_experts", dict(experts=4), "shared_experts recomputes the shared expert's MLP, and this model has none"),
    ("moe+moe_act", dict(experts=4), "choose one of moe_act or moe"),
])
def test_bad_moe_policies(policy, fields, message):
    with pytest.raises(ValueError, match=message):
        parse_policy(policy, Config.from_preset("tiny", **fields))


def test_mixtral_configs_are_read_and_unimplemented_features_refused():
    small = dict(vocab_size=97, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, max_position_embeddings=128, num_local_experts=8, num_experts_per_tok=2)
    d = transformers.MixtralConfig(**small, router_jitter_noise=0.01, router_aux_loss_coef=0.02).to_dict()
    cfg = Config.from_hf(d)
    assert (cfg.experts, cfg.experts_per_token, cfg.router_jitter, cfg.ffn, cfg.rope_theta) == (8, 2, 0.01, 40, 1e6)
    with pytest.raises(ValueError, match="sliding_window=4096: picockpt's attention is full causal"):
        Config.from_hf({**d, "sliding_window": 4096})
    with pytest.raises(ValueError, match="output_router_logits=True: .*picockpt computes no auxiliary loss"):
        Config.from_hf({**d, "output_router_logits": True})
    with pytest.raises(ValueError, match="'capacity_factor' are not part of a Mixtral config"):
        Config.from_hf({**d, "capacity_factor": 1.25})
    with pytest.raises(ValueError, match="'num_local_experts', .* are not part of a Llama config"):
        Config.from_hf({**d, "model_type": "llama"})  # a Llama config has no experts
    with pytest.raises(ValueError, match="num_experts_per_tok=9|experts_per_token=9 is larger than experts=8"):
        Config.from_hf({**d, "num_experts_per_tok": 9})


MIXTRAL_8X7B_CONFIG_JSON = {  # mistralai/Mixtral-8x7B-v0.1 config.json, as published (transformers 4.x spelling)
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000}


def test_mixtral_8x7b_preset_has_its_published_size():
    assert Config.from_hf(MIXTRAL_8X7B_CONFIG_JSON) == Config.from_preset("mixtral-8x7b", dtype="bfloat16")
    cfg = Config.from_preset("mixtral-8x7b")  # 46.7B parameters (Mistral AI)
    assert (cfg.experts, cfg.experts_per_token, cfg.ffn, cfg.kv_heads) == (8, 2, 14336, 8)
    assert abs(cfg.num_params() / 1e9 - 46.70) < 0.01, cfg.num_params()
    assert cfg.num_params() == sum(torch.Size(shape).numel() for shape in param_shapes(cfg).values())


def test_routing_arguments_are_checked():
    cfg = Config.from_preset("tiny", experts=4)
    with pytest.raises(ValueError, match=r"counts=\[10, 10\]: give the tokens routed to each of the E=4 experts"):
        layer_inventory(cfg, 2, 13, counts=[10, 10])
    with pytest.raises(ValueError, match="summing to B\\*T\\*k=52"):
        layer_inventory(cfg, 2, 13, counts=[13, 13, 13, 12])
    with pytest.raises(ValueError, match="routing has 1 entries: give one list of per-expert token counts per layer"):
        predicted_peak_bytes(cfg, 2, 13, "none", routing=[[13, 13, 13, 13]])
    params = init_params(cfg)
    ids, _ = make_batch(cfg, 2, 13, "cpu")
    assert [sum(counts) for counts in step_routing(params, cfg, ids)] == [2 * 13 * 2] * cfg.layers

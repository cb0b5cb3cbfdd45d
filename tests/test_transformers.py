"""Against Hugging Face transformers' LlamaForCausalLM: same weights, same logits, loss, gradients."""
import pytest
import torch
from torch.testing import assert_close

from picockpt import Config, loss_and_grads
from picockpt.measurement.reference import ReferenceLlama
from conftest import random_norms

transformers = pytest.importorskip("transformers")


def hf_model(**kw):
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=5000.0, rms_norm_eps=1e-4,
        tie_word_embeddings=False, **kw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    return random_norms(model)


def hf_loss(model, ids, targets):
    logits = model(input_ids=ids).logits  # (B, T, V)
    return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@pytest.mark.parametrize("rope_scaling", [None, "llama3"])
def test_same_logits_loss_and_grads_as_transformers(rope_scaling):
    kw = {}
    if rope_scaling:
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    model = hf_model(**kw)
    cfg = Config.from_hf(model.config.to_dict(), dtype="float32")
    assert (cfg.heads, cfg.kv_heads, cfg.rope_theta, cfg.norm_eps) == (6, 2, 5000.0, 1e-4)
    assert (cfg.rope_scaling is None) == (rope_scaling is None)
    params = {k: v.detach() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 97, (2, 37))
    targets = torch.randint(0, 97, (2, 37))

    logits, loss = hf_loss(model, ids, targets)
    loss.backward()
    ours, grads = loss_and_grads(params, cfg, ids, targets)
    assert_close(ours, loss.detach(), rtol=1e-5, atol=1e-6)

    reference = ReferenceLlama(cfg, params)  # our autograd model, for the logits
    x = reference.model.embed_tokens(ids)
    for layer in reference.model.layers:
        x = layer(x)
    our_logits = torch.nn.functional.linear(reference.model.norm(x), params["lm_head.weight"])
    assert_close(our_logits, logits, rtol=1e-5, atol=1e-5)

    hf_grads = {k: p.grad for k, p in model.named_parameters()}
    assert set(grads) == set(hf_grads)
    for name, g in hf_grads.items():
        assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")

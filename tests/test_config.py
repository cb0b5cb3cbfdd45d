import pytest

from picockpt import Config
from picockpt.model.config import PRESETS


@pytest.mark.parametrize("fields,match", [
    (dict(hidden=50, heads=4), "hidden=50 is not divisible by heads=4"),
    (dict(heads=4, kv_heads=3), "kv_heads=3 does not divide heads=4"),
    (dict(layers=0), "layers=0"),
    (dict(vocab=-3), "vocab=-3"),
    (dict(ffn=2.5), "ffn=2.5"),
    (dict(hidden=12, heads=4), "head_dim = 3 is odd"),
    (dict(dropout=1.0), "dropout=1.0"),
    (dict(dtype="int8"), "dtype='int8'"),
    (dict(norm_eps=0.0), "norm_eps"),
])
def test_invalid_values_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        Config.from_preset("tiny", **fields)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="preset='huge'.*tiny"):
        Config.from_preset("huge")


def test_seq_longer_than_max_positions():
    cfg = Config.from_preset("tiny")
    with pytest.raises(ValueError, match=f"seq={cfg.max_seq + 1} is longer than Config.max_seq"):
        cfg.check_seq(cfg.max_seq + 1)


def test_llama3_shapes_and_parameter_counts():
    # published sizes: 8.03B, 70.6B, 405.9B parameters
    for name, billions in (("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)):
        cfg = Config.from_preset(name)
        assert abs(cfg.num_params() / 1e9 - billions) < 0.01, (name, cfg.num_params())
    assert set(PRESETS) >= {"tiny", "small", "llama3-8b", "llama3-70b", "llama3-405b"}


def test_dtype_aliases():
    assert Config.from_preset("tiny", dtype="bf16").dtype == "bfloat16"
    assert Config.from_preset("tiny", dtype="fp64").dtype == "float64"


def test_from_hf_dict():
    d = {"vocab_size": 100, "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 6,
         "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 1234.0, "rope_type": "default"},
         "hidden_act": "silu", "tie_word_embeddings": False}
    cfg = Config.from_hf(d)
    assert (cfg.vocab, cfg.hidden, cfg.kv_heads, cfg.rope_theta, cfg.max_seq) == (100, 48, 2, 1234.0, 256)
    with pytest.raises(ValueError, match="hidden_act"):
        Config.from_hf({**d, "hidden_act": "gelu"})


@pytest.mark.parametrize("fields,hint", [
    (dict(hidden=32, heads=3, kv_heads=1), "e.g. hidden=30), or heads among [1, 2, 4, 8, 16]"),  # not 33: head_dim 11
    (dict(hidden=4096, heads=3, kv_heads=1), "e.g. hidden=4098)"),  # not 4095: head_dim 1365
])
def test_the_divisibility_hint_suggests_only_values_config_accepts(fields, hint):
    with pytest.raises(ValueError) as error:
        Config(**fields)
    assert hint in str(error.value)
    suggested = int(str(error.value).split("e.g. hidden=")[1].split(")")[0])
    assert Config(**{**fields, "hidden": suggested}).head_dim % 2 == 0


def test_policy_texts_name_what_is_wrong():
    from picockpt.recompute.policy import parse_policy, parse_size
    with pytest.raises(ValueError, match=r"policy 'selective\+selective': selective is given twice; name it once"):
        parse_policy("selective+selective")
    with pytest.raises(ValueError, match=r"policy 3 \(int\) is not a policy string: use one of none, full"):
        parse_policy(3)
    with pytest.raises(ValueError, match=r"size '0.5' is 0.5 bytes, less than one byte: give a unit \(e.g. 0.5MiB\)"):
        parse_size("0.5")
    assert parse_size("0.5KiB") == 512

"""python -m picockpt predict: the published figures, picockpt's exact ones, JSON keys, clear errors."""
import json
import subprocess
import sys

import pytest

from picockpt import Config
from picockpt.cli import main
from picockpt.formulas import korthikanti_layer_bytes
from picockpt.inventory import predicted_peak_bytes

KEYS = ("model", "layers", "hidden", "heads", "kv_heads", "seq", "batch", "recompute", "tp", "sp", "formula",
        "per_layer_bytes", "per_layer_gib", "embedding_dropout_bytes", "activation_bytes", "activation_gib",
        "picockpt_dtype", "picockpt_per_layer_bytes", "picockpt_peak_bytes", "picockpt_peak_gib",
        "published_flops", "picockpt_flops")


def predict_json(capsys, *args):
    assert main(["predict", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("recompute,gib", [("none", 97.02), ("selective", 17.02), ("full", 1.02)])
def test_llama3_8b_at_4096_tokens(capsys, recompute, gib):
    row = predict_json(capsys, "--model", "llama3-8b", "--seq", "4096", "--batch", "1", "--recompute", recompute)
    for key in KEYS:
        assert key in row, key
    assert round(row["activation_gib"], 2) == gib
    assert row["activation_bytes"] == 32 * row["per_layer_bytes"] + 4096 * 4096  # + the embedding dropout mask
    cfg = Config.from_preset("llama3-8b", dtype="bf16")
    assert row["picockpt_dtype"] == "bfloat16"
    assert row["picockpt_peak_bytes"] == predicted_peak_bytes(cfg, 1, 4096, recompute)


def test_tensor_and_sequence_parallel(capsys):
    row = predict_json(capsys, "--model", "llama3-70b", "--seq", "8192", "--tp", "8", "--sp")
    assert row["formula"] == "sbh(34/t + 5as/(ht))"
    assert row["per_layer_bytes"] == korthikanti_layer_bytes(8192, 1, 8192, 64, t=8, sp=True)
    assert row["embedding_dropout_bytes"] == 8192 * 8192 // 8
    no_sp = predict_json(capsys, "--model", "llama3-70b", "--seq", "8192", "--tp", "8")
    assert no_sp["formula"] == "sbh(10 + 24/t + 5as/(ht))"
    assert no_sp["per_layer_bytes"] - row["per_layer_bytes"] == 10 * 8192 * 8192 * (1 - 1 / 8)


def test_shape_flags_and_dtype(capsys):
    row = predict_json(capsys, "--layers", "4", "--hidden", "256", "--heads", "8", "--kv-heads", "2",
                       "--ffn", "512", "--vocab", "1000", "--seq", "128", "--batch", "2", "--dtype", "fp32")
    assert (row["layers"], row["hidden"], row["heads"], row["kv_heads"]) == (4, 256, 8, 2)
    assert row["per_layer_bytes"] == korthikanti_layer_bytes(128, 2, 256, 8)
    cfg = Config.from_preset("llama3-8b", layers=4, hidden=256, heads=8, kv_heads=2, ffn=512, vocab=1000)
    assert row["picockpt_peak_bytes"] == predicted_peak_bytes(cfg, 2, 128, "none")  # fp32, as asked


def test_table_names_both_sources(capsys):
    assert main(["predict", "--model", "llama3-405b", "--seq", "1024", "--recompute", "selective"]) == 0
    out = capsys.readouterr().out
    assert "per_layer_bytes" in out and "activation_bytes" in out and "66.95 GiB" in out
    assert "picockpt's exact store" in out and "sbh(34)" in out


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "--tp=3"),
    (["--tp", "0"], "--tp=0"),
    (["--model", "llama3-7b"], "--model='llama3-7b'"),
    (["--recompute", "some"], "--recompute='some'"),
    (["--seq", "0"], "seq=0"),
])
def test_user_mistakes_are_one_line_errors(args, message):
    out = subprocess.run([sys.executable, "-m", "picockpt", "predict", *args], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and message in out.stderr and "Traceback" not in out.stderr

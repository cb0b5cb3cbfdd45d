"""Kernel efficiency by shape (picockpt/planning/kernel_rates.py): the published H100 rates read as their sources
give them, a matmul of fewer tiles than SMs slower in proportion, the roofline given back exactly with the
correction off, and a table measured here (kernel_bench.py) read back by the search."""
import json
import pathlib
import subprocess
import sys
from dataclasses import replace

import pytest

from picockpt import Config
from picockpt.cli import main
from picockpt.planning.cost import HARDWARE, layer_ops
from picockpt.planning.kernel_bench import measure_kernel_rates
from picockpt.planning.kernel_rates import SEQ_POINTS, TILE, from_json, op_seconds, published
from picockpt.planning.layout_time import Model, microbatch_seconds

H100 = HARDWARE["h100"]
BIG = Config.from_preset("llama3-405b", dtype="bf16").replace(attention="fused")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_published_rates_are_the_sources_numbers():
    """The MAMF table's 792.1 of 989 TFLOP/s; cuDNN's causal forward at 8k, 529; its backward at 8k, 518 as the
    flash benchmarks count it (2.5 forwards), 518 x 2.5 / 2 in the model's count of 2."""
    rates = published("h100")
    assert rates.gemm_efficiency == pytest.approx(0.801, abs=5e-4)
    assert rates.attention_rate("forward", 8192) == pytest.approx(529e12)
    assert rates.attention_rate("backward", 8192) == pytest.approx(518e12 * 2 / 2.5)
    assert published("h100", "flash2").attention_rate("forward", 8192) == pytest.approx(333e12)
    assert published("a100") is None  # no published table wired: the roofline
    with pytest.raises(ValueError, match="--attention-kernel"):
        published("h100", "flash9")


def test_attention_rates_interpolate_in_log_length_and_stay_flat_past_the_ends():
    rates = published("h100")
    low, high = rates.attention_rate("forward", 2048), rates.attention_rate("forward", 4096)
    assert low < rates.attention_rate("forward", 2896) < high  # 2^11.5: halfway in log2
    assert rates.attention_rate("forward", 2896) == pytest.approx((low + high) / 2, rel=1e-3)
    assert rates.attention_rate("forward", 131072) == rates.attention_rate("forward", SEQ_POINTS[-1])
    assert rates.attention_rate("backward", 64) == rates.attention_rate("backward", SEQ_POINTS[0])


def test_a_matmul_of_fewer_tiles_than_sms_runs_slower_in_proportion():
    rates, peak = published("h100"), H100.matmul
    full = rates.gemm_rate(8192, 8192, 8192, peak)
    assert full == pytest.approx(peak * rates.gemm_efficiency)
    tiles = (1024 // TILE[0]) * (1024 // TILE[1])  # 32 tiles on 132 SMs
    assert rates.gemm_rate(1024, 1024, 8192, peak) == pytest.approx(full * tiles / rates.sms)


def test_with_the_correction_off_every_kernel_runs_at_the_roofline():
    """Model(kernels=False) is the model before it: a backward twice the forward, every op at the peak."""
    t = microbatch_seconds(BIG, 8192, 8, True, 1, 8, False, "none", H100, 1, Model(kernels=False,
                                                                                   accumulation=False))
    assert t["compute"] == pytest.approx(3 * t["forward"])
    on = microbatch_seconds(BIG, 8192, 8, True, 1, 8, False, "none", H100, 1, Model(accumulation=False))
    assert 1 / 0.80 < on["compute"] / t["compute"] < 1.5  # the matmuls at 80% or less, attention at about 55%


def test_op_seconds_without_rates_is_the_roofline():
    for op in layer_ops(BIG, 1, 8192, 8, True, causal_skip=True):
        roofline = sum(max(f / H100.matmul, b / H100.memory) for f, b in op.kernels)
        assert op_seconds(op, H100) == pytest.approx(roofline)
        assert op_seconds(op, H100, None, "backward") == pytest.approx(2 * roofline)


def test_a_measured_table_is_read_back_and_prices_the_nearest_shape(tmp_path):
    import torch
    rates = measure_kernel_rates("cpu", [(64, 128, 32), (256, 512, 128)], seqs=(32, 64), dtype=torch.float32,
                                 repeats=1, tokens=64)
    assert rates.gemm_efficiency == 1.0 and len(rates.gemms) == 2 and [r[0] for r in rates.attention] == [32, 64]
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(rates.to_json()))
    back = from_json(path)
    assert back == rates
    assert back.gemm_rate(250, 500, 130, 1.0) == rates.gemms[1][3]  # the nearest measured shape's rate
    hw = replace(H100, kernels=back)
    assert microbatch_seconds(BIG.replace(layers=2), 512, 1, False, 1, 1, False, "none", hw, 1)["compute"] > 0
    path.write_text("{}")
    with pytest.raises(ValueError, match="--kernels .*not a kernel-rate table"):
        from_json(path)


def test_the_measuring_script_runs_on_the_cpu(tmp_path):
    out = tmp_path / "rates.json"
    run = subprocess.run([sys.executable, str(ROOT / "lessons" / "kernel_rates.py"), "--tiny", "--repeats", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "fastest matmul" in run.stdout and from_json(out).gemms


def test_predict_search_names_its_kernel_rates(capsys):
    args = ["predict", "--search", "--model", "llama3-8b", "--seq", "4096", "--gpus", "64",
            "--tokens-per-batch", "1M", "--gpu-gib", "80"]
    assert main(args + ["--json", "--top", "1"]) == 0
    published_row = json.loads(capsys.readouterr().out)
    assert "Maximum Achievable Matmul FLOPS" in published_row["kernels"]
    assert main(args + ["--json", "--top", "1", "--kernels", "peak"]) == 0
    peak_row = json.loads(capsys.readouterr().out)
    assert "roofline" in peak_row["kernels"]
    assert peak_row["layouts"][0]["mfu"] > published_row["layouts"][0]["mfu"]
    assert main(args + ["--kernels", "peak", "--attention-kernel", "flash2"]) == 2
    assert "--attention-kernel flash2 with --kernels peak" in capsys.readouterr().err
    assert main(["predict", "--kernels", "peak"]) == 2
    assert "only --search reads it" in capsys.readouterr().err

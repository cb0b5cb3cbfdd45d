"""The layout search (picockpt/planning/layout_search.py): its memory is the closed forms the parallel runs are checked
against, its ranking is by the modelled step, and predict --search refuses what it would ignore."""
import json

import pytest

from picockpt import Config
from picockpt.cli import main
from picockpt.planning.cost import HARDWARE
from picockpt.planning.layout_memory import (model_state_bytes, reserve_bytes, split_layers, stage_activation_bytes, stage_bytes,
                                    stage_params)
from picockpt.planning.layout_search import LLAMA3_405B_TABLE_4, rank_of, search
from picockpt.parallel.pipeline_parallel.pp_forms import ChunkForms
from picockpt.parallel.tensor_parallel.tp_forms import rank_peak_bytes
from picockpt.parallel import Layout

CFG = Config.from_preset("tiny", attention="fused", layers=4)


@pytest.mark.parametrize("split", ["even", "lighter ends"])
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_the_stages_hold_every_parameter_once(pp, split):
    counts = split_layers(CFG.layers, pp, split)
    assert sum(counts) == CFG.layers
    assert sum(stage_params(CFG, 1, counts, s) for s in range(pp)) == CFG.num_params()


def test_model_state_bytes_a_parameter():
    """DDP 18; Megatron's distributed optimizer 6 + 12/d (its docs' bf16-param, fp32-grad row); gradients sharded
    2 + 16/d; FSDP 16/d (and two layers gathered in bf16); FSDP2 keeping its bf16 gather, fp32 gradients unsharded
    until the last micro-batch, 6 + 16/d."""
    params, d = 10**6, 8
    assert model_state_bytes(params, "0", d) == 18 * params
    assert model_state_bytes(params, "1", d) == (6 + 12 / d) * params
    assert model_state_bytes(params, "2", d) == (2 + 16 / d) * params
    assert model_state_bytes(params, "3", d, layers=4) == 16 / d * params + 2 * params * 2 // 4
    assert model_state_bytes(params, "3+keep", d) == (6 + 16 / d) * params


def test_activations_are_the_tensor_and_pipeline_closed_forms():
    """pp = 1: one micro-batch in flight, the tensor-parallel rank's store on one sequence (tp_forms, measured by
    tests/test_parallel_tp.py); pp > 1: every stage's 1F1B peak (pp_forms), w = min(p - s, M) in flight."""
    assert stage_activation_bytes(CFG, 64, 2, True, 1, 4, True, 1, "full") == \
        rank_peak_bytes(CFG, 1, 64, "full", 2, True)
    for s in range(2):
        assert stage_activation_bytes(CFG, 64, 1, False, 1, 2, s == 1, min(2 - s, 4), "none") == \
            ChunkForms(CFG, 4, 64, "none", Layout(pp=2, microbatches=4), s).peak_bytes


def test_every_layout_kept_fits_and_the_best_comes_first():
    capacity = reserve_bytes(0) + 2**19  # the fixed reserve and 0.5 MiB: some layouts fit, some do not
    rows, considered = search(CFG, 64, 8, 64 * 16, capacity, HARDWARE["h100"])
    assert 0 < len(rows) < considered
    assert all(row["peak_bytes"] <= capacity and row["fits"] for row in rows)
    assert [row["step_seconds"] for row in rows] == sorted(row["step_seconds"] for row in rows)
    assert all(row["tp"] * row["cp"] * row["pp"] * row["dp"] == 8 for row in rows)
    assert all(row["dp"] * row["microbatches"] == 16 for row in rows)  # every sequence of the batch, once
    assert rank_of(rows, (rows[0]["tp"], rows[0]["cp"], rows[0]["pp"], rows[0]["dp"]))[0] == 1


def test_llama3_405b_table_4_layouts_fit_and_are_ranked():
    cfg, hw = Config.from_preset("llama3-405b", dtype="bf16"), HARDWARE["h100"]
    gpus, seq, layout, _, reported = LLAMA3_405B_TABLE_4[1]
    rows, _ = search(cfg, seq, gpus, 2**24, 80 * 2**30, hw)
    rank, row = rank_of(rows, layout)
    assert rank is not None and row["mfu"] > reported  # a model at datasheet ceilings sits above a real run


def test_predict_search_json_and_text(capsys):
    """--json gives the top N distinct splits only; the text puts distinct splits first, in rows under 110
    characters, with a legend for every abbreviation."""
    args = ["predict", "--search", "--model", "llama3-8b", "--seq", "4096", "--gpus", "64",
            "--tokens-per-batch", "1M", "--gpu-gib", "80"]
    assert main(args + ["--json", "--top", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_per_batch"] == 2**20 and len(out["layouts"]) == 4 < out["distinct_splits"] <= out["fit"]
    assert len({(r["tp"], r["cp"], r["pp"], r["dp"]) for r in out["layouts"]}) == 4
    assert {"tp", "cp", "pp", "dp", "sp", "zero", "microbatches", "schedule", "policy", "split", "peak_bytes",
            "step_seconds", "mfu"} <= set(out["layouts"][0])
    assert main(args + ["--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "why the best wins" in text and "sequence parallel" in text and "lighter first and last" in text
    table = text.split("fastest splits:\n")[1].split("\n")[:4]
    assert all(len(line) < 110 for line in text.splitlines())
    assert [line.split()[0] for line in table[1:]] == ["1", "2", "3"]
    splits = [tuple(line.split()[1:5]) for line in table[1:]]
    assert len(set(splits)) == 3


@pytest.mark.parametrize("flags,message", [
    (["--search", "--gpus", "8", "--tokens-per-batch", "8K", "--tp", "8"], "--tp with --search: the search chooses it for every layout"),
    (["--search", "--gpus", "8"], "--search needs --tokens-per-batch"),
    (["--gpus", "8"], "--gpus: only --search reads it"),
    (["--search", "--gpus", "8", "--tokens-per-batch", "5000", "--seq", "4096"], "not a whole number of --seq"),
    (["--search", "--gpus", "8", "--tokens-per-batch", "1.5x"], "--tokens-per-batch='1.5x'"),
    (["--search", "--gpus", "8", "--tokens-per-batch", "1e400"], "--tokens-per-batch='1e400': give a positive whole"),
    (["--search", "--gpus", "0", "--tokens-per-batch", "8K"], "--gpus=0"),
    (["--search", "--gpus", "10000019", "--tokens-per-batch", "128K"], "--gpus 10,000,019: no split"),
    (["--search", "--gpus", "64", "--tokens-per-batch", "1M", "--dropout", "0.1"], "--dropout 0.1 with --search"),
])
def test_predict_search_refuses_with_the_flag(flags, message, capsys):
    assert main(["predict", *flags]) != 0
    assert message in capsys.readouterr().err


def test_zb_h1_holds_what_its_waiting_weight_passes_read():
    """Against 1F1B, ZB-H1 leaves stage 0's activations as they are and adds, on stage s, s waiting W's of its layers
    (pp_orders.w_pending_bytes), and fills the bubble to a third of 1F1B's."""
    from picockpt.planning.layout_search import evaluate
    from picockpt.parallel.pipeline_parallel.pp_orders import w_pending_bytes
    hw, cfg = HARDWARE["h100"], CFG.replace(dtype="bfloat16")
    counts = split_layers(cfg.layers, 2)
    acts = {schedule: [stage_bytes(cfg, 64, Layout(dp=2, pp=2, microbatches=4, schedule=schedule, sp=False), counts, s,
                                   "1", "none")["activations"] for s in range(2)] for schedule in ("1f1b", "zb-h1")}
    assert acts["zb-h1"][0] == acts["1f1b"][0] and acts["zb-h1"][1] - acts["1f1b"][1] == 2 * w_pending_bytes(cfg, 1, 64)
    rows = {schedule: evaluate(cfg, 64, 4, 64 * 8, 2**40, hw, Layout(dp=2, pp=2, microbatches=4, schedule=schedule),
                               "1", "none")
            for schedule in ("1f1b", "zb-h1")}
    assert rows["zb-h1"]["terms_seconds"]["bubble"] == pytest.approx(rows["1f1b"]["terms_seconds"]["bubble"] / 3)

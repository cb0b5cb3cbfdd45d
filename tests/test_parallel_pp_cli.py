"""Pipeline and data parallelism from the outside: clear errors before any rank starts, a failing stage
that leaves no process behind, and `python -m picockpt parallel --pp ... --json`."""
import json
import multiprocessing
import time

import pytest
import torch

from picockpt import Config, init_params
from picockpt.cli import main
from picockpt.measurement.measure import make_batch
from picockpt.parallel import Layout, loss_and_grads, ParallelJob, run_jobs, run_ranks
from picockpt.parallel.job import checked_job, on_cpu
from picockpt.parallel.rank import rank_steps

from processes import no_process_left_behind  # noqa: F401 (a fixture)
from conftest import split_layout

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"

pytestmark = pytest.mark.usefixtures("no_process_left_behind")


def tiny(batch=4, seq=8, **fields):
    cfg = Config.from_preset("tiny", **fields)  # L=2, heads 4, kv_heads 2, ffn 80, vocab 64
    return cfg, init_params(cfg, seed=0), *make_batch(cfg, batch, seq, "cpu", seed=0)


@pytest.mark.parametrize("fields,batch,kwargs,message", [
    (dict(), 4, dict(pp=3), r"^pp=3 is larger than the number of layers L=2: every stage needs at least one layer; "
                            r"use pp <= 2$"),
    (dict(), 4, dict(pp=2, microbatches=0), r"^microbatches=0: use a whole number of micro-batches per step, 1 or "
                                            r"more$"),
    (dict(), 6, dict(pp=2, microbatches=4), r"^batch=6 is not divisible into dp x microbatches = 1 x 4 = 4 "
                                            r"micro-batches of equal size; use a batch that is a multiple of 4$"),
    (dict(), 4, dict(pp=1, dp=2, microbatches=4), r"^batch=4 is not divisible into dp x microbatches = 2 x 4 = 8 "),
    (dict(), 4, dict(pp=2, schedule="gpipe"), r"^schedule='gpipe': use one of 'afab' \(all forward then all backward\), '1f1b' "),
    (dict(), 4, dict(pp=0), r"^pp=0: use a whole number of pipeline stages, 1 or more$"),
    (dict(), 4, dict(pp=2, dp=0), r"^dp=0: use a whole number of data-parallel replicas, 1 or more$"),
    (dict(attention="tiled", dropout=0.1), 4, dict(pp=2, microbatches=2),
     r"^attention='tiled' with dropout=0.1 and dp x microbatches = 2: each tile's mask comes from a generator"),
    (dict(), 4, dict(pp=2, microbatches=2, policy="budget:20KiB"),
     r"^stage 0 \(layers 0\.\.0\): budget=20,480 bytes \(0\.02 MiB\) is below what this stage needs with 2 "
     r"micro-batches in flight: the least found is [0-9,]+ bytes; use budget:"),
    (dict(), 4, dict(pp=2, tp=3), r"^tp=3 is larger than allowed: at most kv_heads=2 ranks"),
])
def test_user_mistakes_are_value_errors_naming_the_values(fields, batch, kwargs, message):
    cfg, params, input_ids, targets = tiny(batch=batch, **fields)
    with pytest.raises(ValueError, match=message):
        layout, kwargs = split_layout(kwargs, Layout(tp=2))
        loss_and_grads(params, cfg, input_ids, targets, layout=layout, **kwargs)


def test_a_process_count_that_does_not_factor_is_refused():
    cfg, params, input_ids, targets = tiny()
    job = ParallelJob(params, cfg, input_ids, targets, "full", Layout(pp=2, microbatches=2))
    with pytest.raises(ValueError, match=r"^3 processes do not factor into dp x pp x tp = 1 x 2 x 1 = 2; choose dp, "
                                         r"pp, tp with product 3, e\.g\. 1x1x3, 1x3x1, 3x1x1$"):
        run_jobs([job], world_size=3)


# ---- a failing stage ends the run at once, and no process outlives it ---------------------------------
def fail_on_the_last_stage(comm, jobs):
    if comm.rank == 1:
        raise ValueError("stage 1 stops before its first receive")
    return rank_steps(comm, jobs)  # stage 0 waits on the gradient of its first micro-batch, from a stage that is gone


@pytest.mark.ranks
def test_a_stage_failing_mid_step_stops_the_others_at_once():
    cfg, params, input_ids, targets = tiny()
    job = on_cpu(checked_job(ParallelJob(params, cfg, input_ids, targets, "full", Layout(pp=2, microbatches=2)), "cpu",
                             2))
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^rank 1 of 2: stage 1 stops before its first receive$"):
        run_ranks(fail_on_the_last_stage, 2, [job], timeout_s=60, start_method=START)
    assert time.monotonic() - start < 30  # not the 60 s timeout


# ---- python -m picockpt parallel --pp ------------------------------------------------------------------
@pytest.mark.ranks
def test_parallel_command_runs_a_pipeline_and_prints_json_per_rank(capsys):
    args = ["parallel", "--pp", "2", "--microbatches", "4", "--schedule", "1f1b", "--policy", "full", "--json",
            "--preset", "tiny", "--seq", "8", "--batch", "4", "--dropout", "0.1", "--device", "cpu"]
    assert main(args) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["pp"], row["microbatches"], row["schedule"], row["dp"], row["tp"]) == (2, 4, "1f1b", 1, 1)
    assert [(r["stage"], r["microbatches_in_flight"], r["layers"]) for r in row["ranks"]] == [(0, 2, [0, 0]),
                                                                                               (1, 1, [1, 1])]
    for r in row["ranks"]:
        assert r["peak_activation_bytes"] == r["predicted_activation_bytes"]
        assert set(r["timeline_seconds"]) == {"forward", "recompute", "backward", "wait", "send", "reduce", "idle",
                                              "total"}
        assert r["timeline_seconds"]["recompute"] > 0 and r["flops"]["recompute"] == r["predicted_flops"]["recompute"]
    assert row["grad_max_rel_diff_vs_single"] <= 1e-5
    assert abs(row["loss"] - row["single_process_loss"]) <= 1e-5 * row["single_process_loss"]


@pytest.mark.ranks
def test_parallel_command_table_with_data_parallel_overlap(capsys):
    args = ["parallel", "--dp", "2", "--microbatches", "2", "--policy", "every:2", "--preset", "tiny", "--seq", "8",
            "--batch", "4", "--device", "cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("parallel step dp=2, M=2 micro-batches, 1f1b, policy every:2 on cpu, float32, eager "
                          "attention: L=2")
    assert out.splitlines()[1] == "pipeline and data parallelism, P=1 stage, M=2, dp=2, 1f1b:"
    assert "stored peaks equal their closed forms, (in flight - 1) x stored per micro-batch + one micro-batch's peak " \
           "(picockpt/parallel/pipeline_parallel/pp_forms.py): yes" in out
    assert "data-parallel all-reduce left exposed at the end of the step: " in out
    assert "(overlapped with the backward)" in out
    assert float(out.rsplit("max relative difference ", 1)[1]) <= 1e-5


def test_parallel_command_refuses_more_stages_than_layers(capsys):
    assert main(["parallel", "--pp", "3", "--preset", "tiny", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("error: --pp 3 is larger than the number of layers L=2: every stage needs at "
                                       "least one layer; use --pp <= 2\n")
    torch.manual_seed(0)

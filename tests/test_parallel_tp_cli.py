"""Tensor parallelism from the outside: loss_and_grads' clear errors, a failing rank that leaves no
process behind, `python -m picockpt parallel` (spawned and under torchrun) and `predict --tp --sp`."""
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from picockpt import Config, init_params
from picockpt.cli import main
from picockpt.planning.published import korthikanti_layer_bytes
from picockpt.measurement.measure import make_batch
from picockpt.parallel import Layout, loss_and_grads, ParallelJob, RankError, run_jobs, run_ranks
from picockpt.parallel.tensor_parallel.tp_forms import rank_comm_bytes, rank_layer_inventory, rank_peak_bytes
from picockpt.parallel.job import on_cpu
from picockpt.parallel.rank import rank_step

from processes import free_port, no_process_left_behind  # noqa: F401 (a fixture)
from conftest import split_layout

ROOT = Path(__file__).resolve().parents[1]
START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


pytestmark = pytest.mark.usefixtures("no_process_left_behind")


def tiny(batch=2, seq=8, **fields):
    cfg = Config.from_preset("tiny", **fields)  # heads 4, kv_heads 2, ffn 80, vocab 64
    return cfg, init_params(cfg, seed=0), *make_batch(cfg, batch, seq, "cpu", seed=0)


# ---- clear errors, before any rank starts ----------------------------------------------------------
@pytest.mark.parametrize("fields,seq,kwargs,message", [
    (dict(hidden=48, heads=6, kv_heads=6, ffn=96), 8, dict(tp=4, sp=False),
     r"^tp=4 must divide both heads=6 and kv_heads=6 \(each rank computes whole query heads and the key/value "
     r"heads they read\); use tp in \[1, 2\]$"),
    (dict(), 8, dict(tp=4), r"^tp=4 is larger than allowed: at most kv_heads=2 ranks \(heads=4\), since every rank "
                            r"computes whole key/value heads; use tp in \[1, 2\]$"),
    (dict(), 7, dict(tp=2, sp=True), r"^seq=7 is not divisible by tp=2: sequence parallelism gives each rank seq/tp "
                                     r"tokens; use a seq that is a multiple of 2, or sp=False$"),
    (dict(ffn=81), 8, dict(tp=2), r"^tp=2 does not divide ffn=81: the MLP is split in t equal parts; use tp in \[1\], "
                                  r"or ffn a multiple of 2$"),
    (dict(), 8, dict(tp=2, sp=True, distribute_saved=True), r"^distribute_saved=True with sp=True: under sequence "
                                                            r"parallelism every layer input is already split"),
    (dict(attention="tiled", dropout=0.1), 8, dict(tp=2, sp=False), r"^attention='tiled' with dropout=0.1 and tp=2: "
                                                                    r"each tile's mask comes from a generator"),
    (dict(), 8, dict(tp=0), r"^tp=0: use a whole number of tensor-parallel ranks, 1 or more$"),
    (dict(), 8, dict(tp=2, policy="budget:1KiB"), r"^budget=1,024 bytes \(0\.00 MiB\) is below the least feasible"),
])
def test_user_mistakes_are_value_errors_naming_the_values(fields, seq, kwargs, message):
    cfg, params, input_ids, targets = tiny(seq=seq, **fields)
    with pytest.raises(ValueError, match=message):
        layout, kwargs = split_layout(kwargs, Layout(tp=2))
        loss_and_grads(params, cfg, input_ids, targets, layout=layout, **kwargs)


def test_more_ranks_than_torchrun_started_is_an_error_naming_tp_or_ep(monkeypatch, capsys):
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)  # as torchrun --nproc-per-node 2 leaves them; nothing connects
    cfg, params, input_ids, targets = tiny(kv_heads=4)
    with pytest.raises(ValueError, match=r"^tp=4: torchrun started 2 processes, one per rank; pass tp=2, or start "
                                         r"torchrun with --nproc-per-node 4$"):
        loss_and_grads(params, cfg, input_ids, targets, layout=Layout(tp=4))
    assert main(["parallel", "--preset", "tiny", "--kv-heads", "4", "--tp", "4", "--seq", "8", "--batch", "2",
                 "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("error: --tp 4: torchrun started 2 processes, one per rank; pass --tp 2")
    moe_cfg, moe_params, moe_ids, moe_targets = tiny(batch=4, experts=4)
    with pytest.raises(ValueError, match=r"^ep=4: torchrun started 2 processes"):
        loss_and_grads(moe_params, moe_cfg, moe_ids, moe_targets, layout=Layout(ep=4))


def test_a_port_already_taken_is_a_value_error_naming_it():
    cfg, params, input_ids, targets = tiny()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"^port={port}: cannot listen on 127\.0\.0\.1:{port} "):
            loss_and_grads(params, cfg, input_ids, targets, layout=Layout(tp=2), port=port)


# ---- a failing rank ends the run at once, and no process outlives it ---------------------------------
def fail_while_the_other_rank_waits(comm, job):
    if comm.rank == 1:
        raise ValueError("rank 1 stops before its first collective")
    return rank_step(comm, job, {})  # rank 0 waits in the embedding's all-reduce for a rank that never comes


@pytest.mark.ranks
def test_a_rank_failing_mid_step_stops_the_others_at_once():
    cfg, params, input_ids, targets = tiny()
    job = on_cpu(ParallelJob(params, cfg, input_ids, targets, "full", Layout(tp=2), rng_state=torch.get_rng_state()))
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^rank 1 of 2: rank 1 stops before its first collective$"):
        run_ranks(fail_while_the_other_rank_waits, 2, job, timeout_s=60, start_method=START)
    assert time.monotonic() - start < 30  # not the 60 s collective timeout


@pytest.mark.ranks
def test_an_error_inside_every_rank_comes_back_with_its_rank():
    cfg, params, input_ids, targets = tiny()
    broken = torch.zeros(3, dtype=torch.uint8)  # not a generator state: each rank fails to set it
    with pytest.raises(RankError, match=r"^rank [01] of 2 raised RuntimeError: .*RNG state") as caught:
        run_jobs([ParallelJob(params, cfg, input_ids, targets, "full", Layout(tp=2), rng_state=broken)],
                 start_method=START)
    assert "generator.set_state(job.rng_state)" in caught.value.remote_traceback  # where, in the rank


# ---- python -m picockpt parallel -------------------------------------------------------------------
@pytest.mark.ranks
def test_parallel_command_prints_every_rank_against_its_closed_forms(capsys):
    args = ["parallel", "--tp", "2", "--sp", "--policy", "selective", "--preset", "tiny", "--seq", "8", "--batch",
            "2", "--dropout", "0.1", "--device", "cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    cfg = Config.from_preset("tiny", dropout=0.1)
    peak = rank_peak_bytes(cfg, 2, 8, "selective", 2, True)
    assert out.startswith("parallel step tp=2, sequence parallel, policy selective on cpu, float32, eager attention: "
                          "L=2 h=32 H=4")
    assert out.splitlines()[1] == "tensor parallel, t=2, sequence parallel:"  # the one dimension that ran
    for rank in (0, 1):  # measured and predicted, to the byte
        assert re.search(rf"^{rank} +{peak:,} B +{peak:,} B ", out, re.MULTILINE), out
    assert "stored peaks and communication bytes equal their closed forms " \
           "(picockpt/parallel/tensor_parallel/tp_forms.py): yes" in out
    assert "recomputation moves nothing between ranks under this policy" in out
    difference = float(out.rsplit("max relative difference ", 1)[1])
    assert difference <= 1e-5


def test_parallel_command_refuses_a_split_that_cannot_be(capsys):
    assert main(["parallel", "--tp", "3", "--preset", "tiny", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --tp 3 is larger than allowed: at most --kv-heads 2 ranks (--heads 4), since every rank " \
                  "computes whole key/value heads; use --tp in [1, 2]\n"


@pytest.mark.ranks
def test_parallel_command_under_torchrun_gives_the_same_json():
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    environment["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "picockpt", "parallel",
               "--tp", "2", "--policy", "full", "--distribute-saved", "--preset", "tiny", "--seq", "8", "--batch", "2",
               "--device", "cpu", "--json"]
    done = subprocess.run(command, env=environment, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)  # printed once, by the process of RANK 0
    cfg = Config.from_preset("tiny")
    assert [r["rank"] for r in row["ranks"]] == [0, 1]
    for r in row["ranks"]:
        assert r["peak_activation_bytes"] == r["predicted_activation_bytes"] == rank_peak_bytes(cfg, 2, 8, "full", 2,
                                                                                                False, True)
        assert r["peak_live_bytes"] >= r["peak_activation_bytes"]
        assert r["comm_bytes"] == rank_comm_bytes(cfg, 2, 8, "full", 2, False, True)
    assert row["grad_max_rel_diff_vs_single"] <= 1e-5
    assert row["loss"] == pytest.approx(row["single_process_loss"], rel=1e-6)


# ---- python -m picockpt predict --tp --sp ----------------------------------------------------------
def test_predict_prints_table_2_beside_picockpt_per_rank(capsys):
    assert main(["predict", "--model", "llama3-70b", "--seq", "8192", "--tp", "8", "--sp", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    rows = {entry["row"]: entry for entry in row["table2"]}
    s, b, h, a = 8192, 1, 8192, 64
    tp = rows["tensor parallel"]
    assert tp["published_terms"] == {"replicated": 10 * s * b * h, "split": 24 * s * b * h / 8,
                                     "attention core": 5 * a * s * s * b / 8}
    assert tp["published_bytes"] == korthikanti_layer_bytes(s, b, h, a, 8, False)
    cfg = Config.from_preset("llama3-70b", dtype="bf16")
    inventory = rank_layer_inventory(cfg, b, s, 8, True)
    assert rows["tensor + sequence parallel"]["picockpt_bytes"] == sum(v[2] for v in inventory.values())
    assert rows["full, distributed saved activations"]["picockpt_bytes"] == 2 * s * b * h // 8
    assert row["picockpt_rank_peak_bytes"] == rank_peak_bytes(cfg, b, s, "none", 8, True)
    assert row["picockpt_rank_comm_bytes"]["forward"] == (2 + 4 * 80) * s * b * h * 2 + 3 * s * b * 4
    assert main(["predict", "--model", "llama3-70b", "--seq", "8192", "--tp", "8", "--sp"]) == 0
    out = capsys.readouterr().out
    assert "Table 2's rows at t=8, bytes of one layer per device, term by term" in out
    assert "tensor + sequence parallel + selective  sbh(34/t)" in out


# ---- arguments that would be silently ignored, and what a failing rank prints ------------------------
@pytest.mark.parametrize("kwargs,message", [
    (dict(dp=True), r"^dp=True: give a whole number of ranks"),
    (dict(sp="no"), r"^sp='no': use True or False$"),
    (dict(keep_dispatched=True), r"^keep_dispatched=True with ep=1: it keeps the rows"),
    (dict(tp=2, recompute_early=True), r"^recompute_early=True without pp"),
])
def test_arguments_of_another_layout_or_type_are_refused(kwargs, message):
    cfg, params, input_ids, targets = tiny()
    with pytest.raises(ValueError, match=message):
        layout, kwargs = split_layout(kwargs, Layout(tp=2))
        loss_and_grads(params, cfg, input_ids, targets, layout=layout, **kwargs)


@pytest.mark.parametrize("argv,message", [
    (["--sp", "--tp", "1"], "--sp with a tensor-parallel size of 1 (--tp 1)"),
    (["--sp", "--pp", "2"], "--sp with a tensor-parallel size of 1 (--tp 1, the default beside --pp/--dp"),
    (["--distribute-saved", "--dp", "2"], "--distribute-saved with a tensor-parallel size of 1"),
])
def test_the_parallel_command_refuses_sp_without_tensor_parallelism(argv, message, capsys):
    assert main(["parallel", "--preset", "tiny", "--batch", "2", "--seq", "8", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_rank_error_is_one_line_with_the_ranks_last_frame():
    from picockpt.cli.parallel_run import last_frame
    remote = ('Traceback (most recent call last):\n  File "/x/launch.py", line 9, in _spawned_rank\n    fn()\n'
              '  File "/x/comm.py", line 97, in all_reduce\n    dist.all_reduce(x)\nRuntimeError: timed out\n')
    error = RankError("rank 1 failed: RuntimeError: timed out", rank=1, remote_traceback=remote)
    assert last_frame(error) == ' (rank\'s last frame: File "/x/comm.py", line 97, in all_reduce)'


@pytest.mark.ranks
def test_trace_lines_go_to_stderr_and_the_json_stays_whole():
    done = subprocess.run([sys.executable, "-m", "picockpt", "parallel", "--preset", "tiny", "--batch", "2", "--seq",
                           "8", "--tp", "2", "--policy", "full", "--trace", "--device", "cpu", "--json"],
                          capture_output=True, text=True,
                          cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tp"] == 2  # nothing but the JSON on stdout
    assert "[rank 0] recompute segment [1..1]" in done.stderr and "[rank 1]" in done.stderr


def test_a_budget_under_tensor_parallelism_is_checked_per_rank(capsys):
    # tiny at batch 4 x 128: the single process's least budget is 724,992 B, one of two sp ranks' 362,496 B
    assert main(["parallel", "--preset", "tiny", "--tp", "2", "--sp", "--policy", "budget:40KiB", "--device",
                 "cpu"]) == 2
    assert "least feasible budget for this model and batch, 362,496 bytes" in capsys.readouterr().err

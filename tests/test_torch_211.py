"""What the first GPU run found, each as a class reproduced on the CPU: torch 2.11's surface simulated
(tests/torch_211.py), CUDA's attention ops on meta tensors, and a second device inside a tracked step.

- Attention FLOPs at the query's heads on any torch (picockpt/model/attention_flops.py), where torch < 2.12's own SDPA
  formulas assert as many K/V heads as query heads: a fused grouped-query step, and the CUDA kernels on meta tensors.
- The peers without the torch.distributed names new in 2.13 (FSDP2's all_gather_single) and under pipelining's
  stride checks (torch <= 2.11 always; here TORCH_DISTRIBUTED_DEBUG=DETAIL): their ranks spawned with the surface.
- A tracker counts its own device's storages only: a host copy inside a CUDA step is not device memory.
- The lessons that crashed (13, 18, 19, 30) and `compare --attention fused`, run whole under the surface.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.model.attention_flops import ATTENTION_FLOPS
from picockpt.device import check_torch
from picockpt.planning.step_forms import step_flops
from picockpt.measurement.measure import make_batch
from picockpt.parallel.launch import run_ranks
from picockpt.measurement.tracker import Tracker

from commands import picockpt
from processes import no_process_left_behind  # noqa: F401 (a fixture)
from torch_211 import torch_211_env, torch_211_surface  # noqa: F401 (a fixture)

aten = torch.ops.aten
GQA = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, max_seq=32, dtype="float32")


def test_fused_grouped_query_step_flops_equal_the_closed_form_on_torch_211(torch_211_surface):
    cfg = Config(**GQA, attention="fused")
    params, (ids, targets) = init_params(cfg, seed=0), make_batch(cfg, 2, 16, "cpu", seed=0)
    for policy in ("none", "full"):
        with Tracker("cpu", physical=False) as tracker:
            loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
        expected = step_flops(cfg, 2, 16, policy)
        assert {phase: tracker.flops[phase] for phase in expected} == expected, policy


@pytest.mark.parametrize("counter", ["tracker", "FlopCounterMode"])
def test_cuda_flash_kernel_on_meta_tensors_counts_query_heads_on_torch_211(torch_211_surface, counter):
    """The CUDA flash kernel's forward and backward (meta tensors: shapes only) at H = 8 query heads over 2 K/V
    heads: 2 T x T matmuls forward, 5 backward, each 2 B H T T d FLOPs."""
    B, H, KV, T, d = 2, 8, 2, 64, 16
    q = torch.empty(B, H, T, d, dtype=torch.bfloat16, device="meta")
    k, v = (torch.empty(B, KV, T, d, dtype=torch.bfloat16, device="meta") for _ in range(2))
    seed, offset = torch.empty(2, dtype=torch.uint64, device="meta"), torch.empty((), dtype=torch.uint64, device="meta")
    mode = (Tracker("cpu", physical=False) if counter == "tracker"
            else torch.utils.flop_counter.FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS))
    with mode:
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
        aten._scaled_dot_product_flash_attention_backward(out, q, k, v, out, lse, None, None, T, T, 0.0, True,
                                                          seed, offset)
    total = sum(mode.flops.values()) if counter == "tracker" else mode.get_total_flops()
    assert total == (2 + 5) * 2 * B * H * T * T * d


def test_a_tracker_counts_only_its_own_devices_storages():
    """Inside a CPU-tracked step, a tensor made on another device (meta here; on CUDA, a host copy) is not in the
    tracked device's peaks: it is in peak_elsewhere."""
    with Tracker("cpu", flops=False) as tracker:
        here = torch.ones(1000)  # 4,000 B on the tracked device
        elsewhere = torch.ones(250, device="meta")  # 1,000 B elsewhere
        del here, elsewhere
    assert tracker.peak_physical == 4000
    assert max(p["total"] for p in tracker.peaks.values()) == 4000
    assert tracker.peak_elsewhere == {"meta": 1000}


def test_torch_floor_is_refused_below_and_admits_the_gpu_images():
    check_torch("2.11.0+cu130")
    check_torch("2.13.0+cpu")
    with pytest.raises(ValueError, match=r"torch 2\.10\.1 is older than 2\.11.*pip install 'torch>=2\.11'"):
        check_torch("2.10.1")


def spawned_under_torch_211(monkeypatch):
    """Ranks spawned from here start with torch 2.11's surface (PYTHONPATH's sitecustomize)."""
    monkeypatch.setenv("PYTHONPATH", torch_211_env()["PYTHONPATH"])
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")


def relative(value, reference):
    return ((value - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.ranks
@pytest.mark.usefixtures("no_process_left_behind")
def test_fsdp2_peer_counts_its_gathers_without_the_names_new_in_213(monkeypatch):
    from picockpt.parallel.data_parallel.fsdp_peer import fsdp2_rank_steps

    spawned_under_torch_211(monkeypatch)
    cfg = Config(**GQA)
    params, (ids, targets) = init_params(cfg, seed=1), make_batch(cfg, 4, 8, "cpu", seed=1)
    (run,), _ = run_ranks(fsdp2_rank_steps, 2, params, cfg, ids, targets, [(None, True)], start_method="spawn",
                          timeout_s=120)
    assert run["forward"]["calls"] == 1 + cfg.layers  # the root, then each layer's unit
    _, grads = loss_and_grads(params, cfg, ids, targets, "none")
    assert max(relative(run["grads"][name], grads[name]) for name in grads) < 1e-5


OLDER = "error: torch 2.4.1 is older than 2.11, the oldest picockpt runs on: pip install 'torch>=2.11'"


@pytest.mark.parametrize("words", [["compare", "--help"], ["lessons/10_torch_checkpoint_side_by_side.py", "--fast"],
                                   ["lessons/gpu_benchmark.py", "--help"], ["lessons/gpu_profile.py", "--help"],
                                   ["lessons/kernel_rates.py", "--help"]])
def test_an_older_torch_is_refused_in_one_line_before_an_import_needs_a_newer_one(words, monkeypatch):
    """Every command and script, before the first import that a torch under the floor lacks (simulated: torch 2.4
    without 2.5's selective-checkpoint names, tests/old_torch_site): the floor's one line, no traceback."""
    site = str(Path(__file__).parent / "old_torch_site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (site, os.environ.get("PYTHONPATH")))))
    argv = [sys.executable, *words] if words[0].endswith(".py") else [sys.executable, "-m", "picockpt", *words]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert run.returncode in (1, 2) and run.stderr.strip() == OLDER and not run.stdout, run.stderr[-600:]


@pytest.mark.ranks
@pytest.mark.usefixtures("no_process_left_behind")
def test_zbv_peer_on_gloo_under_torch_211_says_why_it_did_not_run(monkeypatch):
    """torch < 2.12 warms ScheduleZBVZeroBubble's neighbours up with a send to every neighbouring stage, the rank's
    own other stage's too, which gloo refuses ("Pair is not connected"): every rank returns the reason instead."""
    from picockpt.parallel.pipeline_parallel.pipelining_peer import pipelining_rank_steps

    spawned_under_torch_211(monkeypatch)
    cfg = Config(**dict(GQA, layers=4))
    params, (ids, targets) = init_params(cfg, seed=1), make_batch(cfg, 4, 8, "cpu", seed=1)
    results = run_ranks(pipelining_rank_steps, 2, params, cfg, ids, targets, ("ScheduleZBVZeroBubble",), 2, 4,
                        start_method="spawn", timeout_s=60)
    assert [run.get("error", "ran").split(":")[0] for (run,) in results] == [
        "torch 2.11.0's ScheduleZBVZeroBubble cannot run on gloo"] * 2


@pytest.mark.ranks
@pytest.mark.usefixtures("no_process_left_behind")
def test_pipelining_peer_passes_the_stage_checks_of_torch_211(monkeypatch):
    """make_batch's ids and targets are (B, T) views of a (B, T + 1) buffer: strides (T + 1, 1)."""
    from picockpt.parallel.pipeline_parallel.pipelining_peer import pipelining_rank_steps

    spawned_under_torch_211(monkeypatch)
    cfg = Config(**dict(GQA, layers=4))
    params, (ids, targets) = init_params(cfg, seed=1), make_batch(cfg, 4, 8, "cpu", seed=1)
    assert ids.stride() != ids.contiguous().stride()
    results = run_ranks(pipelining_rank_steps, 2, params, cfg, ids, targets, ("ScheduleInterleaved1F1B",), 2, 4,
                        start_method="spawn", timeout_s=60)
    grads = {name: g for (run,) in results for name, g in run["grads"].items()}
    _, reference = loss_and_grads(params, cfg, ids, targets, "none")
    assert grads.keys() == reference.keys()
    assert max(relative(grads[name], reference[name]) for name in reference) < 1e-5


def test_compare_with_fused_attention_on_torch_211(torch_211_surface):
    done = picockpt("compare", "--preset", "tiny", "--attention", "fused", "--kv-heads", "2", "--repeats", "1")
    assert done.returncode == 0, done.stderr


@pytest.mark.notebooks
def test_the_lessons_that_crashed_on_the_gpu_image_run_under_torch_211(tmp_path):
    """Lessons 13, 18, 19 and 30 crashed on the GPU image's torch 2.11. One lesson of each class, whole: 13 (the
    attention FLOP formula; 18 crashed on the same) and 30 (pipelining's stride checks, across ranks). 19's class,
    the distributed names new in 2.13, is the FSDP2 peer's test above; on a GPU, .ci/gpu's lessons-fast runs all."""
    env = {**torch_211_env(), "PICOCKPT_FIGURES": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "picockpt", "reproduce", "--fast", "--only", "13,30"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

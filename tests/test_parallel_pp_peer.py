"""torch's own pipelining (torch.distributed.pipelining) beside picockpt's single process: ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble on the autograd reference model, P=2 gloo ranks, V=2 virtual
stages of one layer each, M=4 micro-batches of one sequence (picockpt/parallel/pipeline_parallel/pipelining_peer.py).

One launch of 2 ranks runs every schedule (a fresh model each). Checked: the loss and every parameter's gradient
(the ranks' union) equal loss_and_grads(..., policy="none")'s in fp32 (rtol 1e-5, atol 1e-6); each rank holds the
virtual stages torch's stage-to-rank mapping gives it; and each rank's peak of bytes saved for backward follows the
most stage-micro-batches its schedule's actions keep in flight (an F adds one, a full B or a W ends it, an I does
not: it keeps the graph for its W), compared between interleaved 1F1B and zero bubble on each rank.
"""
import multiprocessing
import re

import pytest

from picockpt import loss_and_grads
from picockpt.model.config import Config
from picockpt.measurement.measure import make_batch
from picockpt.model.params import init_params
from picockpt.parallel.launch import run_ranks
from picockpt.parallel.pipeline_parallel.pipelining_peer import SCHEDULES, pipelining_rank_steps

from processes import no_process_left_behind  # noqa: F401 (a fixture)

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
P, V, M, BATCH, SEQ = 2, 2, 4, 4, 8
CFG = dict(vocab=65, hidden=32, layers=4, heads=4, kv_heads=2, ffn=24, max_seq=64, dtype="float32")
STAGES = {"ScheduleInterleaved1F1B": [[0, 2], [1, 3]], "ScheduleInterleavedZeroBubble": [[0, 2], [1, 3]],
          "ScheduleZBVZeroBubble": [[0, 3], [1, 2]]}  # "loop" mapping: stage k on rank k % P; "v": rank s, 2P-1-s
pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_process_left_behind", "one_thread")]


@pytest.fixture(scope="module")
def launched():
    """Every schedule of SCHEDULES, one launch of 2 ranks, and the single process's loss and gradients."""
    cfg = Config(**CFG)
    params, (input_ids, targets) = init_params(cfg, seed=1), make_batch(cfg, BATCH, SEQ, "cpu", seed=1)
    results = run_ranks(pipelining_rank_steps, P, params, cfg, input_ids, targets, SCHEDULES, V, M,
                        start_method=START, timeout_s=60)
    loss, grads = loss_and_grads(params, cfg, input_ids, targets, policy="none")
    return {name: [results[r][v] for r in range(P)] for v, name in enumerate(SCHEDULES)}, float(loss), grads


def ran(launched, name):
    """The ranks' results for schedule `name`; skipped (with torch's error) where it did not run here."""
    runs = launched[0][name]
    errors = [run["error"] for run in runs if "error" in run]
    if errors:
        pytest.skip(f"{name} did not run on gloo/CPU: {errors[0]}")
    return runs


def most_in_flight(actions):
    """The most stage-micro-batches held at once by a rank running `actions` ("2F0", "2I0", "2W0", "3B1", ...)."""
    held = most = 0
    for action in actions:
        kind = re.fullmatch(r"\d+([A-Z]+)\d+", action).group(1)
        held += {"F": 1, "B": -1, "W": -1}.get(kind, 0)  # I: input gradients only, the graph kept for W
        most = max(most, held)
    return most


@pytest.mark.parametrize("name", SCHEDULES)
def test_loss_and_gradients_equal_single_process(launched, name):
    runs, loss, grads = ran(launched, name), launched[1], launched[2]
    assert [run["stages"] for run in runs] == STAGES[name]
    last = [run["loss"] for run in runs if P * V - 1 in run["stages"]]
    assert [run["loss"] for run in runs if P * V - 1 not in run["stages"]] == [None]  # only the last stage's rank
    assert last[0] == pytest.approx(loss, rel=1e-6)
    union = {}
    for run in runs:
        assert not set(union) & set(run["grads"])  # each parameter on one rank
        union.update(run["grads"])
    assert set(union) == set(grads)
    for key, grad in grads.items():
        assert union[key].shape == grad.shape, key
        assert union[key].allclose(grad, rtol=1e-5, atol=1e-6), (key, (union[key] - grad).abs().max().item())


def test_peak_saved_bytes_follows_micro_batches_in_flight(launched):
    one_f_one_b, zero_bubble = (ran(launched, name) for name in ("ScheduleInterleaved1F1B",
                                                                  "ScheduleInterleavedZeroBubble"))
    for name in SCHEDULES:
        for rank, run in enumerate(launched[0][name]):
            if "error" not in run:
                print(f"{name} rank {rank} stages {run['stages']}: peak_saved_bytes {run['peak_saved_bytes']}, "
                      f"most in flight {most_in_flight(run['actions'])}")
                assert run["peak_saved_bytes"] > 0
    for rank in range(P):  # one layer per stage: a held stage-micro-batch is about the same bytes on any stage
        a, b = one_f_one_b[rank], zero_bubble[rank]
        held_a, held_b = most_in_flight(a["actions"]), most_in_flight(b["actions"])
        assert held_a != held_b  # (5 and 4 on rank 0, 3 and 4 on rank 1): the order of the peaks says something
        assert (a["peak_saved_bytes"] > b["peak_saved_bytes"]) == (held_a > held_b), (rank, a["peak_saved_bytes"],
                                                                                      b["peak_saved_bytes"])

"""What the ranks' commands say about their own numbers and as they run: the two ways of passing K/V under context
parallelism count the same traffic the same way, as the bytes a rank receives; training on ranks says each step as it ends (one process's
refusals: test_trust_flags.py)."""
import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from commands import picockpt
from picockpt import Config, init_params
from picockpt.measurement.measure import make_batch
from picockpt.parallel import RankError, run_ranks
from picockpt.parallel import Layout
from picockpt.parallel.training import zero_train

from processes import no_process_left_behind  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("one_thread", "no_process_left_behind")]
CP = ["parallel", "--preset", "tiny", "--seq", "16", "--batch", "2", "--device", "cpu", "--cp", "2", "--attention",
      "tiled"]


def test_context_parallel_counts_ring_and_all_gather_alike():
    """One traffic, one count: the bytes that reach a rank from the others, (cp - 1) blocks of K/V in the forward,
    whichever way they travel (the all-gather's buffer also holds the rank's own block: not counted)."""
    forward = {}
    for comm in ("ring", "allgather"):
        done = picockpt(*CP, "--cp-comm", comm, "--json")
        assert done.returncode == 0, done.stderr
        ranks = json.loads(done.stdout)["ranks"]
        assert all(r["comm_bytes"] == r["predicted_comm_bytes"] for r in ranks)
        forward[comm] = [r["comm_bytes"]["forward"] for r in ranks]
    assert forward["ring"] == forward["allgather"]
    done = picockpt(*CP, "--cp-comm", "allgather")
    assert "K/V bytes count the 1 block of K/V each rank received from the others (ring and all-gather alike" \
        in done.stdout
    assert "global batch 2 x 16 tokens" in done.stdout.splitlines()[0]  # --batch is the whole batch here


# ---- training on ranks: each step said as it ends ------------------------------------------------------------------
def test_each_step_of_ranks_training_reaches_the_caller_as_it_ends():
    """zero_train's on_step hears of step 0 long before the ranks are done (its steps 1.. still to run), with the
    loss and the slowest rank's seconds that it returns at the end; train prints its lines from it."""
    cfg = Config.from_preset("tiny", layers=1)
    params = init_params(cfg, seed=0)
    batches = [make_batch(cfg, 2, 8, "cpu", seed) for seed in range(12)]
    heard = []
    losses, _, reports = zero_train(params, cfg, batches, "full", Layout(dp=2, zero=1),
                                    on_step=lambda *step: heard.append((*step, time.monotonic())))
    done = time.monotonic()
    assert [step for step, *_ in heard] == list(range(len(batches)))
    assert [loss for _, loss, _, _ in heard] == losses
    assert [seconds for _, _, seconds, _ in heard] == [max(r["seconds_per_step"][step] for r in reports)
                                                        for step in range(len(batches))]
    later = sum(max(r["seconds_per_step"][step] for r in reports) for step in range(1, len(batches)))
    assert done - heard[0][3] > 0.5 * later  # step 0 was heard while steps 1..11 still ran, not at the end


# ---- a rank killed, a rank too slow for the timeout: said as what happened --------------------------------------------
def killed_by_sigkill(comm):
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as `kill -9` from another terminal
    time.sleep(60)


def slower_than_the_timeout(comm):
    if comm.rank == 1:
        time.sleep(4)  # still computing when rank 0's all-reduce gives up
    dist.all_reduce(torch.ones(4))


def test_a_rank_killed_by_sigkill_is_named_with_its_signal():
    with pytest.raises(RankError) as caught:
        run_ranks(killed_by_sigkill, 2, timeout_s=60)
    assert str(caught.value).startswith("rank 1 of 2 was killed by SIGKILL (sent from outside the run")
    assert "__main__" not in str(caught.value)


def test_a_rank_waiting_longer_than_the_timeout_is_named_with_the_limit():
    with pytest.raises(RankError) as caught:
        run_ranks(slower_than_the_timeout, 2, timeout_s=1)
    first = str(caught.value).splitlines()[0]
    assert first.startswith("rank 0 of 2 waited longer than timeout_s=1 seconds in a recv (of all_reduce), for a rank")
    assert first.endswith("give a larger timeout_s, e.g. 120")

"""What the ranks' commands say about their own numbers and as they run: the two ways of passing K/V under context
parallelism count the same traffic the same way; training on ranks says each step as it ends (one process's
refusals: test_trust_flags.py)."""
import time

import pytest

from commands import picockpt
from picockpt import Config, init_params
from picockpt.measure import make_batch
from picockpt.parallel.training import zero_train

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("one_thread")]
CP = ["parallel", "--preset", "tiny", "--seq", "16", "--batch", "2", "--device", "cpu", "--cp", "2", "--attention",
      "tiled"]


@pytest.mark.parametrize("comm, label", [("ring", "K/V bytes count the 1 block each rank received"),
                                         ("allgather", "K/V bytes count the gathered buffer, 2 x a rank's K/V with its "
                                                       "own block, of which 1/2 crossed the wire")])
def test_context_parallel_says_what_its_kv_bytes_count(comm, label):
    done = picockpt(*CP, "--cp-comm", comm)
    assert done.returncode == 0, done.stderr
    assert label in done.stdout


# ---- training on ranks: each step said as it ends ------------------------------------------------------------------
def test_each_step_of_ranks_training_reaches_the_caller_as_it_ends():
    """zero_train's on_step hears of step 0 long before the ranks are done (its steps 1.. still to run), with the
    loss and the slowest rank's seconds that it returns at the end; train prints its lines from it."""
    cfg = Config.from_preset("tiny", layers=1)
    params = init_params(cfg, seed=0)
    batches = [make_batch(cfg, 2, 8, "cpu", seed) for seed in range(12)]
    heard = []
    losses, _, reports = zero_train(params, cfg, batches, "full", dp=2, zero=1,
                                    on_step=lambda *step: heard.append((*step, time.monotonic())))
    done = time.monotonic()
    assert [step for step, *_ in heard] == list(range(len(batches)))
    assert [loss for _, loss, _, _ in heard] == losses
    assert [seconds for _, _, seconds, _ in heard] == [max(r["seconds_per_step"][step] for r in reports)
                                                        for step in range(len(batches))]
    later = sum(max(r["seconds_per_step"][step] for r in reports) for step in range(1, len(batches)))
    assert done - heard[0][3] > 0.5 * later  # step 0 was heard while steps 1..11 still ran, not at the end

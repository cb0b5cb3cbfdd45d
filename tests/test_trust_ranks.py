"""What the ranks' tables say about their own numbers: the two ways of passing K/V under context parallelism label
their byte counts so the same traffic reads the same (one process's refusals: test_trust_flags.py)."""
import pytest

from commands import picockpt

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

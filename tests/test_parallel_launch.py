"""run_ranks: results by rank, the first failure raised fast, no process left behind, 127.0.0.1 only.

The functions the ranks run live at module level: spawned ranks import this module by name (pytest
puts tests/ on sys.path, and spawn hands sys.path to the children).
"""
import json
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from picockpt.parallel import RankError, run_ranks, under_torchrun
from picockpt.parallel.layout import Layout, build_groups
from processes import free_port, no_process_left_behind  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]


# -- what the ranks run ----------------------------------------------------------------------------
def rank_info(comm, tensor, scale=1):
    tensor.mul_(scale + comm.rank)  # in place: every rank has its own copy of the argument
    dist.barrier()  # every rank's gloo listener and the parent's store are up now
    return {"rank": comm.rank, "world_size": comm.world_size, "device": str(comm.device),
            "backend": dist.get_backend(), "threads": torch.get_num_threads(), "pid": os.getpid(),
            "tensor": tensor, "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
            "listening": {"rank": listening(os.getpid()), "parent": listening(os.getppid())}}


def listening(pid):
    """The local addresses of the TCP sockets process pid listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                host = local.split(":")[0]
                addresses.append(socket.inet_ntoa(bytes.fromhex(host)[::-1]) if len(host) == 8 else host)
    return addresses


def fail_with_value_error(comm):
    if comm.rank == 1:
        raise ValueError("batch=3: not divisible by the 2 ranks; use an even batch")
    dist.all_reduce(torch.ones(4))  # rank 0 waits for rank 1, which never comes
    return "unreachable"


def hang_while_another_fails(comm):
    pair = dist.new_group([0, 2])  # every rank must take part in creating it
    if comm.rank == 0:
        dist.all_reduce(torch.ones(4), group=pair)  # waits for rank 2: hangs until the parent stops it
    elif comm.rank == 1:
        time.sleep(0.5)
        raise KeyError("missing")
    else:
        time.sleep(300)  # alive, never joins the collective
    return "unreachable"


def exit_abruptly(comm):
    if comm.rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(4))
    return "unreachable"


def interrupt_the_parent(comm):
    if comm.rank == 0:
        os.kill(os.getppid(), signal.SIGINT)  # as Ctrl-C in the terminal of run_ranks' caller
    time.sleep(300)


def torchrun_rank(comm):
    return {"rank": comm.rank, "world_size": comm.world_size, "pid": os.getpid(), "torchrun": under_torchrun()}


pytestmark = pytest.mark.usefixtures("no_process_left_behind")  # no process outlives a test


# -- tests -----------------------------------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def sub_group_all_reduce_with_a_sleeping_peer(comm):
    groups = build_groups(Layout(dp=2), comm.rank, comm.device, timeout=comm.timeout)
    if comm.rank == 1:
        time.sleep(300)  # never joins the all-reduce; stopped by the caller once rank 0 has failed
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=groups.dp_comm.group)
    except Exception as error:  # noqa: BLE001 -- the timeout's own error type differs between backends
        raise ValueError(f"the sub-group all-reduce gave up after {time.monotonic() - start:.1f} s") from error
    return "returned"


@pytest.mark.ranks
def test_results_by_rank_on_one_thread_each_and_only_loopback():
    tensor = torch.arange(3.0)
    results = run_ranks(rank_info, 2, tensor, scale=2, port=free_port())
    assert [r["rank"] for r in results] == [0, 1]
    assert torch.equal(tensor, torch.arange(3.0))  # the parent's tensor is untouched
    for rank, result in enumerate(results):
        assert torch.equal(result["tensor"], torch.arange(3.0) * (2 + rank))
        assert (result["world_size"], result["device"], result["backend"], result["threads"]) == (2, "cpu", "gloo", 1)
        assert result["pid"] != os.getpid()
        assert result["gloo_interface"] == "lo"  # gloo binds the loopback, whatever the hostname resolves to
        assert result["listening"]["rank"] == ["127.0.0.1"]  # gloo's listener
        assert result["listening"]["parent"] == ["127.0.0.1"]  # the rendezvous store


@pytest.mark.ranks
def test_value_error_of_a_rank_is_raised_with_its_rank_within_seconds():
    with pytest.raises(ValueError) as caught:
        run_ranks(fail_with_value_error, 2, timeout_s=60)
    assert time.monotonic() - caught.value.__cause__.failed_at < 5  # not the 60 s collective timeout
    assert str(caught.value) == "rank 1 of 2: batch=3: not divisible by the 2 ranks; use an even batch"
    cause = caught.value.__cause__
    assert isinstance(cause, RankError) and cause.rank == 1 and cause.type_name == "ValueError"
    assert "in fail_with_value_error" in cause.remote_traceback  # the rank's own traceback


@pytest.mark.ranks
def test_a_rank_hanging_in_a_collective_is_stopped_when_another_fails():
    with pytest.raises(RankError) as caught:
        run_ranks(hang_while_another_fails, 3, timeout_s=60)
    assert time.monotonic() - caught.value.failed_at < 5  # far from the 60 s collective timeout
    message = str(caught.value)
    assert message.startswith("rank 1 of 3 raised KeyError: 'missing'\n\ntraceback of rank 1:\nTraceback")
    assert 'raise KeyError("missing")' in message
    assert message.endswith("the other ranks: rank 0 was stopped; rank 2 was stopped")


@pytest.mark.ranks
def test_collectives_in_sub_groups_wait_no_longer_than_the_jobs_timeout():
    """Groups made by new_group do not inherit init_process_group's timeout: build_groups passes it on
    (without it this all-reduce waits torch's default 30 minutes)."""
    with pytest.raises(ValueError, match=r"the sub-group all-reduce gave up after (\d+\.\d) s") as caught:
        run_ranks(sub_group_all_reduce_with_a_sleeping_peer, 2, timeout_s=6)
    waited = float(re.search(r"after (\d+\.\d) s", str(caught.value)).group(1))
    assert 5.5 <= waited < 20, waited


@pytest.mark.ranks
def test_a_rank_that_exits_abruptly_is_named_with_its_exit_code():
    with pytest.raises(RankError) as caught:
        run_ranks(exit_abruptly, 2, timeout_s=60)
    assert str(caught.value).startswith("rank 1 of 2 exited with code 3 before returning a result")
    assert caught.value.rank == 1


@pytest.fixture
def sigint_raises():
    """Ctrl-C's KeyboardInterrupt for the test, also where the suite runs with SIGINT ignored (a background or
    nohup'd shell: Python then installs no handler of its own); what was there is put back after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.ranks
@pytest.mark.usefixtures("sigint_raises")
def test_keyboard_interrupt_in_the_caller_stops_every_rank():
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_ranks(interrupt_the_parent, 2, timeout_s=60)
    assert time.monotonic() - start < 30  # the ranks sleep 300 s; the fixture then checks none is left


def test_a_port_already_taken_is_a_value_error_naming_it():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        with pytest.raises(ValueError, match=rf"^port={port}: cannot listen on 127\.0\.0\.1:{port} \(Address already "
                                             rf"in use\); another process holds it\. Leave port out"):
            run_ranks(rank_info, 2, torch.ones(1), port=port)


@pytest.mark.parametrize("call, message", [
    (lambda: run_ranks(lambda comm: 0, 2),
     r"^fn='<lambda>\.<locals>\.<lambda>' or its arguments cannot be sent to spawned ranks"),
    (lambda: run_ranks(rank_info, 0), r"^world_size=0: use a whole number of ranks, 1 or more"),
    (lambda: run_ranks(rank_info, 2, backend="nccl"), r"^backend='nccl' with device='cpu': NCCL moves CUDA"),
    (lambda: run_ranks(rank_info, 2, backend="mpi"), r"^backend='mpi': use 'gloo'"),
    (lambda: run_ranks(rank_info, 2, timeout_s=0), r"^timeout_s=0: use a number of seconds from 1 \(the groups' "
                                                   r"connect waits as long as a collective.*\) to 86400 \(a day\)"),
    (lambda: run_ranks(rank_info, 2, start_method="fork"), r"^start_method='fork': use one of \['spawn'"),
    (lambda: run_ranks(rank_info, 2, port=70000), r"^port=70000: use a TCP port number 1\.\.65535"),
])
def test_user_mistakes_are_value_errors_before_any_rank_starts(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_cuda_without_cuda_says_so():
    with pytest.raises(ValueError, match=r"^device='cuda': CUDA was asked for, but torch.cuda.is_available\(\) "
                                         r"is False"):
        run_ranks(rank_info, 2, device="cuda")


@pytest.mark.ranks
@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no forkserver here")
def test_forkserver_ranks_give_the_same_results_and_fail_the_same_way():
    results = run_ranks(rank_info, 2, torch.arange(3.0), start_method="forkserver")
    assert [torch.equal(r["tensor"], torch.arange(3.0) * (1 + r["rank"])) for r in results] == [True, True]
    assert [r["threads"] for r in results] == [1, 1]
    with pytest.raises(RankError, match=r"^rank 1 of 2 exited with code 3 before returning a result"):
        run_ranks(exit_abruptly, 2, start_method="forkserver")


@pytest.mark.ranks
def test_under_torchrun_each_process_is_one_rank_and_gets_every_result(tmp_path):
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    environment["TORCHRUN_RESULTS"] = str(tmp_path)  # each rank writes what it got there
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), environment.get("PYTHONPATH", "")])
    environment["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "test_parallel_launch"]
    done = subprocess.run(command, env=environment, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    written = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for got in written:  # each rank got the list of both ranks' results
        seen = [(r["rank"], r["world_size"], r["torchrun"]) for r in got["results"]]
        assert seen == [(0, 2, True), (1, 2, True)]
        assert got["results"][got["rank"]]["pid"] == got["pid"]  # fn ran in the torchrun process


if __name__ == "__main__":  # what each torchrun process runs in the test above
    results = run_ranks(torchrun_rank, None)
    printed = {"rank": int(os.environ["RANK"]), "pid": os.getpid(), "results": results}
    Path(os.environ["TORCHRUN_RESULTS"], f"rank{os.environ['RANK']}.json").write_text(json.dumps(printed))


NO_MAIN_GUARD = """
from picockpt.parallel import run_ranks

def step(comm, blob):
    return len(blob)

print(run_ranks(step, 1, b"x" * 2**20))  # no `if __name__ == "__main__":` guard; 1 MiB > a pipe's buffer
"""


@pytest.mark.ranks
def test_a_script_without_a_main_guard_fails_at_once_naming_the_guard(tmp_path):
    """The spawned rank re-imports the script and dies while starting. Before, the parent blocked for
    good writing the 1 MiB payload into the child's start-up pipe; now it ends the run with one ValueError."""
    script = tmp_path / "no_guard.py"
    script.write_text(NO_MAIN_GUARD)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: rank 0 of 1 exited with code 1 before it started: "), last
    assert 'put the script\'s calls (loss_and_grads with tp, pp, dp or ep, run_ranks, ...) under ' \
           '`if __name__ == "__main__":`' in last

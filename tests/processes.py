"""What the multi-process tests share: finding this process's children, a free loopback port, and the
fixture that fails a test which leaves a process behind (use it with pytest.mark.usefixtures)."""
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import socket
import sys
from pathlib import Path

import pytest


def child_pids():
    """Live children of this process, without Python's own per-interpreter helpers (the resource
    tracker that spawn starts, the forkserver helper): those are not ranks and exit with us."""
    me = os.getpid()
    pids = set()
    for task in os.listdir(f"/proc/{me}/task"):
        pids.update(int(p) for p in Path(f"/proc/{me}/task/{task}/children").read_text().split())
    helpers = {getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
               getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)}
    return sorted(pids - helpers)


@pytest.fixture
def no_process_left_behind():
    yield
    assert multiprocessing.active_children() == []
    if sys.platform.startswith("linux"):
        assert child_pids() == []


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]

"""The GPU check (.ci/gpu) runs its parts in order, on a machine that may be lent for minutes only: its own logic is
checked here on the CPU, with a stand-in python that says CUDA is there and sleeps instead of running a part."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and GNU timeout")

STAND_IN = """#!/usr/bin/env bash
[ "$1" = "-c" ] && { echo "torch (stand-in)"; exit 0; }
echo "part $*"
[ "${STAND_IN_SECONDS:-0}" = 0 ] || exec sleep "$STAND_IN_SECONDS"  # exec: the process timeout stops is the sleep
exit "${STAND_IN_STATUS:-0}"
"""


def run_check(tmp_path, python, **env):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), str(out)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": str(python), **env})
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    return done, summary


@pytest.fixture
def stand_in(tmp_path):
    path = tmp_path / "python"
    path.write_text(STAND_IN)
    path.chmod(0o755)
    return path


def test_a_part_that_outlasts_part_seconds_is_stopped_and_the_next_part_still_runs(tmp_path, stand_in):
    done, summary = run_check(tmp_path, stand_in, PARTS="benchmark profile", PART_SECONDS="1", STAND_IN_SECONDS="20")
    lines = summary.splitlines()
    assert [line.split()[0] for line in lines] == ["gpu_benchmark.log", "gpu_profile.log"], done.stdout
    assert all("STOPPED after PART_SECONDS=1 s" in line for line in lines), summary
    assert done.returncode == 2  # the number of parts that did not pass


def test_each_part_says_ok_or_failed_with_its_status_and_the_exit_code_counts_failures(tmp_path, stand_in):
    done, summary = run_check(tmp_path, stand_in, PARTS="rates", STAND_IN_STATUS="3")
    assert "FAILED (3)" in summary and done.returncode == 1
    done, summary = run_check(tmp_path, stand_in, PARTS="rates profile")
    assert summary.count(" ok") == 2 and done.returncode == 0
    assert "part lessons/kernel_rates.py --out" in (tmp_path / "out" / "kernel_rates.log").read_text()


def test_an_unknown_part_is_named_with_the_parts_that_exist(tmp_path, stand_in):
    done, _ = run_check(tmp_path, stand_in, PARTS="benchmarks")
    assert done.returncode == 2 and "unknown part benchmarks: use tests, benchmark" in done.stdout


def test_without_cuda_it_says_this_check_is_for_a_gpu_machine(tmp_path):
    done, summary = run_check(tmp_path, sys.executable, CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 2 and "no CUDA GPU here" in done.stdout and summary == ""

"""What `python -m picockpt parallel` and parallel.loss_and_grads say and do with flags a layout does not use: every
one refused by name before any rank starts (the API in parameters, the command in flags), every layout flag handed
to the job on every layout path, the same layout keys in every layout's JSON, a rank's failure as one line
(--verbose: its traceback too), and SIGTERM ending the ranks with one line. Only the SIGTERM test spawns ranks."""
import json
import os
import signal
import time

import pytest

from picockpt import Config, init_params, loss_and_grads
from picockpt import parallel
from picockpt.cli import main
from picockpt.cli import parallel_run
from picockpt.cli.parallel_run import LAYOUT, as_flags, rank_failure
from picockpt.measurement.measure import make_batch
from picockpt.parallel import RankError, run_ranks
from picockpt.parallel.layout import Layout
from picockpt.parallel.watch import Terminated

from processes import no_process_left_behind  # noqa: F401 (a fixture)
from conftest import split_layout

TINY = ["--preset", "tiny", "--seq", "16", "--batch", "4", "--device", "cpu"]
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny steps, steady on a busy CPU
WORKS = "use a number of seconds from 1 (the groups' connect waits as long as a collective, and needs that much) to " \
    "86400 (a day), e.g. 120"


def tiny(**fields):
    cfg = Config.from_preset("tiny", **fields)
    return cfg, init_params(cfg, seed=0), *make_batch(cfg, 4, 16, "cpu", seed=0)


# ---- the API: refused by parameter, before any rank starts ---------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(cp=2, zero=1, keep_gathered=True), "keep_gathered=True with zero=1: only stage 3 gathers parameters"),
    (dict(dp=2, zero=1, cp_comm="allgather"), "cp_comm='allgather' without cp: it chooses how context-parallel"),
    (dict(dp=2, zero=1, cp_layout="contiguous", cp_keep_kv=True),
     "cp_layout='contiguous', cp_keep_kv=True without cp: they choose how"),
    (dict(dp=1, zero=3), "zero=3 with dp=1: ZeRO shards the model state over data-parallel ranks"),
    (dict(dp=2, zero=1, prefetch=False), "prefetch=False with zero=1: only stage 3 gathers parameters"),
    (dict(dp=2, zero=2, prefetch=False), "prefetch=False with zero=2: only stage 3 gathers parameters"),
    (dict(dp=2, zero=3, overlap=False), "overlap=False with zero=3: ZeRO reduces each unit's gradients"),
    (dict(cp=2, ep=2, zero=3), "cp=2 with ep=2 is not supported yet: a rank's experts would receive the tokens of its"),
    (dict(dp=2, timeout_s=True), f"timeout_s=True: {WORKS}"),
    (dict(dp=2, timeout_s=float("inf")), f"timeout_s=inf: {WORKS}"),
    (dict(dp=2, timeout_s=1e-9), f"timeout_s=1e-09: {WORKS}"),
    (dict(tp=2, overlap=False), "overlap=False with dp=1, ep=1 and cp=1: it all-reduces the gradients after"),
])
def test_the_api_refuses_what_a_layout_does_not_use_naming_the_parameter(kwargs, message):
    cfg, params, input_ids, targets = tiny(attention="tiled")
    with pytest.raises(ValueError) as caught:
        layout, launch = split_layout(kwargs, Layout(tp=2))
        parallel.loss_and_grads(params, cfg, input_ids, targets, "full", layout, **launch)
    assert str(caught.value).startswith(message), str(caught.value)


# ---- the command: the same refusals in flags, one line each --------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--zero", "1", "--cp", "2", "--ep", "2", "--experts", "4", "--attention", "tiled"],
     "--cp 2 with --ep 2 is not supported yet"),
    (["--zero", "1", "--dp", "2", "--cp-comm", "allgather"], "--cp-comm allgather without --cp: it chooses how"),
    (["--zero", "3", "--dp", "2", "--cp-layout", "contiguous"], "--cp-layout contiguous without --cp: it chooses"),
    (["--zero", "3", "--dp", "2", "--cp-keep-kv"], "--cp-keep-kv without --cp: it chooses how context-parallel"),
    (["--zero", "3", "--tp", "2"], "--zero without --dp D, --ep N or --cp N (more than one rank in dp x ep x cp)"),
    (["--zero", "3", "--dp", "2", "--no-overlap"], "--no-overlap with --zero 3: ZeRO reduces each unit's gradients"),
    (["--zero", "3", "--dp", "2", "--tp", "2", "--dtype", "bf16"],
     "--zero 3 with --dtype bfloat16 (mixed precision) is not supported yet"),
    (["--zero", "2", "--dp", "2", "--pp", "2", "--keep-gathered"], "--keep-gathered without --zero 3"),
    (["--cp", "2", "--attention", "tiled", "--cp-comm", "allgather", "--cp-keep-kv", "--pp", "2", "--microbatches",
      "2"], "--cp-keep-kv with --pp 2, --microbatches 2 is not supported yet"),
    (["--cp", "2"], "--attention eager under context parallelism"),
    (["--timeout", "inf"], f"--timeout inf: {WORKS}"),
    (["--timeout", "1e-9"], f"--timeout 1e-09: {WORKS}"),
    (["--timeout", "0"], f"--timeout 0.0: {WORKS}"),
])
def test_the_command_refuses_in_one_line_naming_the_flag(argv, message, capsys):
    assert main(["parallel", *TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_parameter_names_are_said_as_flags_once_for_every_message():
    assert as_flags("zero=3 with dp=1: nothing to shard; use dp >= 2, or leave zero out") == \
        "--zero 3 with --dp 1: nothing to shard; use --dp >= 2, or leave --zero out"
    assert as_flags("prefetch=False with zero=1: use zero=3, or leave prefetch out") == \
        "--no-prefetch with --zero 1: use --zero 3, or leave --no-prefetch out"
    assert as_flags("Config.attention='eager': use attention='tiled'; keep_kv=True with cp_comm='ring'") == \
        "--attention eager: use --attention tiled; --cp-keep-kv with --cp-comm ring"
    assert as_flags("tp=3 must divide kv_heads=2; use tp in [1, 2], or sp=False") == \
        "--tp 3 must divide --kv-heads 2; use --tp in [1, 2], or no --sp"
    already = "--sp with a tensor-parallel size of 1 (--tp 1): add --tp N (N > 1), or leave --sp out"
    assert as_flags(already) == already


# ---- every layout flag reaches the job, on every layout path -------------------------------------------------------
class Captured(Exception):
    pass


DEFAULTS = dict(tp=1, sp=False, distribute_saved=False, pp=1, microbatches=1, schedule="1f1b", virtual_stages=1,
                recompute_early=False, dp=1, overlap=True, ep=1, keep_dispatched=False, cp=1, cp_layout="zigzag", cp_comm="ring",
                cp_keep_kv=False, zero=0, keep_gathered=False, prefetch=True)  # the command's, flags left out


@pytest.mark.parametrize("argv, expected", [
    (["--tp", "2", "--sp"], dict(tp=2, sp=True)),
    (["--pp", "2", "--microbatches", "2", "--schedule", "afab", "--recompute-early", "--dp", "2", "--no-overlap"],
     dict(pp=2, microbatches=2, schedule="afab", recompute_early=True, dp=2, overlap=False)),
    (["--pp", "2", "--microbatches", "4", "--schedule", "interleaved", "--virtual-stages", "2"],
     dict(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2)),
    (["--ep", "2", "--experts", "4", "--pp", "2", "--dp", "2", "--batch", "8", "--recompute-early", "--no-overlap"],
     dict(ep=2, pp=2, dp=2, recompute_early=True, overlap=False)),
    (["--cp", "2", "--tp", "2", "--attention", "tiled", "--cp-layout", "contiguous"],
     dict(cp=2, tp=2, cp_layout="contiguous")),
    (["--dp", "2", "--zero", "3", "--keep-gathered", "--no-prefetch"],
     dict(dp=2, zero=3, keep_gathered=True, prefetch=False)),
])
def test_every_layout_path_hands_every_layout_flag_to_the_job(argv, expected, monkeypatch):
    seen = {}

    def capture(*args, **kwargs):
        seen.update(kwargs)
        raise Captured
    monkeypatch.setattr(parallel_run, "loss_and_grads", capture)
    with pytest.raises(Captured):
        main(["parallel", *TINY, *argv])
    assert {key: getattr(seen["layout"], key) for key in LAYOUT} == {**DEFAULTS, "tp": 1, **expected}
    assert seen["optimizer_step"] is ("--zero" in argv)


def fake_ranks(params, cfg, input_ids, targets, policy, **kwargs):
    """The single process's step in place of the ranks' (no rank report: --json prints the rows' own keys)."""
    loss, grads = loss_and_grads(params, cfg, input_ids, targets, "none")
    return loss, grads, []


@pytest.mark.parametrize("argv, expected", [
    ([], dict(tp=2)),
    (["--cp", "2", "--tp", "2", "--attention", "tiled"], dict(cp=2, tp=2)),
    (["--pp", "2", "--microbatches", "2", "--dp", "2"], dict(pp=2, microbatches=2, dp=2, tp=1)),
    (["--ep", "2", "--experts", "4", "--keep-dispatched"], dict(ep=2, keep_dispatched=True, tp=1)),
    (["--dp", "2", "--zero", "3", "--no-prefetch"], dict(dp=2, zero=3, prefetch=False, tp=1)),
])
def test_every_layouts_json_carries_every_layout_key_with_its_value(argv, expected, monkeypatch, capsys):
    monkeypatch.setattr(parallel_run, "loss_and_grads", fake_ranks)
    assert main(["parallel", *TINY, "--json", *argv]) == 0
    row = json.loads(capsys.readouterr().out)
    assert set(DEFAULTS) == set(LAYOUT)
    assert {key: row[key] for key in LAYOUT} == {**DEFAULTS, **expected}


# ---- a rank's failure: one line; --verbose adds the traceback ------------------------------------------------------
REMOTE = ('Traceback (most recent call last):\n  File "/x/comm.py", line 97, in all_reduce\n    dist.all_reduce(x)\n'
          'RuntimeError: Timed out waiting 10ms for recv operation to complete\n')


def test_a_ranks_failure_is_one_line_and_verbose_adds_its_traceback():
    error = RankError(f"rank 1 of 2 raised RuntimeError: Timed out waiting 10ms\n\ntraceback of rank 1:\n{REMOTE}"
                      f"\nthe other ranks: rank 0 raised RuntimeError: Connection closed by peer", 1, "RuntimeError",
                      REMOTE)
    frame = ' (rank\'s last frame: File "/x/comm.py", line 97, in all_reduce)'
    assert str(rank_failure(error)) == f"rank 1 of 2 raised RuntimeError: Timed out waiting 10ms{frame}; --verbose " \
                                       f"prints the rank's traceback"
    verbose = str(rank_failure(error, verbose=True))
    assert verbose.startswith(f"rank 1 of 2 raised RuntimeError: Timed out waiting 10ms{frame}\n\ntraceback of rank 1")
    assert verbose.endswith("the other ranks: rank 0 raised RuntimeError: Connection closed by peer")


def test_the_command_says_a_ranks_failure_in_one_line_and_documents_verbose(monkeypatch, capsys):
    def failing(*args, **kwargs):
        raise RankError(f"rank 1 of 2 raised RuntimeError: timed out\n\ntraceback of rank 1:\n{REMOTE}", 1,
                        "RuntimeError", REMOTE)
    monkeypatch.setattr(parallel_run, "loss_and_grads", failing)
    assert main(["parallel", *TINY]) == 1  # a rank's failure: 1, not a user mistake's 2
    err = capsys.readouterr().err
    assert err == ('error: rank 1 of 2 raised RuntimeError: timed out (rank\'s last frame: File "/x/comm.py", line 97, '
                   'in all_reduce); --verbose prints the rank\'s traceback\n')
    assert main(["parallel", *TINY, "--verbose"]) == 1
    assert "\ntraceback of rank 1:\nTraceback (most recent call last):" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["parallel", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--verbose a rank's failure with every failed rank's traceback below it" in text


# ---- SIGTERM: every rank stopped, one line -------------------------------------------------------------------------
def terminate_the_parent(comm):
    if comm.rank == 0:
        os.kill(os.getppid(), signal.SIGTERM)  # as `kill PID` of run_ranks' caller
    time.sleep(300)


@pytest.fixture
def default_sigterm():
    """SIGTERM's default disposition for the test (a harness may have its own), put back after."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the job put back what it found
    signal.signal(signal.SIGTERM, before)


@pytest.mark.ranks
@pytest.mark.usefixtures("no_process_left_behind", "default_sigterm")
def test_sigterm_in_the_caller_stops_every_rank_and_says_so():
    start = time.monotonic()
    with pytest.raises(Terminated, match=r"^SIGTERM: the caller was terminated; every rank it had started was "
                                         r"stopped$"):
        run_ranks(terminate_the_parent, 2, timeout_s=60)
    assert time.monotonic() - start < 30  # the ranks sleep 300 s; the fixture then checks none is left


@pytest.mark.usefixtures("default_sigterm")
def test_sigterm_ends_the_command_with_one_line_and_exit_code_143(monkeypatch, capsys):
    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises at the next bytecode
    monkeypatch.setattr(parallel_run, "loss_and_grads", terminated)
    assert main(["parallel", *TINY]) == 143
    assert capsys.readouterr().err == ("terminated: python -m picockpt parallel stopped before it finished (SIGTERM; "
                                       "no rank of it is left running)\n")


# ---- the process groups a layout makes -----------------------------------------------------------------------------
def test_the_experts_data_parallel_group_is_made_only_under_expert_parallelism():
    assert set(Layout(dp=2).groups()) == {"tp", "cp", "ep", "dp"}
    assert set(Layout(dp=2, cp=2).groups()) == {"tp", "cp", "ep", "dp"}
    assert Layout(dp=2, ep=2).groups()["expert_dp"] == {(0, 0, 0): [0, 2], (0, 1, 0): [1, 3]}
    assert Layout(dp=2, ep=2).groups()["dp"] == {(0, 0): [0, 1, 2, 3]}


def test_train_says_its_zero_flags_as_flags(capsys):
    flags = ["train", "--preset", "tiny", "--steps", "1", "--batch", "2", "--seq", "8", "--device", "cpu"]
    assert main(flags + ["--dp", "2", "--zero", "1", "--no-prefetch"]) == 2
    assert capsys.readouterr().err == ("error: --no-prefetch with --zero 1: only stage 3 gathers parameters; use "
                                       "--zero 3, or leave --no-prefetch out\n")
    assert main(flags + ["--verbose"]) == 2
    assert capsys.readouterr().err.startswith("error: --verbose without --dp/--zero: it adds a failed rank's traceback")

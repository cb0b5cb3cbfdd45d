"""Flags that would do nothing, or would end in a traceback, a hang or a misleading line, are each refused in one
line naming the flag, or bounded, before any work starts (one process; the ranks' side: test_trust_ranks.py)."""
import time
from dataclasses import replace

import pytest

from commands import picockpt
from picockpt import Config, init_params
from picockpt.planning.layout_search import divisors
from picockpt.measurement.measure import make_batch
from picockpt.parallel.job import ParallelJob, checked_job
from picockpt.parallel.pipeline_parallel.pp_plan import in_flight_peak
from picockpt.parallel.pipeline_parallel.pp_schedules import actions
from conftest import split_layout
from picockpt.parallel import Layout

SEARCH = ["predict", "--search", "--model", "llama3-8b", "--seq", "8192", "--gpus", "64", "--tokens-per-batch", "1M"]


def refused(*args):
    """The command's one error line (exit code 2, nothing on stdout, no traceback)."""
    done = picockpt(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    return done.stderr


# ---- numbers a flag cannot hold ----------------------------------------------------------------------------------
def test_a_gpu_too_large_to_count_in_bytes_is_refused():
    assert "--gpu-gib" in refused("predict", "--model", "llama3-8b", "--gpu-gib", "1e308")


@pytest.mark.parametrize("args, flag", [(["plan", "--budget", "-5MiB"], "-5MiB"),
                                        ([*SEARCH[:-1], "-64K"], "--tokens-per-batch"),
                                        (["train", "--peak-tflops", "-inf"], "--peak-tflops"),
                                        (["train", "--lr", "-Infinity"], "--lr")])
def test_a_negative_value_is_read_and_refused_by_its_flag(args, flag):
    message = refused(*args)
    assert "expected one argument" not in message and flag in message and "positive" in message


def test_a_timeout_too_short_to_connect_is_refused_before_any_rank_starts():
    start = time.perf_counter()
    assert refused("parallel", "--preset", "tiny", "--dp", "2", "--timeout", "0.001", "--device", "cpu").startswith(
        "error: --timeout 0.001: use a number of seconds from 1")
    assert time.perf_counter() - start < 5.0


def test_train_on_ranks_takes_a_timeout_and_one_process_refuses_it():
    assert refused("train", "--preset", "tiny", "--timeout", "5").startswith("error: --timeout without --dp/--zero")
    assert refused("train", "--preset", "tiny", "--dp", "2", "--zero", "1", "--timeout", "0.01").startswith(
        "error: --timeout 0.01: use a number of seconds from 1")


# ---- predict --search: what it does not read is refused ----------------------------------------------------------
@pytest.mark.parametrize("flags, named", [(["--schedule", "zb-h1"], "--schedule"), (["--schedule", "afab"], "--schedule"),
                                          (["--virtual-stages", "2"], "--virtual-stages"),
                                          (["--cp-comm", "allgather"], "--cp-comm"), (["--keep-kv"], "--keep-kv"),
                                          (["--attention", "eager"], "--attention eager")])
def test_search_refuses_the_flags_it_would_ignore(flags, named):
    assert named in refused(*SEARCH, *flags)


def test_search_divisors_come_from_factoring():
    start = time.perf_counter()
    assert divisors(1099511627776) == [2 ** k for k in range(41)]
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1] and divisors(10000019) == [1, 10000019]
    assert time.perf_counter() - start < 1.0


def test_search_over_a_huge_count_of_gpus_ends():
    start = time.perf_counter()
    picockpt("predict", "--search", "--model", "llama3-8b", "--gpus", "1099511627776", "--tokens-per-batch", "64K")
    assert time.perf_counter() - start < 10.0


# ---- the pipeline walk: linear in the micro-batches ----------------------------------------------------------------
def test_the_pipeline_walk_is_linear_in_the_microbatches():
    order = actions("afab", 8, 40000, 0)
    start = time.perf_counter()
    assert in_flight_peak(order, lambda m, c: 1, lambda m, c: 2) == 40000 + 1
    assert time.perf_counter() - start < 1.0


# ---- what the helps and the outputs say ------------------------------------------------------------------------------
def test_batch_help_says_per_rank_or_whole():
    assert "sequences per rank" in " ".join(picockpt("predict", "--help").stdout.split())
    assert "sequences in the whole batch, split over" in " ".join(picockpt("parallel", "--help").stdout.split())
    assert "s=1024, batch 2 per rank" in picockpt("predict", "--model", "llama3-8b", "--batch", "2", "--seq",
                                                   "1024").stdout.splitlines()[0]  # parallel's: test_trust_ranks.py


def test_measured_plan_says_it_can_change_between_runs():
    out = picockpt("plan", "--preset", "tiny", "--seq", "16", "--batch", "2", "--budget", "1MiB", "--cost",
                   "measured", "--device", "cpu").stdout
    assert "can change between runs" in out
    assert "a measured plan can change between runs" in " ".join(picockpt("plan", "--help").stdout.split())


def test_mfu_above_the_peak_is_flagged():
    out = picockpt("train", "--preset", "tiny", "--seq", "16", "--batch", "2", "--steps", "2", "--device", "cpu",
                   "--peak-tflops", "0.000001").stdout
    assert "above 100%" in out and "--peak-tflops" in out


# ---- the job: one validation per dimension, before any rank starts ------------------------------------------------
def tiny_job(**fields):
    cfg = Config.from_preset("tiny", layers=fields.pop("layers", 8))
    params = init_params(cfg, seed=0)
    policy, (layout, fields) = fields.pop("policy", "full"), split_layout(fields)
    return ParallelJob(params, cfg, *make_batch(cfg, 4, 16, "cpu", seed=0), policy, layout, **fields)


def check(**fields):
    job = tiny_job(**fields)
    return checked_job(job, "cpu", job.world_size)


@pytest.mark.parametrize("fields, C, most", [(dict(pp=2, microbatches=2), 8, 4), (dict(pp=2, microbatches=2), 5, 4),
                                             (dict(pp=2, microbatches=2, schedule="interleaved", virtual_stages=2), 3, 2)])
def test_every_C_longer_than_a_stage_is_refused(fields, C, most):
    with pytest.raises(ValueError, match=rf"every:{C}.*{most} layers.*every:C with C <= {most}"):
        check(policy=f"every:{C}", **fields)
    check(policy=f"every:{most}", **fields)  # a whole stage's chunk is one segment: fine


@pytest.mark.parametrize("fields, name", [(dict(tp=2, sp=False, distribute_saved=True), "distribute_saved"),
                                          (dict(pp=2, microbatches=2, recompute_early=True), "recompute_early"),
                                          (dict(dp=2, zero=3, keep_gathered=True), "keep_gathered")])
def test_switches_that_only_change_a_recomputation_are_refused_under_none(fields, name):
    with pytest.raises(ValueError, match=rf"{name}=True with policy 'none'.*recomputes nothing"):
        check(policy="none", **fields)
    check(policy="full", **fields)


def test_keep_dispatched_is_refused_under_none():
    cfg = Config.from_preset("tiny", experts=4)
    job = ParallelJob(init_params(cfg, seed=0), cfg, *make_batch(cfg, 4, 16, "cpu", seed=0), "none",
                      Layout(ep=2, keep_dispatched=True))
    with pytest.raises(ValueError, match=r"keep_dispatched=True with policy 'none'"):
        checked_job(job, "cpu", 2)


@pytest.mark.parametrize("fields", [dict(microbatches=2, schedule="interleaved", virtual_stages=2),
                                    dict(microbatches=2, schedule="zb-h1")])
def test_schedules_of_a_pipeline_need_one(fields):
    with pytest.raises(ValueError, match=rf"schedule='{fields['schedule']}' with pp=1: .*pp >= 2"):
        check(**fields)


def test_not_yet_names_only_what_was_given():
    cfg = Config.from_preset("tiny", experts=4)
    job = ParallelJob(init_params(cfg, seed=0), cfg, *make_batch(cfg, 4, 16, "cpu", seed=0), "full",
                      Layout(pp=2, ep=2, microbatches=2, schedule="interleaved", virtual_stages=2))
    with pytest.raises(ValueError, match=r"^schedule='interleaved' with ep=2 is not supported yet") as error:
        checked_job(job, "cpu", 4)
    assert "zero=0" not in str(error.value) and "cp=1" not in str(error.value)


def test_a_budget_too_small_names_the_largest_need_of_every_stage():
    cfg = Config.from_preset("small")
    job = ParallelJob(init_params(cfg, seed=0), cfg, *make_batch(cfg, 4, 128, "cpu", seed=0), "budget:3MiB",
                      Layout(pp=2, microbatches=4, schedule="zb-h1"))
    with pytest.raises(ValueError) as error:
        checked_job(job, "cpu", 2)
    assert str(error.value).startswith("stage 1 ") and "the largest need of the 2 stages" in str(error.value)
    advised = str(error.value).split("use budget:")[1].split("MiB")[0]
    checked_job(replace(job, policy=f"budget:{advised}MiB"), "cpu", 2)  # every stage fits it: none fails next


def test_predict_refuses_a_walk_of_minutes():
    start = time.perf_counter()
    assert "--microbatches 2,048 or fewer" in refused("predict", "--model", "llama3-8b", "--pp", "32", "--microbatches",
                                                      "100000", "--batch", "100000")
    assert time.perf_counter() - start < 10.0


# ---- the headers: the layout said from the row the step ran --------------------------------------------------------
def layout_row(**given):
    from picockpt.cli.parallel_run import LAYOUT
    row = {name: 1 for name in ("tp", "pp", "microbatches", "virtual_stages", "dp", "ep", "cp")}
    row.update({name: False for name in LAYOUT if name not in row}, overlap=True, prefetch=True, zero=0,
               schedule="1f1b", cp_layout="zigzag", cp_comm="ring")
    return {**row, **given}


@pytest.mark.parametrize("given, words", [
    (dict(cp=2, pp=2, microbatches=2, schedule="zb-h1"), ("pp=2", "cp=2", "M=2 micro-batches", "zb-h1", "K/V by ring")),
    (dict(cp=2, tp=2, sp=True), ("cp=2", "tp=2", "sequence parallel")),
    (dict(ep=2, pp=2, microbatches=2, schedule="afab"), ("ep=2", "pp=2", "afab")),
    (dict(pp=2, microbatches=2, sp=True, tp=2, recompute_early=True), ("tp=2", "sequence parallel", "recompute early")),
    (dict(dp=2, zero=3, keep_gathered="step", prefetch=False), ("dp=2", "ZeRO-3", "gathers kept (step)", "no prefetch"))])
def test_the_header_names_every_layout_choice_that_ran(given, words):
    from picockpt.cli.parallel_run import layout_words
    text = layout_words(layout_row(**given))
    assert all(word in text for word in words), text


# ---- a rank's failure: what happened, one line, exit code 1 (a user mistake's is 2) ----------------------------------
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "1000ms for recv operation to complete")


class Process:  # what watch._error reads of a rank's process
    pass


def root_cause(failures, world=2, main_name="picockpt.__main__", timeout_s=None):
    """watch._error's error for {rank: failure}, with the launching program's __main__ as given."""
    import sys
    import types
    from picockpt.parallel import watch
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=main_name) if main_name else None
    main.__file__ = "/home/user/script.py"
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        return watch._error(failures, [Process() for _ in range(world)], set(), timeout_s)
    finally:
        sys.modules["__main__"] = saved


@pytest.mark.parametrize("started", [False, True])
def test_a_rank_killed_by_a_signal_is_said_so_not_blamed_on_a_main_guard(started):
    from picockpt.parallel import RankError
    error = root_cause({1: ("died", 0.0, "was killed by SIGKILL", started)}, main_name=None)  # even from a script
    assert isinstance(error, RankError) and "__main__" not in str(error)
    assert str(error).startswith("rank 1 of 2 was killed by SIGKILL (sent from outside the run: `kill -9`")
    assert "leaves no traceback" in str(error) and "stderr above" not in str(error)


def test_an_aborted_rank_points_at_nccl_s_watchdog_and_the_timeout():
    error = root_cause({1: ("died", 0.0, "was killed by SIGABRT", True)}, timeout_s=1.0)
    assert str(error).startswith("rank 1 of 2 was killed by SIGABRT (NCCL's watchdog aborts a rank whose collective "
                                 "waited longer than timeout_s=1 seconds")


def test_a_rank_that_exits_while_starting_is_blamed_on_a_main_guard_only_where_a_script_was_re_run():
    from picockpt.parallel import RankError
    failure = {1: ("died", 0.0, "exited with code 1", False)}
    assert isinstance(root_cause(failure, main_name="picockpt.__main__"), RankError)  # python -m picockpt
    assert "if __name__" in str(root_cause(failure, main_name=None))  # python script.py
    assert "if __name__" in str(root_cause(failure, main_name="train_script"))  # python -m train_script


def test_a_collective_s_timeout_names_the_rank_the_operation_and_the_limit():
    failure = {1: ("error", 0.0, "RuntimeError", GLOO_TIMEOUT, "Traceback ...", False),
               0: ("error", 0.5, "RuntimeError", "Connection closed by peer [127.0.0.1]:1234", "Traceback ...", False)}
    message = str(root_cause(failure, timeout_s=1.0)).splitlines()[0]
    assert message == ("rank 1 of 2 waited longer than timeout_s=1 seconds in a recv, for a rank that was still "
                       "computing or had stalled; give a larger timeout_s, e.g. 120")


@pytest.mark.parametrize("death, said", [
    (("died", 0.0, "was killed by SIGKILL", True), "error: rank 1 of 2 was killed by SIGKILL"),
    (("error", 0.0, "RuntimeError", GLOO_TIMEOUT, 'File "pp_comm.py", line 92, in wait\n', False),
     "error: rank 1 of 2 waited longer than --timeout 1 seconds in a recv")])
def test_a_rank_s_failure_is_one_line_and_exit_code_1(monkeypatch, death, said):
    from picockpt.cli import parallel_run

    def fails(*args, **kwargs):
        raise root_cause({1: death}, timeout_s=kwargs["timeout_s"])
    monkeypatch.setattr(parallel_run, "loss_and_grads", fails)
    done = picockpt("parallel", "--preset", "tiny", "--seq", "16", "--dp", "2", "--device", "cpu", "--timeout", "1")
    assert done.returncode == 1 and done.stderr.startswith(said) and done.stderr.count("\n") == 1, done.stderr
    assert ("--verbose" in done.stderr) == (death[0] == "error")  # a killed rank has no traceback to offer
    assert "--timeout" in picockpt("train", "--help").stdout


def test_exit_codes_are_in_the_help():
    assert "1 a rank of a multi-rank run failed" in " ".join(picockpt("--help").stdout.split())


# ---- errors in the user's words ---------------------------------------------------------------------------------
@pytest.mark.parametrize("args, said, unsaid", [
    (["predict", "--model", "llama3-8b", "--layers", "0"], "--layers 0: must be a positive integer", "Config."),
    (["measure", "--preset", "tiny", "--kv-heads", "3"], "--kv-heads 3 does not divide --heads 4: use --kv-heads among",
     "kv_heads"),
    (["predict", "--model", "llama3-8b", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved",
      "--virtual-stages", "1"], "--virtual-stages 1 with --schedule interleaved", "or virtual_stages"),
])
def test_a_library_error_is_said_in_the_commands_flags(args, said, unsaid):
    message = refused(*args)
    assert said in message and unsaid not in message, message


def test_the_translation_leaves_flags_and_unknown_names_alone():
    from picockpt.cli.flag_words import in_flags
    flags = {"tp": "--tp", "kv_heads": "--kv-heads", "virtual_stages": "--virtual-stages"}
    assert in_flags("--tp=3 and tp=4, Config.kv_heads=8 (heads=32)", flags) == "--tp=3 and --tp 4, --kv-heads 8 (heads=32)"
    assert in_flags("use virtual_stages >= 2 or tp in [1, 2]; stp=2", flags) == \
        "use --virtual-stages >= 2 or --tp in [1, 2]; stp=2"
    flags = {"max_seq": "--max-seq", "seq": "--seq", "router_jitter": "--router-jitter", "experts": "--experts"}
    assert in_flags("seq=300 is longer than Config.max_seq=256: use seq <= 256 or raise max_seq", flags) == \
        "--seq 300 is longer than --max-seq 256: use --seq <= 256 or raise --max-seq"
    assert in_flags("Config.router_jitter=0.1 with experts=0: a mixture of experts; leave router_jitter at 0.0 "
                    "(my_router_jitter, --router-jitter)", flags) == \
        "--router-jitter 0.1 with --experts 0: a mixture of experts; leave --router-jitter at 0.0 " \
        "(my_router_jitter, --router-jitter)"


def test_predict_suggests_only_tensor_parallel_sizes_it_splits():
    """Llama 3 8B has 8 key/value heads: --tp 16 divides the 32 heads but not the K/V heads, so neither --tp 3's
    list nor the layouts of 16 ranks offer it."""
    message = refused("predict", "--model", "llama3-8b", "--tp", "3")
    assert "use one of 1, 2, 4, 8," in message and "16" not in message.split("use one of")[1].split(",  or")[0][:20]
    out = picockpt("predict", "--model", "llama3-8b", "--tp", "16").stdout
    assert "not at t=16" in out and "--tp 16;" not in out and "--tp 16 " not in out.split("layouts of 16 ranks")[1]


def test_keeping_the_gathered_kv_has_one_spelling_in_predict_and_parallel():
    """predict named it --keep-kv, parallel --cp-keep-kv: each command takes both."""
    import argparse
    from picockpt.cli import parallel, predict
    for module in (predict, parallel):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        assert parser.parse_args(["--keep-kv"]).__dict__ == parser.parse_args(["--cp-keep-kv"]).__dict__
        assert parser.parse_args(["--cp-keep-kv"]) != parser.parse_args([])

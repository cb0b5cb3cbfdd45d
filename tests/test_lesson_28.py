"""Lesson 28's statements against the code: a price in seconds moves the planner where FLOPs do not (an elementwise
rebuild made dearer changes the plan), each plan of the sweep is optimal for its own price, the modelled seconds
count the head's rebuild as the recurrence does, a plan's step leaves every number as policy none gives it, the
lesson refuses a work figure on the wrong side of 1, torch.compile's estimator options are what its text names,
and (notebooks) the numbers the lesson prints are the ones it computed."""
import contextlib
import io
import pathlib
import sys
from dataclasses import replace

import pytest
import torch

from picockpt import init_params, loss_and_grads
from picockpt.planning.cost import HARDWARE, head_ops, layer_ops, price_chain, roofline_op_seconds
from picockpt.measurement.measure import make_batch
from picockpt.planning.planner import model_chain
from picockpt.teaching.reproduce import LESSONS, checks, load, run_percent
from picockpt.measurement.tracker import Tracker

PATH = next(LESSONS.glob("28_*.py"))
CPU_LIKE = replace(HARDWARE["h100"], name="cpu-like", matmul=2e11, memory=2e10,
                   source="a fixed CPU-like roofline: 200 GFLOP/s, 20 GB/s")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def lesson():
    return load(PATH)


@pytest.fixture(scope="module")
def shape(lesson):
    return lesson.small(layers=4, attention="eager"), 2, 64


def priced_sweep(lesson, cfg, batch, seq, seconds, n=24):
    chain = model_chain(cfg, batch, seq)
    priced = {"roofline": price_chain(chain, cfg, batch, seq, roofline_op_seconds(cfg, batch, seq, CPU_LIKE)),
              "measured": price_chain(chain, cfg, batch, seq, seconds)}
    return chain, priced, lesson.sweep(chain, priced, lesson.budgets(chain, n))


def cheap_layers(schedule):
    """How many layer forwards (first forward and sweeps) drop what `cheap` drops."""
    modes = list(schedule.forward) + [m for sweep in (schedule.sweep_modes or {}).values() for m in sweep.values()]
    return sum(str(m) == "all:cheap" for m in modes)


def test_a_dearer_swiglu_moves_the_plan_off_the_flop_plan(lesson, shape):
    cfg, batch, seq = shape
    base = roofline_op_seconds(cfg, batch, seq, CPU_LIKE)
    dear = {**base, "swiglu": 100 * base["swiglu"]}  # the SwiGLU product 100x dearer to run (and to rebuild)
    chain, priced, rows = priced_sweep(lesson, cfg, batch, seq, dear)
    moved = [row for row in rows if lesson.differ(row, "FLOPs", "measured")]
    assert moved, "a SwiGLU 100x dearer changed no plan"
    assert lesson.optimal(rows)
    for row in moved:  # it buys modelled time with FLOPs, and keeps the SwiGLU product stored more often
        flop_plan, time_plan = row["plans"]["FLOPs"], row["plans"]["measured"]
        assert time_plan.recompute_flops >= flop_plan.recompute_flops
        assert row["seconds"]["measured"] < row["seconds"]["FLOPs"]
    assert any(cheap_layers(r["plans"]["measured"].schedule) < cheap_layers(r["plans"]["FLOPs"].schedule)
               for r in moved)
    chosen = lesson.pick(rows)
    assert chosen is not None and lesson.saving(chosen) == max(lesson.saving(row) for row in rows)


def test_a_price_in_proportion_to_flops_leaves_nothing_to_time(lesson, shape):
    cfg, batch, seq = shape
    by_flops = {op.name: op.flops * 1e-12 for op in layer_ops(cfg, batch, seq) + head_ops(cfg, batch, seq)}
    _, _, rows = priced_sweep(lesson, cfg, batch, seq, by_flops)
    assert all(row["plans"]["measured"].recompute_flops == row["plans"]["FLOPs"].recompute_flops for row in rows)
    assert lesson.pick(rows) is None


def test_both_plans_leave_the_numbers_as_none_gives_them(lesson, shape):
    cfg, batch, seq = shape
    base = roofline_op_seconds(cfg, batch, seq, CPU_LIKE)
    _, _, rows = priced_sweep(lesson, cfg, batch, seq, {**base, "swiglu": 100 * base["swiglu"]}, n=12)
    row = lesson.pick(rows)
    params = init_params(cfg, seed=0)
    ids, targets = make_batch(cfg, batch, seq, "cpu", 0)
    reference = loss_and_grads(params, cfg, ids, targets, "none")
    for plan in (row["plans"]["FLOPs"], row["plans"]["measured"]):
        with Tracker("cpu") as tracker:
            result = lesson.run_schedule(params, cfg, ids, targets, plan.schedule, tracker)
        assert lesson.bitwise(result, reference)
        assert tracker.peak_logical == plan.peak_bytes <= row["budget"]
        assert tracker.flops["recompute"] == plan.recompute_flops
    loss, grads = reference
    assert not lesson.bitwise((loss + 1e-3, grads), reference)  # the comparison can fail


def test_the_flop_count_is_on_the_other_side_of_the_claim():
    sys.path.insert(0, str(LESSONS))
    from _lesson import Spread, timed_claim
    below = Spread((0.95, 0.97, 0.96))
    with pytest.raises(ValueError, match="other side of 1"):
        timed_claim("cpu", below, "measured plan / FLOP plan", "<1", work=1.01)  # more FLOPs: no work figure to give
    claim = timed_claim("cpu", below, "measured plan / FLOP plan", "<1", work=None)
    assert claim.conclusive and "by work" not in claim.text
    assert not timed_claim("cpu", Spread((0.95, 1.02)), "measured plan / FLOP plan", "<1").conclusive


def test_torch_compiles_estimator_is_what_the_lesson_names():
    config = pytest.importorskip("torch._functorch.config")
    if not hasattr(config, "activation_memory_budget_runtime_estimator"):
        pytest.skip(f"torch {torch.__version__} has no activation_memory_budget_runtime_estimator")
    assert config.activation_memory_budget == 1.0 and config.activation_memory_budget_runtime_estimator == "flops"
    import inspect
    from torch._functorch import partitioners
    source = inspect.getsource(partitioners.estimate_runtime)
    assert '"profile"' in source and '"flops"' in source and "FlopCounterMode" in source
    text = PATH.read_text()
    assert "activation_memory_budget_runtime_estimator" in text and '`"profile"`' in text


@pytest.mark.notebooks
def test_the_lesson_prints_what_it_computed(tmp_path, monkeypatch):
    monkeypatch.setenv("PICOCKPT_FIGURES", str(tmp_path))
    before = len(checks())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ns = run_percent(PATH, ["--fast", "--device", "cpu"])
    printed, rows, differs = out.getvalue(), ns["rows"], ns["differs"]
    assert len(rows) == 40 and differs[("FLOPs", "measured")] == sum(ns["differ"](r, "FLOPs", "measured") for r in rows)
    assert f"the FLOP and measured plans differ at {differs[('FLOPs', 'measured')]} of 40 budgets" in printed
    assert ns["optimal"](rows)
    chosen = ns["chosen"]
    if chosen is None:
        assert "nothing to compare" in printed and ns["RESULT"]["summary"]["timed budget MiB"] is None
    else:
        assert ns["saving"](chosen) == max(ns["saving"](r) for r in rows)
        assert f"at {chosen['budget'] / 2**20:.2f} MiB the measured plan" in printed
        assert all(f["bitwise"] for f in ns["facts"].values()) and "timing not meaningful" in printed
    for path in ns["RESULT"]["figures"]:
        assert pathlib.Path(path).parent == tmp_path and pathlib.Path(path).read_bytes()[:4] == b"\x89PNG"
    assert all(v for k, v in ns["RESULT"]["summary"].items() if isinstance(v, bool))
    exercises = checks()[before:]
    assert len(exercises) == 3 and all(e.right for e in exercises)

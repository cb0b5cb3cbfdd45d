"""A lesson concludes from a time only when the timing holds what must hold.

lessons/_lesson.py's timed_claim checks a measured ratio (a Spread of interleaved, paired repeats) against
the side of 1 its claim puts it on: full recomputation does more work than none, so full / none time must
exceed 1 in every repeat. Here it is fed timings a loaded machine can give (more work measured as faster; a
spread across 1) and must answer "inconclusive on this machine" with the exact work ratio; and each lesson
that concludes from a time is run through its printing code with such a timing injected, which must print
the inconclusive line and no conclusion. Each check also runs with a timing that does hold, so that the
conclusion it forbids is shown to exist. Functions come from picockpt.teaching.reproduce.load: no experiment runs.
"""
import pathlib
import sys

import pytest

from picockpt.planning.step_forms import step_flops
from picockpt.teaching.reproduce import LESSONS, load

sys.path.insert(0, str(LESSONS))  # the lessons import _lesson by its bare name
import _lesson  # noqa: E402
from _lesson import FAST_TIMING, Spread, timed_claim  # noqa: E402

INCONCLUSIVE = "inconclusive on this machine"


def lesson(prefix):
    [path] = sorted(pathlib.Path(LESSONS).glob(f"{prefix}_*.py"))
    return load(path)


# ---- the tool itself --------------------------------------------------------------------------------

def test_more_work_measured_as_faster_is_inconclusive_and_shows_the_work():
    faster = Spread((0.71, 0.80, 0.93))  # full / none: below 1 in every repeat, though full does 1.328x the FLOPs
    claim = timed_claim("cpu", faster, "full / none, step time", ">1", 1.328)
    assert not claim.conclusive
    assert INCONCLUSIVE in claim.text and "against the claim" in claim.text
    assert "1.328" in claim.text and "1.328" in claim.short and claim.short.startswith("inconclusive")


def test_a_spread_across_one_is_inconclusive():
    claim = timed_claim("cpu", Spread((0.710, 1.485, 2.914)), "full / none, step time", ">1", 1.328)
    assert not claim.conclusive
    assert INCONCLUSIVE in claim.text and "straddle 1" in claim.text and "by work (exact) it is 1.328" in claim.text


def test_every_repeat_on_the_expected_side_is_conclusive():
    claim = timed_claim("cpu", Spread((1.04, 1.28, 1.42)), "full / none, step time", ">1", 1.328)
    assert claim.conclusive and INCONCLUSIVE not in claim.text
    assert "every repeat above 1" in claim.text and claim.short == "1.280 [1.040..1.420]"
    below = timed_claim("cpu", Spread((0.5, 0.7)), "overlapped / after", "<1", 1.0)  # equal work is neutral
    assert below.conclusive and "every repeat below 1" in below.text


def test_fast_shapes_conclude_nothing():
    claim = timed_claim("fast", Spread((1.3,)), "full / none, step time", ">1", 1.328)
    assert not claim.conclusive and claim.text.endswith(FAST_TIMING) and claim.short == FAST_TIMING


@pytest.mark.parametrize("expect", ["> 1", "above", 1, None])
def test_a_bad_expect_is_refused(expect):
    with pytest.raises(ValueError, match="expect=.*'>1' or '<1'"):
        timed_claim("cpu", Spread((1.1, 1.2)), "x", expect)


@pytest.mark.parametrize("mode", ["cpu", "fast"])
def test_a_claim_against_its_own_count_is_refused(mode):
    with pytest.raises(ValueError, match="contradicts its own exact count"):
        timed_claim(mode, Spread((0.9, 0.95)), "full / none, step time", "<1", 1.328)


# ---- each lesson's printing code, with a timing that contradicts its claim ---------------------------

def _price_inputs(price, full):
    """Lesson 08's explain() inputs for the small shape, with full / none time ratios `full` injected."""
    cfg = _lesson.small()
    rows = {p: {"hardware": sum(step_flops(cfg, 4, 128, p).values())} for p in price.POLICIES}
    model = rows["none"]["hardware"]
    ratio = {p: Spread((1.10, 1.20, 1.30)) for p in price.POLICIES}
    ratio["none"], ratio["full"] = Spread((1.0, 1.0, 1.0)), full
    return rows, model, ratio


@pytest.mark.parametrize("full", [Spread((0.71, 0.80, 0.93)), Spread((0.710, 1.485, 2.914))], ids=["faster", "across"])
def test_lesson_08_prints_no_price_from_a_contradictory_timing(capsys, full):
    price = lesson("08")
    rows, model, ratio = _price_inputs(price, full)
    claims = price.time_claims("cpu", ratio, rows, model)
    price.explain("cpu", claims, ratio, Spread((0.95, 1.02, 1.10)), (0, 100),
                  {p: rows[p]["hardware"] / model for p in claims})
    out = capsys.readouterr().out
    assert "full / none, step time: inconclusive on this machine" in out
    assert "full: the timing was inconclusive on this machine; by FLOPs it costs +32.8%" in out
    assert "full: measured here" not in out  # the time overhead is not read
    assert "faster in every repeat" not in out and "working set" not in out  # nor why full's own passes are faster


def test_lesson_08_reads_a_timing_that_holds(capsys):
    price = lesson("08")
    rows, model, ratio = _price_inputs(price, Spread((1.04, 1.28, 1.42)))
    claims = price.time_claims("cpu", ratio, rows, model)
    price.explain("cpu", claims, ratio, Spread((0.80, 0.90, 0.95)), (0, 100),
                  {p: rows[p]["hardware"] / model for p in claims})
    out = capsys.readouterr().out
    assert "full: measured here it costs +28.0% of none's time (median), for +32.8% FLOPs" in out
    assert "faster in every repeat" in out and "fewer bytes live" in out


@pytest.mark.parametrize("conclusive", [False, True])
def test_lesson_07_reads_the_rebuilds_price_only_when_cheap_is_slower(capsys, conclusive):
    cheap = lesson("07")
    ratio = {p: Spread((1.0, 1.0, 1.0)) if p == "none" else Spread((1.05, 1.1, 1.2)) for p in cheap.POLICIES}
    versus = Spread((1.02, 1.04, 1.08)) if conclusive else Spread((0.86, 0.93, 0.97))  # cheap / selective
    work = {p: 1.0 if p == "none" else 1.1 for p in cheap.POLICIES}
    cheap.explain("cpu", cheap.time_claims("cpu", ratio, versus, work), versus)
    out = capsys.readouterr().out
    assert ("cheap's elementwise rebuilds cost" in out) == conclusive
    assert ("cheap / selective, step time: inconclusive on this machine" in out) != conclusive
    assert ("by FLOPs the two are equal (1.000)" in out) != conclusive


def _pair_rows():
    return [{"name": "picockpt full", "kind": "picockpt", "equivalent": "torch checkpoint per layer",
             "memory_vs_equivalent": 0.93, "time_vs_equivalent": 0.77, "time_vs_equivalent_min_max": [0.69, 0.80],
             "total_flops": 8_422, "step_seconds": 0.11},
            {"name": "torch checkpoint per layer", "kind": "torch", "equivalent": None, "total_flops": 7_953,
             "step_seconds": 0.15},
            {"name": "picockpt none", "kind": "picockpt", "equivalent": None, "total_flops": 6_342},
            {"name": "autograd", "kind": "torch", "equivalent": None, "total_flops": 6_342}]


@pytest.mark.parametrize("full_over_none", [Spread((0.18, 0.74, 2.64)), Spread((0.8, 0.9, 0.95))])
def test_lesson_10_reads_no_time_between_implementations_when_its_checks_fail(capsys, full_over_none):
    side = lesson("10")
    rows = _pair_rows()
    checks = {"picockpt full / picockpt none": full_over_none,
              "torch checkpoint per layer / autograd": Spread((1.2, 1.3, 1.4))}
    claims = side.sanity_claims("cpu", checks, {row["name"]: row for row in rows})
    assert not claims["picockpt full / picockpt none"].conclusive
    assert INCONCLUSIVE in claims["picockpt full / picockpt none"].text
    side.pair_lines("cpu", rows, all(claim.conclusive for claim in claims.values()))
    out = capsys.readouterr().out
    assert "time inconclusive on this machine" in out and "by FLOPs 1.059x its work" in out
    assert "in every repeat" not in out  # no ranking of the two implementations


def test_lesson_10_ranks_the_implementations_when_its_checks_hold(capsys):
    side = lesson("10")
    rows = _pair_rows()
    checks = {name: Spread((1.1, 1.2, 1.3)) for name in side.SANITY}
    claims = side.sanity_claims("cpu", checks, {row["name"]: row for row in rows})
    side.pair_lines("cpu", rows, all(claim.conclusive for claim in claims.values()))
    assert "0.77x [0.690..0.800] its time: faster in every repeat, for 1.059x its FLOPs" in capsys.readouterr().out


def _rounds(full, cheap_share):
    """Lesson 22's rounds_of(policy, key) over three rounds: none 100 ms a step, full `full` times that."""
    none = [0.100, 0.150, 0.090]  # the machine drifts from round to round
    seconds = {"none": none, "full": [n * r for n, r in zip(none, full)],
               "cheap": [n * 1.02 for n in none]}  # cheap a little slower than none in every round
    shares = {"recompute_time": cheap_share, "recompute_flops_share": [0.021] * 3}
    return lambda policy, key: seconds[policy] if key == "seconds" else shares[key]


FLOPS = {"none": 1.0, "full": 1.328, "cheap": 1.021}


def test_lesson_22_draws_no_diagnosis_when_full_is_not_slower(capsys):
    monitor = lesson("22")
    claims = monitor.diagnose("cpu", _rounds([0.95, 1.4, 0.9], [0.02, 0.03, 0.019]), FLOPS)
    out = capsys.readouterr().out
    assert not claims["full"].conclusive and not claims["cheap recompute share"].conclusive
    assert "full / none, step time (round by round; none's MFU / full's): inconclusive on this machine" in out
    assert "by FLOPs, at equal HFU full's MFU is 1 / 1.328 = 0.753 of none's" in out
    assert "the slowdown is the extra work" not in out and "HFU fell too" not in out
    assert "elementwise work the FLOP count does not see" not in out


def test_lesson_22_diagnoses_a_timing_that_holds(capsys):
    monitor = lesson("22")
    claims = monitor.diagnose("cpu", _rounds([1.30, 1.33, 1.35], [0.09, 0.1, 0.08]), FLOPS)
    out = capsys.readouterr().out
    assert claims["full"].conclusive and claims["cheap"].conclusive
    assert "the slowdown is the extra work" in out and "elementwise work the FLOP count does not see" in out


def test_lesson_16_finds_the_moved_recomputation_in_a_timeline():
    pipeline = lesson("16")
    timeline = [("forward", 0, 0.0, 1.0), ("backward", 0, 1.0, 1.1), ("recompute", 0, 1.1, 1.4), ("wait", 0, 1.4, 2.0),
                ("recompute", 0, 2.0, 2.3), ("backward", 0, 2.3, 3.0)]  # top layer before the wait, the rest after
    assert pipeline.moved_seconds({"timeline": timeline}) == {0: pytest.approx(0.3)}


def _early(ratio, change, moved):
    return dict(ratio=Spread(ratio), change=Spread(change), moved=Spread(moved), last=Spread((0.004,) * len(ratio)),
                step=Spread((0.64,) * len(ratio)), paced_by_next=True, inputs_wait=Spread((0.0,) * len(ratio)))


@pytest.mark.parametrize("ratio,change", [((1.083, 1.086, 1.105), (0.053, 0.055, 0.067)),  # slower, beyond the moved
                                          ((0.93, 1.02, 1.07), (-0.045, 0.013, 0.045)),  # across 1
                                          ((0.90, 0.92, 0.95), (-0.064, -0.051, -0.032))],  # faster by more than moved
                         ids=["slower", "across", "faster-than-possible"])
def test_lesson_16_says_no_gain_from_a_timing_the_schedule_cannot_explain(capsys, ratio, change):
    pipeline = lesson("16")
    claim = pipeline.early_verdict("cpu", 8, _early(ratio, change, (0.030, 0.030, 0.030)))
    out = capsys.readouterr().out
    assert not claim.conclusive and INCONCLUSIVE in out and "1.000" in out
    assert "hid in the wait" not in out


def test_lesson_16_reads_a_gain_the_moved_work_can_explain(capsys):
    pipeline = lesson("16")
    claim = pipeline.early_verdict("cpu", 1, _early((0.95, 0.96, 0.97), (-0.020, -0.015, -0.010), (0.03, 0.03, 0.03)))
    assert claim.conclusive and "hid in the wait" in capsys.readouterr().out

"""What lessons 24, 26, 27 and 28 measure, pinned to what it rests on, without asserting any timing's outcome:
every verdict a committed notebook prints agrees with the spread printed beside it, and a lesson's conclusion
follows only a conclusive verdict (and always follows one); matmul's fold of strided heads is a view at B = 1
and a copy at B = 4 (by data pointer and by the ops dispatched), sdpa copies neither; the padded vocabulary is
a multiple of 64 and the odd one not of 8; the cache experiment's two consumers read the same bytes and the
stored one is evicted by a working set larger than the last-level cache; the shared-expert and expert rebuilds
timed in lesson 24 are the FLOPs their closed forms count; lesson 28 times the plans at the budget of the
largest modelled saving relative to the step."""
import json
import re

import pytest
import torch

from picockpt.teaching.reproduce import LESSONS, load

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

NUMBER = r"[-+]?\d[\d,]*\.?\d*"
CLAIM = re.compile(rf"(?P<what>[^\n]*?): (?P<inconclusive>inconclusive on this machine \()?(?P<med>{NUMBER}) "
                   rf"\[(?P<low>{NUMBER})\.\.(?P<high>{NUMBER})\] over \d+ interleaved repeats?"
                   r"(?:: (?P<why>the repeats straddle 1|every repeat is (?:below|above) 1, against the claim)[^)]*\)"
                   r"| \(every repeat (?P<side>above|below) 1\))")
VERDICT = re.compile(rf"(?P<what>[^\n]*?): (?P<med>{NUMBER})% \[(?P<low>{NUMBER})%\.\.(?P<high>{NUMBER})%\] over \d+ "
                     r"repeats \((?P<said>every repeat agrees on the sign|the repeats straddle 0: within the noise)\)")
# {lesson: [(the start of a claim's or a verdict's line, words the conclusion drawn from it prints)]}
CONCLUSIONS = {"24": [("moe / none, step time", "recomputing the experts' projections made the step slower"),
                      ("shared_experts / none, step time", "recomputing the shared expert made the step slower"),
                      ("moe / shared_experts, step time", "the step that rebuilds the experts took")],
               "26": [("RMSNorm rebuild, time per element from DRAM / in L2", "is priced by where its bytes come from"),
                      ("consumer's read, stored (from DRAM) / rebuilt just before (in cache)",
                       "the rebuilt copy is read from cache")],
               "27": [("time, logits V", "padding pays on this CPU"),
                      ("time, inner dimension f", "more time for less work")],
               "28": [("measured plan / FLOP plan, step time", "ran faster in every repeat")]}


def number(text):
    return float(text.replace(",", ""))


def notebook_text(prefix):
    """Everything the committed notebook of lesson `prefix` printed."""
    notebook = json.loads(next(LESSONS.glob(f"{prefix}_*.ipynb")).read_text())
    return "".join("".join(output.get("text", "")) for cell in notebook["cells"] if cell["cell_type"] == "code"
                   for output in cell.get("outputs", []))


def claims(text):
    """[(what, conclusive, low, high)] of every timed_claim line in `text`, each checked against its own spread."""
    found = []
    for match in CLAIM.finditer(text):
        low, high = number(match["low"]), number(match["high"])
        assert low <= number(match["med"]) <= high, match[0]
        if match["side"] == "above":
            assert low > 1, f"said every repeat above 1 with a spread reaching {low}: {match[0]}"
        elif match["side"] == "below":
            assert high < 1, f"said every repeat below 1 with a spread reaching {high}: {match[0]}"
        elif match["why"] == "the repeats straddle 1":
            assert low <= 1 <= high, f"said the repeats straddle 1 over [{low}..{high}]: {match[0]}"
        else:
            assert low > 1 or high < 1, match[0]
        found.append((match["what"].strip(), match["side"] is not None, low, high))
    return found


@pytest.mark.parametrize("prefix", sorted(CONCLUSIONS))
def test_each_printed_verdict_agrees_with_its_spread_and_a_conclusion_follows_only_a_conclusive_one(prefix):
    text = notebook_text(prefix)
    found = claims(text)
    assert found, f"lesson {prefix}'s notebook prints no timed claim"
    for match in VERDICT.finditer(text):
        low, high = number(match["low"]), number(match["high"])
        agrees = low > 0 or high < 0
        assert agrees == (match["said"] == "every repeat agrees on the sign"), match[0]
    verdicts = {match["what"].strip(): match["said"] == "every repeat agrees on the sign"
                for match in VERDICT.finditer(text)}
    for start, conclusion in CONCLUSIONS[prefix]:
        mine = [conclusive for what, conclusive, _, _ in found if what.startswith(start)] + \
               [agrees for what, agrees in verdicts.items() if what.startswith(start)]
        assert len(mine) == 1, f"lesson {prefix}: {len(mine)} verdicts start {start!r}"
        said = "a conclusion without" if not mine[0] else "no conclusion after"
        assert (conclusion in text) == mine[0], f"lesson {prefix}: {said} a conclusive {start!r}"


def test_the_claim_parser_can_fail():
    with pytest.raises(AssertionError, match="every repeat above 1"):
        claims("x / y, step time: 1.050 [0.990..1.100] over 9 interleaved repeats (every repeat above 1)")
    with pytest.raises(AssertionError, match="straddle"):
        claims("x / y: inconclusive on this machine (1.050 [1.010..1.100] over 9 interleaved repeats: the repeats "
               "straddle 1)")
    assert claims("x / y: 0.950 [0.900..0.990] over 9 interleaved repeats (every repeat below 1)") == \
        [("x / y", True, 0.9, 0.99)]


# ---- lesson 27: the fold copy, sdpa on strided views, the padded vocabulary ------------------------------------

@pytest.fixture(scope="module")
def layouts():
    return load(next(LESSONS.glob("27_*.py")))


def test_matmuls_fold_is_a_view_at_batch_1_and_a_copy_at_batch_4(layouts):
    assert layouts.fold_is_a_view(1, 128, 4, 32)
    assert not layouts.fold_is_a_view(4, 128, 4, 32)
    assert layouts.copies_of_strided_heads(1, 128, 4, 32) == {"matmul": 0, "sdpa": 0}
    assert layouts.copies_of_strided_heads(4, 128, 4, 32) == {"matmul": 2, "sdpa": 0}
    q, _ = layouts.strided_heads(4, 16, 4, 8)
    assert q.stride() == (16 * 4 * 8, 8, 4 * 8, 1) and not q.is_contiguous()  # (B, T, H, hd) viewed as (B, H, T, hd)


def test_the_timed_pairs_compute_what_they_name(layouts):
    steps = layouts.strided_and_contiguous(4, 16, 2, 8, " B=4")
    torch.testing.assert_close(steps["strided B=4"](), steps["contiguous B=4"](), rtol=0, atol=0)
    sdpa = layouts.sdpa_strided_and_contiguous(4, 16, 2, 8)
    torch.testing.assert_close(sdpa["sdpa strided"](), sdpa["sdpa contiguous"]())
    vocab = layouts.odd_and_padded_vocab(8, 16)
    odd, padded = vocab["odd V"](), vocab["padded V"]()
    assert odd.shape == (8, layouts.VOCAB_ODD) and padded.shape == (8, 4032)
    assert padded.shape[1] % 64 == 0 and odd.shape[1] % 8 != 0 and padded.shape[1] - odd.shape[1] < 64


def test_a_timed_pair_reports_a_calls_time_over_every_repeat(layouts):
    calls = {}
    timing = layouts.timed_pair({"a": lambda: None, "b": lambda: None}, torch.device("cpu"), 5, calls, least=1e-4)
    assert set(timing) == {"a", "b"} == set(calls) and calls["a"] == calls["b"] >= 1
    assert all(len(spread.samples) == 5 for spread in timing.values())


# ---- lesson 26: a rebuilt tensor read warm, a stored one cold ---------------------------------------------------

@pytest.fixture(scope="module")
def memory():
    return load(next(LESSONS.glob("26_*.py")))


def test_the_cache_steps_read_the_same_bytes_and_evict_more_than_the_last_level(memory):
    steps, before, kept = memory.cache_steps(64 * 2**10, evict_bytes=8 * 2**20)
    before["rebuilt: consumer"]()  # evicts, then rebuilds y into its buffer
    assert torch.equal(kept["rebuilt"], kept["y"])  # the consumer reads the stored y's exact values, rebuilt
    outputs = {name: step().clone() for name, step in steps.items()}
    assert all(torch.equal(out, outputs["stored"]) for out in outputs.values())
    assert kept["y"].numel() * 4 == 64 * 2**10 and kept["y"].shape[1] == memory.HIDDEN
    sweep = before["stored"].__closure__  # the eviction pass: over evict_bytes of its own memory
    buffers = [cell.cell_contents for cell in sweep if isinstance(cell.cell_contents, torch.Tensor)]
    assert max(b.numel() * 4 for b in buffers) == 8 * 2**20


def test_the_lesson_evicts_twice_the_last_level_and_keeps_the_consumer_within_l2():
    text = next(LESSONS.glob("26_*.py")).read_text()
    assert "cache_steps(tensor_bytes, 2 * last_size)" in text and 'tensor_bytes = caches.size("L2") // 4' in text


def test_interleaved_seconds_runs_each_setup_untimed_just_before_its_step():
    import sys
    sys.path.insert(0, str(LESSONS))
    from _lesson import interleaved_seconds
    order = []
    steps = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    timing = interleaved_seconds(steps, "cpu", 3, before={"b": lambda: order.append("setup b")})
    assert order == ["a", "setup b", "b"] * 4  # the warm-up round, then 3 repeats
    assert all(len(spread.samples) == 3 for spread in timing.values())


# ---- lesson 24: the experts' rebuild against the shared expert's -----------------------------------------------

def test_the_two_timed_rebuilds_are_the_same_flops_and_bytes():
    lesson = load(next(LESSONS.glob("24_*.py")))
    from picockpt.planning.step_forms import predicted_peak_bytes, rebuild_flops, step_flops
    from picockpt.recompute.schedule import MOE, SHARED_EXPERTS
    cfg = lesson.small(layers=2, experts=4, attention="fused")
    timing, facts, shared = lesson.rebuild_timing(cfg, 2, 32, torch.device("cpu"), 0, 1)
    assert shared.shared_expert_ffn == cfg.experts_per_token * cfg.ffn
    assert rebuild_flops(shared, 2, 32, MOE) == rebuild_flops(shared, 2, 32, SHARED_EXPERTS) > 0
    assert facts["moe"] == facts["shared_experts"] == (step_flops(shared, 2, 32, "moe")["recompute"],
                                                       predicted_peak_bytes(shared, 2, 32, "moe"))
    assert facts["none"][0] == 0 and facts["none"][1] > facts["moe"][1]
    assert set(timing) == {"none", "moe", "shared_experts"} and all(len(t.samples) == 1 for t in timing.values())
    narrower = cfg.replace(shared_expert_ffn=cfg.ffn)  # the comparison can fail: a narrower shared expert is less work
    assert rebuild_flops(narrower, 2, 32, SHARED_EXPERTS) < rebuild_flops(narrower, 2, 32, MOE)


# ---- lesson 28: a shape where the FLOP price is blind to a large part of the time ------------------------------

def cheap_share(cfg, batch, seq, hardware):
    """(FLOPs, roofline seconds) of what `cheap` adds to a layer's rebuilds, the seconds as a share of the layer's
    roofline forward."""
    from picockpt.planning.cost import FORWARD_EXCLUDES, layer_ops, rebuild_seconds, roofline_op_seconds
    seconds = roofline_op_seconds(cfg, batch, seq, hardware)
    ops = {op.name: op for op in layer_ops(cfg, batch, seq)}
    forward = sum(seconds[name] for name in ops if name not in FORWARD_EXCLUDES)
    rebuilt = {"attn_norm.output", "mlp_norm.output", "mlp.act"}
    flops = sum(ops[name].flops for name in ("attn_norm", "mlp_norm", "swiglu"))
    return flops, rebuild_seconds(seconds, rebuilt) / forward


def test_28s_shape_makes_the_elementwise_rebuilds_a_larger_share_at_zero_flops():
    from dataclasses import replace
    from picockpt.planning.cost import HARDWARE
    lesson = load(next(LESSONS.glob("28_*.py")))
    cpu_like = replace(HARDWARE["h100"], name="cpu-like", matmul=2e11, memory=2e10)
    cfg, batch, seq, *_ = lesson.shape("cpu")
    assert (cfg.attention, cfg.hidden, cfg.ffn) == ("fused", 32, 1024)
    flops, share = cheap_share(cfg, batch, seq, cpu_like)
    old_flops, old_share = cheap_share(lesson.small(attention="eager"), 4, 256, cpu_like)
    assert flops == old_flops == 0 and share > 2 * old_share  # blind to twice the share of the layer's time
    assert [mode for mode, _, _ in lesson.model_chain(cfg, batch, seq)[0].variants] == ["all", "all:cheap"]


def test_28_stops_at_an_inconclusive_timing():
    text = notebook_text("28")
    (what, conclusive, _, _), = [c for c in claims(text) if c[0].startswith("measured plan / FLOP plan")]
    after = text[text.index("measured plan / FLOP plan, step time"):].split("\n", 1)[1]
    before_exercises = after.split("✓")[0].split("✗")[0]
    if conclusive:
        assert "ran faster in every repeat" in before_exercises
    else:
        assert before_exercises.strip() == "", f"lesson 28 goes on after an inconclusive timing: {before_exercises!r}"


def test_a_working_sets_speed_is_judged_repeat_by_repeat_against_dram(memory):
    spread, dram = memory.Spread, 8
    per_element = {dram: memory.Spread((1.0, 1.1, 0.9)), 1: spread((1.2, 1.3, 1.05)), 2: spread((0.9, 1.15, 0.8)),
                   3: spread((0.5, 0.6, 0.4))}
    assert [memory.speed_of(n, per_element, dram) for n in (1, 2, 3)] == ["slower", "DRAM speed", "faster"]


def test_the_cpu_clock_is_this_threads_cpu_time_only_on_one_thread():
    import sys
    import time
    sys.path.insert(0, str(LESSONS))
    from _lesson import clock_words, compute_clock
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert compute_clock("cpu") is time.thread_time and clock_words(time.thread_time) == "this thread's CPU time"
        assert compute_clock(torch.device("cuda")) is time.perf_counter  # a GPU's kernels run while the CPU waits
        torch.set_num_threads(2)
        assert compute_clock("cpu") is time.perf_counter and clock_words(time.perf_counter) == "wall time"
    finally:
        torch.set_num_threads(before)


def test_the_cache_experiment_keeps_its_thread_on_one_core_and_gives_the_rest_back(memory):
    import os
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity on this system")
    before = os.sched_getaffinity(0)
    with memory.one_core() as core:
        assert os.sched_getaffinity(0) == {core} and core in before
    assert os.sched_getaffinity(0) == before

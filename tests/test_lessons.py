"""The lessons run, write the figures they claim, answer their exercises right, and their
measurements equal the formulas.

tests/test_notebooks.py executes every lesson as a notebook at --fast, in a Jupyter kernel, and checks
its figures, its summary and its exercises. Here the same checks run on the lessons as a script runs
them (in this process, as `python -m picockpt reproduce` does: a percent-format lesson's cells through
runpy, a script in the older format through its main(argv)): every older-format script, the first
lessons, and every lesson that spawns ranks, whose script form differs where it matters (spawned ranks
re-import the lesson: its __main__ guard). The others' cells are the notebook test's, run once.
Figures go to a temporary folder ($PICOCKPT_FIGURES), so the committed PNGs in figures/ stay
untouched. New lessons are picked up by their file names.
"""
import os
import pathlib
import subprocess
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
import torch

from commands import picockpt
from picockpt import Config, init_params
from picockpt.planning.step_forms import chain_sizes, predicted_peak_bytes, step_flops
from picockpt.measurement.measure import make_batch
from picockpt.teaching.plotting import phase_spans
from picockpt.teaching.reproduce import LESSONS, checks, discover, kind, load, run_lesson, run_percent

SCRIPTS = discover(kinds=(".py",))
PERCENT = [path for path in SCRIPTS if kind(path) == "percent"]
AS_SCRIPTS = [path for path in SCRIPTS if kind(path) != "percent" or path.name[:2] in ("00", "01", "02")
              or "spawning_ranks(" in path.read_text()]  # the rest run as notebooks (test_notebooks.py)
PNG = b"\x89PNG\r\n\x1a\n"
FAST = ["--fast", "--device", "cpu"]


def lesson(prefix):
    """The functions and constants of the one lesson whose file name starts with `prefix` (its experiment
    does not run: reproduce.load)."""
    [path] = [path for path in SCRIPTS if path.name.startswith(prefix)]
    return load(path)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture
def figures(tmp_path, monkeypatch):
    monkeypatch.setenv("PICOCKPT_FIGURES", str(tmp_path))
    yield tmp_path
    plt.close("all")


def assert_png(path, folder):
    path = pathlib.Path(path)
    assert path.parent == folder, f"{path} was not written to $PICOCKPT_FIGURES ({folder})"
    assert path.is_file(), f"{path} was not written"
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5000, f"{path} is not a real PNG figure"


def run_fast(path):
    """(RESULT, the lesson's namespace or None, the exercises it checked) of one --fast run, as a script."""
    before = len(checks())
    if kind(path) == "percent":
        namespace = run_percent(path, FAST)
        return namespace["RESULT"], namespace, checks()[before:]
    return load(path).main(FAST), None, checks()[before:]


# ---- every lesson, as a learner or `reproduce` runs it ---------------------------------------

def test_lessons_are_found():
    names = [path.name for path in SCRIPTS]
    assert len(PERCENT) >= 16, names  # 00 x2, 01-11 and the three derivation notebooks
    assert names == sorted(names)
    assert {"00_start_here.py", "01_memory_explorer.py", "03_deriving_L_over_C_plus_C.py"} <= set(names)


@pytest.mark.notebooks
@pytest.mark.parametrize("script", AS_SCRIPTS, ids=lambda p: p.stem)
def test_lesson_runs_as_a_script(script, figures):
    result, _, exercises = run_fast(script)
    if script.name != "00_start_here.py":  # the orientation notebook draws nothing
        assert result["figures"], f"{script.name} claims no figure"
    for path in result["figures"]:
        assert_png(path, figures)
    assert isinstance(result["summary"], dict) and result["summary"]
    for key, value in result["summary"].items():  # "stored = formula: True" and the like
        if isinstance(value, bool) and ("=" in key or "exists" in key):
            assert value, f"{script.name}: {key} is False"
    if kind(script) == "percent":  # two or three exercises, every committed answer right by the code
        assert 2 <= len(exercises) <= 3, [e.question for e in exercises]
        wrong = [f"{e.question}: answer {e.answer!r}, the code says {e.expected!r}" for e in exercises if not e.right]
        assert not wrong, wrong


@pytest.mark.notebooks
def test_reproduce_command(tmp_path):
    env = {**os.environ, "PICOCKPT_FIGURES": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "picockpt", "reproduce", "--fast", "--only", "02", "--device", "cpu",
                          "--threads", "1"],
                         capture_output=True, text=True, env=env, cwd=LESSONS.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[1/1] 02_anatomy_of_a_step.py" in out.stdout
    assert "stored = formula: True" in out.stdout  # the results table
    assert "exercises right: 3 of 3" in out.stdout
    assert_png(tmp_path / "02_anatomy_of_a_step.png", tmp_path)


def test_reproduce_rejects_an_unknown_lesson():
    out = picockpt("reproduce", "--only", "99")
    assert out.returncode == 2 and "there is no lesson 99" in out.stderr and "Traceback" not in out.stderr


OLD_SCRIPT = '''"""Lesson 02: a script in the older format."""
def main(argv):
    return {"figures": [], "summary": {"argv": " ".join(argv)}}
'''
PERCENT_LESSON = '''# %% [markdown]
# # Lesson 02: a lesson in cells

# %%
import sys
FLAGS = " ".join(sys.argv[1:])

# %%
RESULT = {"figures": [], "summary": {"argv": FLAGS}}
'''


def test_reproduce_runs_both_formats_and_skips_the_notebooks_of_sources(tmp_path):
    (tmp_path / "01_old.py").write_text(OLD_SCRIPT)
    (tmp_path / "02_cells.py").write_text(PERCENT_LESSON)
    (tmp_path / "02_cells.ipynb").write_text("{}")  # made from 02_cells.py: not a lesson of its own
    (tmp_path / "03_alone.ipynb").write_text("{}")  # a notebook with no source: a lesson
    (tmp_path / "04_empty.py").write_text(PERCENT_LESSON.replace("RESULT = ", "OUTCOME = "))
    assert [path.name for path in discover(tmp_path)] == ["01_old.py", "02_cells.py", "03_alone.ipynb",
                                                          "04_empty.py"]
    assert [kind(path) for path in discover(tmp_path)] == ["script", "percent", "notebook", "percent"]
    for name in ("01_old.py", "02_cells.py"):
        result = run_lesson(tmp_path / name, ["--fast", "--device", "cpu"])
        assert result["error"] is None and result["summary"] == {"argv": "--fast --device cpu"}, result
    result = run_lesson(tmp_path / "04_empty.py", ["--fast"])
    assert result["error"] == ("ValueError: 04_empty.py defines no RESULT dict: its last cell should be "
                               "RESULT = {'figures': [...], 'summary': {...}}")


def test_load_runs_definitions_only(tmp_path):
    (tmp_path / "05_defs.py").write_text(PERCENT_LESSON.replace("# %%\nRESULT", "# %%\nX, A = 1, 2\n"
                                                                "TABLE = {'a': 1}\nraise SystemExit('ran')\n"
                                                                "def twice(x):\n    return 2 * x\n\n# %%\nRESULT"))
    module = load(tmp_path / "05_defs.py")
    assert module.twice(21) == 42 and module.TABLE == {"a": 1} and module.FLAGS == ""
    assert not hasattr(module, "X") and not hasattr(module, "RESULT")


# ---- the measurements the lessons plot, held to the formulas ----------------------------------

@pytest.mark.parametrize("policy", ["none", "full"])
def test_anatomy_peak_is_the_exact_formula(policy):
    anatomy = lesson("02_anatomy")
    cfg, batch, seq = anatomy.shape("fast")
    tracker = anatomy.watch_step(cfg, batch, seq, policy, "cpu")
    assert tracker.peak_logical == predicted_peak_bytes(cfg, batch, seq, policy)
    assert max(e["logical"] for e in tracker.timeline) == tracker.peak_logical
    assert tracker.peak_physical > tracker.peak_logical  # working memory on top of the store
    recomputes = [span for span in phase_spans(tracker.timeline) if span[0] == "recompute"]
    assert len(recomputes) == (cfg.layers if policy == "full" else 0)  # one micro-spike per layer


def test_lesson_02_legend_names_every_phase(figures):
    namespace = run_percent(next(p for p in SCRIPTS if p.name.startswith("02")), FAST)
    assert namespace["RESULT"]["figures"] == [str(figures / "02_anatomy_of_a_step.png")]
    top = namespace["fig"].axes[0]  # the legend sits in the first panel (none), which has no recompute phase itself
    labels = [text.get_text() for text in top.get_legend().get_texts()]
    assert {"forward", "recompute", "backward", "optimizer"} <= set(labels), labels
    assert len(labels) == len(set(labels)) == 7  # four phases and three curves, each once


@pytest.mark.slow
@pytest.mark.parametrize("layers,hidden,ffn,seq", [(32, 32, 64, 16), (64, 32, 32, 8)])
def test_u_curve_minimum_is_where_the_formula_puts_it(layers, hidden, ffn, seq, u_curve):
    segments = lesson("04_segments")
    cfg, batch, measured = u_curve(layers, hidden, ffn, seq)  # lesson 04's measure_peaks, C = 1..L (conftest.py)
    every_c = range(1, layers + 1)
    exact = {C: predicted_peak_bytes(cfg, batch, seq, f"every:{C}") for C in every_c}
    assert measured == exact  # every point of the U, to the byte
    best = segments.argmins(measured)
    assert best == segments.argmins(exact)
    assert 1 < best[0] < layers, "the minimum should be inside the range: a U, not a slope"
    X, A, _ = chain_sizes(cfg, batch, seq)
    assert abs(best[0] - (layers * X / A) ** 0.5) < 1  # Chen's sqrt(L·X/A) lands next to it


def test_selective_removes_exactly_the_square_term():
    sequence = lesson("06_selective")
    cfg, batch, seqs = sequence.shape("fast")
    cfg = cfg.replace(max_seq=max(seqs))
    peaks = sequence.measure(cfg, batch, seqs, ("none", "selective"))
    for (policy, T), (stored, live) in peaks.items():
        assert stored == predicted_peak_bytes(cfg, batch, T, policy)
    element = batch * cfg.heads * 4  # fp32 bytes of one T² element of one layer
    none = sequence.square_term(seqs, [peaks["none", T][0] for T in seqs], element)
    selective = sequence.square_term(seqs, [peaks["selective", T][0] for T in seqs], element)
    assert none == pytest.approx(cfg.layers, abs=1e-3) and selective == pytest.approx(0, abs=1e-3)
    assert sequence.korthikanti_check(cfg, batch, seqs[0]) == 5  # bytes per element, 16-bit with dropout


def test_dropout_needs_the_rng_replay():
    rng = lesson("09_rng")
    cfg, batch, seq = rng.shape("fast")
    params = init_params(cfg, seed=0)
    input_ids, targets = make_batch(cfg, batch, seq, "cpu", 0)
    _, reference = rng.gradients(cfg, params, input_ids, targets, "none", 0)
    for policy, exact_without_replay in (("full", False), ("selective", True)):
        _, replayed = rng.gradients(cfg, params, input_ids, targets, policy, 0, replay=True)
        _, fresh = rng.gradients(cfg, params, input_ids, targets, policy, 0, replay=False)
        assert rng.errors(replayed, reference, cfg.layers)[0] == 0.0
        assert (rng.errors(fresh, reference, cfg.layers)[0] == 0.0) == exact_without_replay


def test_the_price_in_flops_is_exact():
    price = lesson("08_the_price")
    cfg, batch, seq, _ = price.shape("fast")
    rows = price.measure(cfg, batch, seq, ("none", "full"), repeats=1)
    for policy, row in rows.items():
        assert {phase: row[phase] for phase in price.PHASES} == step_flops(cfg, batch, seq, policy)
    forward = step_flops(cfg, batch, seq)["forward"]
    head = 2 * batch * seq * cfg.hidden * cfg.vocab  # the LM head: not recomputed
    assert rows["full"]["recompute"] == forward - head  # one extra forward of the layers
    split = {policy: row["phase_seconds"] for policy, row in rows.items()}  # from the engine's trace lines
    assert split["none"]["recompute"] == 0 and split["full"]["recompute"] > 0
    assert all(split[policy]["forward"] > 0 and split[policy]["backward"] > 0 for policy in split)


def test_liger_holds_the_gradients_and_cut_cross_entropy_recomputes_the_logits():
    """Lesson 13's two schemes of a chunked head: Liger's forward makes the input and weight gradients and holds
    them (N·h + V·h numbers), Cut Cross-Entropy's (picockpt's loss_chunk) holds the lse and computes the logits
    again in the backward: the same loss and gradients, 2·N·h·V FLOPs apart."""
    head = lesson("13_flash")
    cfg = Config(vocab=2048, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64, max_seq=64)
    N, h, V = 32, cfg.hidden, cfg.vocab
    rows = head.head_schemes(cfg, N, 8)
    liger, cce = rows["liger"], rows["cut cross-entropy"]
    assert liger["held"] == N * h * 4 + V * h * 4 + 4 * N  # input gradient, weight gradient, the norm's rstd
    assert cce["held"] == N * h * 4 + 4 * N + 4 * N  # the norm's output, the lse, the norm's rstd
    logits = 2 * N * h * V
    assert (liger["flops"]["forward"], liger["flops"]["recompute"], liger["flops"]["backward"]) == (3 * logits, 0, 0)
    assert (cce["flops"]["forward"], cce["flops"]["recompute"], cce["flops"]["backward"]) == \
        (logits, logits, 2 * logits)
    assert liger["loss"] == pytest.approx(cce["loss"], rel=1e-6)
    for a, b in zip(liger["grads"], cce["grads"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("stages,microbatches", [(2, 1), (4, 8), (8, 16)])
def test_the_two_bubble_conventions_convert(stages, microbatches):
    """Lesson 16: Narayanan et al.'s bubble over ideal time b = (p - 1)/m is the share of the step b/(1 + b) that
    bubble_fraction returns and the lesson measures; v interleaved chunks divide b by v."""
    pipeline = lesson("16_pipeline")
    b = pipeline.bubble_over_ideal(stages, microbatches)
    assert b == (stages - 1) / microbatches
    assert b / (1 + b) == pytest.approx(pipeline.bubble_fraction(stages, microbatches), rel=1e-12)
    assert pipeline.bubble_over_ideal(stages, microbatches, 2) == pytest.approx(b / 2, rel=1e-12)


def test_every_lesson_has_its_own_number_and_the_suggested_path_visits_each_in_order():
    """Lessons are numbered once each (00, 01, ..., no two alike), and 00_start_here's suggested path names every
    lesson after the map and the memory explorer, in order: a lesson added without a place in the path fails."""
    import re
    numbers = [path.name[:2] for path in discover(kinds=(".py",))]
    assert len(numbers) == len(set(numbers)), sorted(n for n in numbers if numbers.count(n) > 1)
    assert numbers == [f"{i:02d}" for i in range(len(numbers))]
    start = (LESSONS / "00_start_here.py").read_text(encoding="utf-8")
    path = start[start.index("A suggested path"):start.index("memory explorer (`01_memory_explorer`)")]
    assert re.findall(r"\b\d\d\b", path) == numbers[2:]

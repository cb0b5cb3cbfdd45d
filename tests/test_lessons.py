"""The lessons run, write the figures they claim, and their measurements equal the formulas.

Every notebook in lessons/ is executed (lessons/ as its working directory, a time limit per cell
and for the whole notebook); every lesson script runs with --fast; `python -m picockpt reproduce`
runs once through the command line. Figures go to a temporary folder ($PICOCKPT_FIGURES), so
the committed PNGs in figures/ stay untouched. New lessons are picked up by their file names.
"""
import os
import pathlib
import subprocess
import sys
import time

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
import torch

from picockpt import init_params
from picockpt.inventory import chain_sizes, predicted_peak_bytes, step_flops
from picockpt.measure import make_batch
from picockpt.plotting import phase_spans
from picockpt.reproduce import LESSONS, discover, load, run_notebook

SCRIPTS = discover(kinds=(".py",))
NOTEBOOKS = discover(kinds=(".ipynb",))
CELL_TIMEOUT_S = 120        # one notebook cell
NOTEBOOK_BUDGET_S = 90      # one whole notebook (each runs in about 5-20 s on 2 CPU cores)
PNG = b"\x89PNG\r\n\x1a\n"


def lesson(number):
    """The lesson script module whose file name starts with `number`."""
    return load(next(path for path in SCRIPTS if path.name.startswith(number)))


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


# ---- every lesson, as a learner or `reproduce` runs it ---------------------------------------

def test_lessons_are_found():
    assert len(SCRIPTS) >= 7, [p.name for p in SCRIPTS]
    assert [p.name[:2] for p in SCRIPTS] == sorted(p.name[:2] for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_lesson_script_fast(script, figures):
    result = load(script).main(["--fast", "--device", "cpu"])
    assert result["figures"], f"{script.name} claims no figure"
    for path in result["figures"]:
        assert_png(path, figures)
    assert isinstance(result["summary"], dict) and result["summary"]
    for key, value in result["summary"].items():  # "stored = formula: True" and the like
        if isinstance(value, bool) and ("=" in key):
            assert value, f"{script.name}: {key} is False"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(notebook, figures):
    start = time.perf_counter()
    claimed, cells = run_notebook(notebook, cell_timeout=CELL_TIMEOUT_S)
    seconds = time.perf_counter() - start
    assert cells > 0
    assert seconds < NOTEBOOK_BUDGET_S, f"{notebook.name} took {seconds:.0f} s (budget {NOTEBOOK_BUDGET_S} s)"
    for path in claimed:
        assert_png(path, figures)


def test_reproduce_command(tmp_path):
    env = {**os.environ, "PICOCKPT_FIGURES": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "picockpt", "reproduce", "--fast", "--only", "01", "--device", "cpu",
                          "--threads", "1"],
                         capture_output=True, text=True, env=env, cwd=LESSONS.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[1/1] 01_anatomy_of_a_step.py" in out.stdout
    assert "stored = formula: True" in out.stdout  # the results table
    assert_png(tmp_path / "01_anatomy_of_a_step.png", tmp_path)


def test_reproduce_rejects_an_unknown_lesson():
    out = subprocess.run([sys.executable, "-m", "picockpt", "reproduce", "--only", "99"], capture_output=True,
                         text=True, cwd=LESSONS.parent)
    assert out.returncode == 2 and "there is no lesson 99" in out.stderr and "Traceback" not in out.stderr


# ---- the measurements the lessons plot, held to the formulas ----------------------------------

@pytest.mark.parametrize("policy", ["none", "full"])
def test_anatomy_peak_is_the_exact_formula(policy):
    anatomy = lesson("01")
    cfg, batch, seq = anatomy.shape("fast")
    tracker = anatomy.watch_step(cfg, batch, seq, policy, "cpu")
    assert tracker.peak_logical == predicted_peak_bytes(cfg, batch, seq, policy)
    assert max(e["logical"] for e in tracker.timeline) == tracker.peak_logical
    assert tracker.peak_physical > tracker.peak_logical  # working memory on top of the store
    recomputes = [span for span in phase_spans(tracker.timeline) if span[0] == "recompute"]
    assert len(recomputes) == (cfg.layers if policy == "full" else 0)  # one micro-spike per layer


def test_lesson_01_legend_names_every_phase(figures):
    result = lesson("01").main(["--fast", "--device", "cpu"])
    assert result["figures"] == [str(figures / "01_anatomy_of_a_step.png")]
    top = plt.gcf().axes[0]  # the legend sits in the first panel (none), which has no recompute phase itself
    labels = [text.get_text() for text in top.get_legend().get_texts()]
    assert {"forward", "recompute", "backward", "optimizer"} <= set(labels), labels
    assert len(labels) == len(set(labels)) == 7  # four phases and three curves, each once


@pytest.mark.parametrize("layers,hidden,ffn,seq", [(32, 32, 64, 16), (64, 32, 32, 8)])
def test_u_curve_minimum_is_where_the_formula_puts_it(layers, hidden, ffn, seq):
    segments = lesson("02")
    cfg, batch = segments.deep(layers, hidden=hidden, ffn=ffn), 2
    every_c = range(1, layers + 1)
    measured = segments.measure_peaks(cfg, batch, seq, every_c)
    exact = {C: predicted_peak_bytes(cfg, batch, seq, f"every:{C}") for C in every_c}
    assert measured == exact  # every point of the U, to the byte
    best = segments.argmins(measured)
    assert best == segments.argmins(exact)
    assert 1 < best[0] < layers, "the minimum should be inside the range: a U, not a slope"
    X, A, _ = chain_sizes(cfg, batch, seq)
    assert abs(best[0] - (layers * X / A) ** 0.5) < 1  # Chen's sqrt(L·X/A) lands next to it


def test_selective_removes_exactly_the_square_term():
    sequence = lesson("03")
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
    rng = lesson("06")
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
    price = lesson("05")
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

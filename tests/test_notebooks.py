"""Each lesson is one source: its committed notebook has the same cells, was executed at the CPU
run's shapes, and the lesson runs as a notebook (a Jupyter kernel, --fast from $PICOCKPT_LESSON_ARGS),
each cell within a timeout, its exercises answered right.

A failing drift test means a lesson's .py changed without its notebook: `python -m picockpt
notebooks --only NN` makes the notebook again (executed; it also rewrites the lesson's figures).
"""
import concurrent.futures
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import textwrap

import nbformat
import pytest

from picockpt.teaching.notebooks import ARGS_VARIABLE, Cell, cells, differences, execute, notebook, write
from picockpt.teaching.plotting import REPO
from picockpt.teaching.reproduce import LESSONS, discover, kind

PERCENT = [path for path in discover(kinds=(".py",)) if kind(path) == "percent"]
CELL_TIMEOUT_S = 120        # one notebook cell
FAST_TIMING = "timing not meaningful at --fast shapes"
AFTER = """
import json as _json, sys as _sys
_checks = getattr(_sys.modules.get("_check"), "CHECKS", [])
print(_json.dumps({"result": RESULT, "mode": args.mode,
                   "exercises": [[c.question, c.right] for c in _checks]}, default=str))
"""


def ids(path):
    return path.stem


def outputs_text(book):
    """Every text a notebook's code cells printed or displayed, in one string."""
    parts = []
    for cell in book.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", "") if output.output_type == "stream" else
                         output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


# ---- the committed notebooks follow their sources ---------------------------------------------

def test_every_notebook_has_its_source():
    alone = [path.name for path in LESSONS.glob("[0-9][0-9]_*.ipynb") if not path.with_suffix(".py").is_file()]
    assert not alone, f"notebooks without a percent-format source: {alone}"
    assert len(PERCENT) >= 16


@pytest.mark.parametrize("source", PERCENT, ids=ids)
def test_committed_notebook_matches_its_source(source):
    committed = source.with_suffix(".ipynb")
    assert committed.is_file(), f"{committed.name} is missing: python -m picockpt notebooks --only {source.name[:2]}"
    found = differences(source, committed)
    assert not found, (f"{committed.name} differs from {source.name} ({'; '.join(found)}): "
                       f"python -m picockpt notebooks --only {source.name[:2]}")


@pytest.mark.parametrize("source", PERCENT, ids=ids)
def test_committed_notebook_was_executed_at_full_shapes(source):
    book = nbformat.read(str(source.with_suffix(".ipynb")), as_version=4)
    code = [cell for cell in book.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "not executed top to bottom"
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
    text = outputs_text(book)
    assert "--fast: figures go to" not in text and FAST_TIMING not in text, "executed at --fast shapes"
    assert "✗ not yet" not in text and "no answer yet" not in text
    assert 2 <= text.count("✓ right: ") <= 3, "every exercise answered, and checked right"
    assert "wrote /" not in text, "a figure's path is shown from this machine's root"
    assert book.metadata.kernelspec.name == "python3"


@pytest.mark.notebooks
def test_the_check_command_agrees():
    out = subprocess.run([sys.executable, "-m", "picockpt", "notebooks", "--check"], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("follows its source") == len(PERCENT)


# ---- every lesson runs as a notebook ------------------------------------------------------------

def execute_fast(source, figures):
    """One lesson as a notebook at --fast, in a kernel of its own, its figures into `figures`: the text AFTER
    printed. Runs in a worker process, so the environment is its own."""
    os.environ["PICOCKPT_FIGURES"] = str(figures)
    return execute(notebook(cells(source)), source.parent, "--fast --device cpu", CELL_TIMEOUT_S, then=AFTER)[1]


@pytest.fixture(scope="module")
def fast_runs(request, tmp_path_factory):
    """The selected lessons' notebooks at --fast, two at a time (each kernel computes on one thread, and CI
    has two cores), started at the first test that needs one: {stem: (future, figures folder)}."""
    selected = [item.callspec.params["source"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_notebook_executes_fast"]
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    runs = {}
    for source in selected:
        figures = tmp_path_factory.mktemp(source.stem)
        runs[source.stem] = (pool.submit(execute_fast, source, figures), figures)
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)  # no kernel outlives the module


@pytest.mark.notebooks
@pytest.mark.parametrize("source", PERCENT, ids=ids)
def test_notebook_executes_fast(source, fast_runs):
    future, figures = fast_runs[source.stem]
    printed = future.result()  # its time is not asserted: a timed unit test on a shared machine is noise (a
    #                            first kernel start has taken 120 s); each cell's timeout still bounds a hang
    report = json.loads(printed.strip().splitlines()[-1])
    assert report["mode"] == "fast"  # the flags came from $PICOCKPT_LESSON_ARGS, not from the kernel's argv
    if source.name != "00_start_here.py":  # the orientation notebook draws nothing
        assert report["result"]["figures"], f"{source.name} claims no figure"
    for path in report["result"]["figures"]:
        path = pathlib.Path(path)
        assert path.parent == figures and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
        assert path.stat().st_size > 5000, f"{path} is not a real PNG figure"
    assert isinstance(report["result"]["summary"], dict) and report["result"]["summary"]
    for key, value in report["result"]["summary"].items():
        if isinstance(value, bool) and ("=" in key or "exists" in key):
            assert value, f"{source.name}: {key} is False"
    exercises = report["exercises"]
    assert 2 <= len(exercises) <= 3 and all(right for _, right in exercises), exercises


def test_lesson_flags_in_a_notebook_come_from_the_environment(monkeypatch):
    sys.path.insert(0, str(LESSONS))
    import _lesson
    monkeypatch.setattr(_lesson, "in_notebook", lambda: True)
    monkeypatch.setattr(sys, "argv", ["ipykernel_launcher.py", "-f", "/tmp/kernel.json"])  # not the lesson's
    monkeypatch.setenv(ARGS_VARIABLE, "--seed 3 --device cpu")
    args = _lesson.lesson_args()
    assert (args.mode, args.seed, str(args.device)) == ("cpu", 3, "cpu")
    monkeypatch.setenv(ARGS_VARIABLE, "--fast --bogus")
    with pytest.raises(ValueError) as error:
        _lesson.lesson_args()
    assert str(error.value) == (f"${ARGS_VARIABLE}: unrecognized arguments: --bogus (the flags are --fast, --large, "
                                f"--device, --seed, --threads)")


# ---- the format and the command ------------------------------------------------------------------

def test_cells_of_a_percent_file(tmp_path):
    source = tmp_path / "01_x.py"
    source.write_text("# %% [markdown]\n# # Title\n#\n# Some *text*.\n\n# %%\nx = 1\n\n\n# %%\nprint(x)\n")
    assert cells(source) == [Cell("markdown", "# Title\n\nSome *text*."), Cell("code", "x = 1"),
                             Cell("code", "print(x)")]
    source.write_text("import os\n# %%\nx = 1\n")
    with pytest.raises(ValueError) as error:
        cells(source)
    assert str(error.value) == f"{source}:1: text before the first cell; start the file with '# %%' or '# %% [markdown]'"
    source.write_text("# %% [markdown]\n# fine\nnot a comment\n")
    with pytest.raises(ValueError) as error:
        cells(source)
    assert str(error.value).startswith(f"{source}:3: a markdown cell (from line 1) holds a line that is not a comment")


def test_drift_is_found(tmp_path):
    source = tmp_path / "01_x.py"
    source.write_text("# %% [markdown]\n# # Title\n\n# %%\nx = 1\nprint(x)\n")
    committed = write(notebook(cells(source)), tmp_path / "01_x.ipynb")
    assert differences(source, committed) == []
    source.write_text("# %% [markdown]\n# # Title\n\n# %%\nx = 1\nprint(x + 1)\n")
    assert differences(source, committed) == ["cell 1 (code in the source, code in the notebook) differs, "
                                              "from line 2 of the cell"]
    source.write_text("# %% [markdown]\n# # Title\n\n# %%\nx = 1\nprint(x)\n\n# %%\ny = 2\n")
    assert differences(source, committed) == ["the source has 3 cells, the notebook 2"]


@pytest.mark.notebooks
def test_the_notebooks_command_writes_executes_and_checks(tmp_path):
    lessons = tmp_path / "lessons"
    lessons.mkdir()
    (lessons / "01_tiny.py").write_text("# %% [markdown]\n# # Lesson 02: tiny\n\n# %%\nimport os\n"
                                        f"print('flags:', repr(os.environ['{ARGS_VARIABLE}']))\n")
    runner = textwrap.dedent(f"""
        import pathlib, sys
        import picockpt.teaching.reproduce
        picockpt.teaching.reproduce.LESSONS = pathlib.Path({str(lessons)!r})
        from picockpt.cli import main
        sys.exit(main(sys.argv[1:]))""")

    def command(*words):
        return subprocess.run([sys.executable, "-c", runner, "notebooks", *words], capture_output=True, text=True,
                              cwd=REPO, env={**os.environ, "PICOCKPT_FIGURES": str(tmp_path / "figures")})

    out = command("--check")
    assert out.returncode == 1 and "01_tiny.ipynb" in out.stdout and "there is no notebook" in out.stdout
    out = command()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 of 1 notebooks written" in out.stdout
    book = nbformat.read(str(lessons / "01_tiny.ipynb"), as_version=4)
    assert outputs_text(book) == "flags: '--device cpu --threads 1'\n"  # the CPU run, from the environment
    assert command("--check").stdout.split() == ["01_tiny.ipynb", "follows", "its", "source"]
    (lessons / "01_tiny.py").write_text((lessons / "01_tiny.py").read_text().replace("flags:", "flags are:"))
    out = command("--check")
    assert out.returncode == 1 and "cell 1 (code in the source, code in the notebook) differs, from line 2" in out.stdout
    out = command("--only", "7")
    assert out.returncode == 2 and "there is no lesson 07" in out.stderr

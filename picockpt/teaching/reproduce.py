"""Every lesson's experiment, in reading order: all of figures/ and a short results table.

    results = reproduce(device="auto", fast=False, only=None)    # python -m picockpt reproduce

Lessons are the files lessons/NN_name.py (NN: two digits), run in the order of their names, so a
new one is picked up by its file name alone. Three kinds run side by side:

  - a percent-format lesson (picockpt/teaching/notebooks.py; lessons/_lesson.py says how one is written):
    its cells run top to bottom in this process (runpy), with the lesson flags (--fast, --large,
    --device, --seed, --threads) as its command line; its last cell defines
    RESULT = {"figures": [paths], "summary": {short key: value}}. lessons/NN_name.ipynb beside it
    is the notebook made from it (`python -m picockpt notebooks`), not a lesson of its own.
  - a script in the older format has main(argv), which takes the same flags and returns the same
    dict. It is imported by file path.
  - a notebook with no source beside it is executed top to bottom (nbclient), in lessons/ as its
    working directory; its figures are the names it passes to save_figure.

Each lesson's own output is captured (shown with verbose=True, or when it fails); one line of progress per lesson, then
the table of every summary, with how many of its exercises the answers in the lesson get right. A --fast run writes its
figures to out/figures/ (plotting.FAST_FIGURES), never over the committed ones, unless $PICOCKPT_FIGURES says where.
Ctrl-C stops the whole run (KeyboardInterrupt; the command exits with 130): in a notebook it interrupts the running
cell, as Jupyter's stop button does.

load(path) gives a lesson's functions and constants without running its experiment (the tests
call them): a script in the older format is imported; of a percent-format lesson only the
imports, the def and class statements and the UPPER_CASE assignments run.
"""
import ast
import contextlib
import importlib.util
import io
import json
import os
import pathlib
import re
import runpy
import sys
import time
import traceback

import torch

from ..device import resolve_device
from .notebooks import cells, is_percent, notebook_cells, run_notebook
from .plotting import FAST_FIGURES, REPO, check_writable, environ, figures_dir

LESSONS = REPO / "lessons"


def discover(folder=None, kinds=(".py", ".ipynb")):
    """The lessons, in reading order: lessons/[0-9][0-9]_*.py, and *.ipynb without a .py source
    beside them, sorted by name."""
    paths = sorted(pathlib.Path(folder or LESSONS).glob("[0-9][0-9]_*"))
    return [path for path in paths if path.suffix in kinds
            and not (path.suffix == ".ipynb" and path.with_suffix(".py").is_file())]


def kind(path):
    """"percent" (cells, RESULT), "script" (main(argv)) or "notebook" (an .ipynb alone)."""
    path = pathlib.Path(path)
    return "notebook" if path.suffix == ".ipynb" else "percent" if is_percent(path) else "script"


def title(path):
    """A lesson's first line: its first markdown heading, or the script's docstring."""
    path = pathlib.Path(path)
    if kind(path) == "script":
        return (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").split("\n", 1)[0]
    found = cells(path) if kind(path) == "percent" else notebook_cells(path)
    text = next((cell.source for cell in found if cell.kind == "markdown"), "")
    return text.strip().split("\n", 1)[0].lstrip("# ")


def notebook_figures(path):
    """The figure names a notebook passes to save_figure(fig, "name"), as paths in figures_dir()."""
    book = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))["cells"]
    code = "\n".join("".join(c["source"]) for c in book if c["cell_type"] == "code")
    return [figures_dir() / f"{name}.png" for name in re.findall(r"save_figure\([^,]+,\s*[\"']([^\"']+)[\"']", code)]


@contextlib.contextmanager
def _as_a_script(path, argv):
    """sys.argv = [path, *argv] and the lesson's folder first on sys.path (where its _lesson.py is), as
    `python lessons/NN_name.py ...` would have them; both put back afterwards."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv[:] = [str(path), *argv]
    sys.path.insert(0, str(pathlib.Path(path).parent))
    try:
        yield
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path


def run_percent(path, argv):
    """Run a percent-format lesson as a script, in this process; returns the namespace its cells left."""
    with _as_a_script(path, argv):
        return runpy.run_path(str(path), run_name="__main__")


def load(path):
    """A lesson's functions and constants, without its experiment (see the top of this file)."""
    path = pathlib.Path(path)
    name = f"lesson_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with _as_a_script(path, []):  # its folder on sys.path, as run: _lesson.py imports its sibling _timing.py
        if kind(path) != "percent":
            spec.loader.exec_module(module)
            return module
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        tree.body = [node for node in tree.body if _is_definition(node)]
        exec(compile(tree, str(path), "exec"), module.__dict__)
    return module


def _is_definition(node):
    """An import, a def or class, or a constant: NAME = ... (or A_NAME, B_NAME = ...) for UPPER_CASE names
    of two letters or more (one capital letter, X, A, F or X24, is a lessons' variable), but RESULT, which
    the experiment makes."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    names = [name for target in targets for name in (target.elts if isinstance(target, ast.Tuple) else [target])]
    return bool(names) and all(isinstance(name, ast.Name) and sum(map(str.isalpha, name.id)) > 1
                               and name.id.isupper() and name.id != "RESULT" for name in names)


def select(paths, only):
    """Keep the lessons whose number is in `only` ("01,03" or ["01", "3"]); None keeps all."""
    if only is None:
        return list(paths)
    parts = only.split(",") if isinstance(only, str) else only
    wanted = {str(part).strip().zfill(2) for part in parts if str(part).strip()}
    numbers = sorted({path.name[:2] for path in paths})
    unknown = sorted(wanted - set(numbers))
    if unknown or not wanted:
        raise ValueError(f"--only {only!r}: there is no lesson {', '.join(unknown) or '(none given)'}; the lessons "
                         f"are {', '.join(numbers)} (`python -m picockpt reproduce --list` names them)")
    return [path for path in paths if path.name[:2] in wanted]


def rank_device(device, ranks):
    """Where a lesson's `ranks`-process part runs, and the line that says so (None: where asked).
    NCCL takes one GPU per rank: with fewer GPUs than ranks (torch.cuda.device_count()), the part runs
    on the CPU over gloo, with the same bytes, FLOPs and exactness; only its timings are the CPU's."""
    device = torch.device(device)
    if device.type != "cuda":
        return device, None
    gpus = torch.cuda.device_count()
    if gpus >= ranks:
        return device, None
    return torch.device("cpu"), (f"{ranks} ranks need {ranks} GPUs (NCCL: one per rank) and this machine has "
                                 f"{gpus}: the {ranks}-rank part runs on the CPU over gloo (same bytes, FLOPs and "
                                 f"checks; CPU timings)")


def checks():
    """Every exercise checked in this process so far (lessons/_check.py's CHECKS; [] before any)."""
    return list(getattr(sys.modules.get("_check"), "CHECKS", []))


def run_lesson(path, argv, verbose=False):
    """Run one lesson (its cells, a script's main(argv), or a notebook); returns a result dict with its
    time, figures, summary and exercises (the checks it made: question -> right)."""
    import matplotlib
    matplotlib.use("Agg")  # before any lesson imports pyplot: no window, only files
    import matplotlib.pyplot as plt
    path = pathlib.Path(path)
    output = io.StringIO()
    sink = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(output)
    start, started_at, checked = time.perf_counter(), time.time(), len(checks())
    result = {"lesson": path.name, "figures": [], "summary": {}, "exercises": {}, "error": None}
    try:
        with sink:
            if kind(path) == "notebook":
                cells_run = sum(1 for cell in run_notebook(path).cells if cell.cell_type == "code")
                returned = {"figures": notebook_figures(path), "summary": {"code cells run": cells_run}}
            elif kind(path) == "percent":
                namespace = run_percent(path, argv)
                if not isinstance(namespace.get("RESULT"), dict):
                    raise ValueError(f"{path.name} defines no RESULT dict: its last cell should be "
                                     f"RESULT = {{'figures': [...], 'summary': {{...}}}}")
                returned = namespace["RESULT"]
            else:
                returned = load(path).main(list(argv)) or {}
        result["figures"] = [str(p) for p in returned.get("figures", [])]
        result["summary"] = dict(returned.get("summary", {}))
        result["exercises"] = {c.question: c.right for c in checks()[checked:]}
        if result["exercises"]:
            right = sum(result["exercises"].values())
            result["summary"]["exercises right"] = f"{right} of {len(result['exercises'])}"
        stale = [p for p in result["figures"] if not _written_since(p, started_at)]
        if stale:
            result["error"] = f"figure(s) not written by this run: {', '.join(stale)}"
    except (Exception, SystemExit) as error:  # a broken lesson must not stop the others
        result["error"] = f"{type(error).__name__}: {_last_line(str(error))}"
        print(output.getvalue(), end="")
        traceback.print_exc()
    finally:
        plt.close("all")
    result["seconds"] = time.perf_counter() - start
    return result


def _say(line):
    print(line, flush=True)  # progress shows at once, even through a pipe


def reproduce(device="auto", fast=False, only=None, threads=None, verbose=False, log=_say):
    """Run the lessons (all, or those in `only`) on `device`; returns one result dict per lesson."""
    device = resolve_device(device)
    paths = select(discover(), only)
    if not paths:
        raise ValueError(f"no lessons found in {LESSONS} (expected files named NN_name.py)")
    argv = ["--device", str(device)] + (["--fast"] if fast else []) + \
        (["--threads", str(threads)] if threads is not None else [])
    count = threads or 1  # the lessons' default on the CPU
    where = f"cpu, {count} thread{'s' if count > 1 else ''}" if device.type == "cpu" else str(device)
    # a fast run: $PICOCKPT_FIGURES = out/figures/ unless it is set, for the scripts and the notebooks' kernels
    with environ("PICOCKPT_FIGURES", str(FAST_FIGURES) if fast and not os.environ.get("PICOCKPT_FIGURES") else None):
        folder = check_writable(figures_dir())  # once, before any lesson has run
        log(f"reproducing {len(paths)} lesson(s) on {where}{', fast shapes' if fast else ''}; figures go to {folder}"
            + (" (fast figures never replace the committed ones in figures/)" if fast else ""))
        results, start = [], time.perf_counter()
        for index, path in enumerate(paths, 1):
            log(f"[{index}/{len(paths)}] {path.name} ...")
            try:
                result = run_lesson(path, argv, verbose)
            except KeyboardInterrupt:
                log(f"[{index}/{len(paths)}] {path.name}  interrupted; "
                    f"{index - 1} of {len(paths)} lessons had finished")
                raise
            status = "FAILED: " + result["error"] if result["error"] else f"{len(result['figures'])} figure(s)"
            log(f"[{index}/{len(paths)}] {path.name}  {result['seconds']:.1f} s  {status}")
            results.append(result)
    log("")
    log(results_table(results))
    failed = sum(1 for r in results if r["error"])
    log(f"\n{len(results) - failed} of {len(results)} lessons done in {time.perf_counter() - start:.1f} s"
        + (f"; {failed} failed" if failed else ""))
    return results


def results_table(results):
    """One block per lesson: its name and time, then its summary, one 'key: value' per line."""
    width = max(len(r["lesson"]) for r in results)
    lines = [f"{'lesson':<{width}}  {'time':>8}  results", "-" * (width + 40)]
    for r in results:
        items = [f"ERROR {r['error']}"] if r["error"] else [f"{k}: {_show(v)}" for k, v in r["summary"].items()]
        items = items or ["-"]
        lines.append(f"{r['lesson']:<{width}}  {r['seconds']:>6.1f} s  {items[0]}")
        lines += [f"{'':<{width}}  {'':>8}  {item}" for item in items[1:]]
    return "\n".join(lines)


def _written_since(path, started_at):
    path = pathlib.Path(path)
    return path.is_file() and path.stat().st_mtime >= started_at - 1  # 1 s: coarse file system clocks


def _last_line(text):
    """The last non-empty line of an error message, without terminal colour codes."""
    lines = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _show(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_show(v) for v in value)
    return str(value)

"""Every lesson's experiment, in reading order: all of figures/ and a short results table.

    results = reproduce(device="auto", fast=False, only=None)    # python -m picockpt reproduce

Lessons are the files lessons/NN_name.py and lessons/NN_name.ipynb (NN: two digits), run in
the order of their names, so a new one is picked up by its file name alone.

  - a script has main(argv): it takes the lesson flags (--fast, --large, --device, --seed,
    --threads), writes its figures with plotting.save_figure and returns
    {"figures": [paths], "summary": {short key: value}}. It is imported by file path.
  - a notebook is executed top to bottom (nbclient), in lessons/ as its working directory; its
    figures are the names it passes to save_figure. Notebooks choose their own (small) shapes
    and device, so --fast and --device do not change them.

Each lesson's own output is captured (shown with verbose=True, or when it fails); one line of
progress per lesson, then the table of every summary. A --fast run writes its figures to
out/figures/ (plotting.FAST_FIGURES), never over the committed ones, unless $PICOCKPT_FIGURES
says where. Ctrl-C stops the whole run (KeyboardInterrupt; the command exits with 130): in a
notebook it interrupts the running cell, as Jupyter's stop button does.
"""
import ast
import asyncio
import contextlib
import importlib.util
import io
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import traceback

from .device import resolve_device
from .plotting import FAST_FIGURES, REPO, check_writable, figures_dir

LESSONS = REPO / "lessons"


CELL_TIMEOUT_S = 600  # a notebook cell that runs longer than this is stuck


def discover(folder=None, kinds=(".py", ".ipynb")):
    """The lessons, in reading order: lessons/[0-9][0-9]_*.py and *.ipynb, sorted by name."""
    return sorted(path for path in pathlib.Path(folder or LESSONS).glob("[0-9][0-9]_*") if path.suffix in kinds)


def title(path):
    """A lesson's first line: the script's docstring or the notebook's first heading."""
    path = pathlib.Path(path)
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        text = next(("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"), "")
        return text.strip().split("\n", 1)[0].lstrip("# ")
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return doc.split("\n", 1)[0]


def notebook_figures(path):
    """The figure names a notebook passes to save_figure(fig, "name"), as paths in figures_dir()."""
    cells = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return [figures_dir() / f"{name}.png" for name in re.findall(r"save_figure\([^,]+,\s*[\"']([^\"']+)[\"']", code)]


def run_notebook(path, cell_timeout=CELL_TIMEOUT_S):
    """Execute a notebook in lessons/ (not saved back); returns (figures it claims, code cells run).
    Ctrl-C raises KeyboardInterrupt here, once the running cell has stopped and the kernel is shut down."""
    import nbformat
    notebook = nbformat.read(str(path), as_version=4)
    client = _client_class()(notebook, timeout=cell_timeout, kernel_name="python3",
                             resources={"metadata": {"path": str(pathlib.Path(path).parent)}})
    try:
        client.execute(stderr=subprocess.DEVNULL)  # the kernel's log lines; cell errors still raise here
    except Exception as error:  # a cell's error arrives as CellExecutionError, with the kernel's ename
        if client.interrupted or getattr(error, "ename", None) == "KeyboardInterrupt":
            raise KeyboardInterrupt from None
        raise
    if client.interrupted:  # Ctrl-C while the last cell was finishing
        raise KeyboardInterrupt
    return notebook_figures(path), sum(1 for cell in notebook.cells if cell.cell_type == "code")


class _Interrupted(Exception):
    """Raised inside nbclient to stop before the next cell; run_notebook turns it into KeyboardInterrupt."""


def _client_class():
    """nbclient's NotebookClient, with Ctrl-C handled as in Jupyter. nbclient's own SIGINT handler
    shuts the kernel down under the running cell, and execute() then fails with an unrelated error
    (an AssertionError in its clean-up), which a caller cannot tell from a broken notebook."""
    from nbclient import NotebookClient
    from nbclient.util import ensure_async

    class InterruptibleClient(NotebookClient):
        interrupted = False

        async def async_start_new_kernel(self, **kwargs):
            with contextlib.suppress(RuntimeError, NotImplementedError):  # not the main thread; no signals
                asyncio.get_running_loop().add_signal_handler(signal.SIGINT, self._on_interrupt)  # replaces nbclient's
            await super().async_start_new_kernel(**kwargs)

        def _on_interrupt(self):
            if self.interrupted:  # a second Ctrl-C: stop waiting for the kernel at once
                raise KeyboardInterrupt
            self.interrupted = True
            if self.km is not None and self.km.has_kernel:  # the running cell raises KeyboardInterrupt
                asyncio.ensure_future(ensure_async(self.km.interrupt_kernel()))

        async def async_execute_cell(self, cell, *args, **kwargs):
            if self.interrupted:  # between cells: run no further
                raise _Interrupted
            return await super().async_execute_cell(cell, *args, **kwargs)

    return InterruptibleClient


def load(path):
    """Import a lesson script by its path (lessons/ is not a package; names start with digits)."""
    path = pathlib.Path(path)
    name = f"lesson_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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
                         f"are {', '.join(numbers)} (see --list)")
    return [path for path in paths if path.name[:2] in wanted]


def run_lesson(path, argv, verbose=False):
    """Run one lesson (a script's main(argv), or a notebook); returns a result dict with its
    time, figures and summary."""
    import matplotlib
    matplotlib.use("Agg")  # before any lesson imports pyplot: no window, only files
    import matplotlib.pyplot as plt
    output = io.StringIO()
    sink = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(output)
    start, started_at = time.perf_counter(), time.time()
    result = {"lesson": path.name, "figures": [], "summary": {}, "error": None}
    try:
        with sink:
            if path.suffix == ".ipynb":
                figures, cells = run_notebook(path)
                returned = {"figures": figures, "summary": {"code cells run": cells}}
            else:
                returned = load(path).main(list(argv)) or {}
        result["figures"] = [str(p) for p in returned.get("figures", [])]
        result["summary"] = dict(returned.get("summary", {}))
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
        raise ValueError(f"no lesson scripts found in {LESSONS} (expected files named NN_name.py)")
    argv = ["--device", str(device)] + (["--fast"] if fast else []) + \
        (["--threads", str(threads)] if threads is not None else [])
    count = threads or 1  # the lessons' default on the CPU
    where = f"cpu, {count} thread{'s' if count > 1 else ''}" if device.type == "cpu" else str(device)
    with _fast_figures(fast):
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


@contextlib.contextmanager
def _fast_figures(fast):
    """During a fast run, $PICOCKPT_FIGURES = out/figures/ unless it is set: the scripts run here and
    the notebooks' kernels (which inherit the environment) then all write there."""
    if not fast or os.environ.get("PICOCKPT_FIGURES"):
        yield
        return
    os.environ["PICOCKPT_FIGURES"] = str(FAST_FIGURES)
    try:
        yield
    finally:
        del os.environ["PICOCKPT_FIGURES"]


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

"""A lesson is one source: a percent-format Python file, and the notebook made from it.

lessons/NN_name.py is written in the "percent" format that Jupytext, VS Code, PyCharm and Spyder
all read as cells (Jupytext's py:percent reader finds the very cells cells() does in every lesson,
so `jupytext --to notebook` works too). A line `# %%` starts a code cell; `# %% [markdown]` starts
a markdown cell, every line of which is a comment whose '# ' is taken off:

    # %% [markdown]
    # # Lesson 02: the anatomy of one training step
    #
    # One AdamW step of the `small` model, watched tensor by tensor.

    # %%
    args = lesson_args()          # the lesson's flags: the command line's, or $PICOCKPT_LESSON_ARGS's

The file runs as it is (`python lessons/02_anatomy_of_a_step.py --fast`), and lessons/NN_name.ipynb is made from it,
never edited by hand: `python -m picockpt notebooks` turns each source into its notebook (cells(), notebook()), executes
it in a Jupyter kernel (execute()) and writes it with its outputs, so that it reads on a code-hosting site.
differences() is what the tests hold the committed notebooks to: the same cells, in the same order, as their sources.

    cells("lessons/02_anatomy_of_a_step.py")          # [Cell("markdown", "# Lesson 02: ..."), Cell("code", ...)]
    book = execute(notebook(cells(path)), LESSONS, lesson_args="--fast")
    differences(path, path.with_suffix(".ipynb"))      # [] when the committed notebook follows its source

A notebook whose source is not in this format (a lesson written as a notebook alone) still runs:
run_notebook() executes it as it is.
"""
import asyncio
import contextlib
import pathlib
import re
import signal
import subprocess
import time
from dataclasses import dataclass

from .plotting import environ, write_whole

MARKER = re.compile(r"# %%(?P<rest>.*)")
ARGS_VARIABLE = "PICOCKPT_LESSON_ARGS"  # a notebook kernel's lesson flags (its own argv is the kernel's)
CELL_TIMEOUT_S = 600  # a notebook cell that runs longer than this is stuck
KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}


@dataclass(frozen=True)
class Cell:
    kind: str    # "code" or "markdown"
    source: str  # the cell's text, without leading or trailing blank lines


def is_percent(path):
    """Is this file a percent-format lesson (a line that starts a cell)?"""
    path = pathlib.Path(path)
    return path.suffix == ".py" and any(MARKER.fullmatch(line.rstrip())
                                        for line in path.read_text(encoding="utf-8").splitlines())


def cells(path):
    """The cells of a percent-format file, in order. Every non-blank line belongs to a cell, and every
    line of a markdown cell is a comment: anything else is a ValueError naming the file and the line."""
    path = pathlib.Path(path)
    found, kind, lines, start = [], None, [], 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        marker = MARKER.fullmatch(line.rstrip())
        if marker:
            _close(found, kind, lines)
            kind, lines, start = _kind(marker.group("rest").strip(), path, number), [], number
            continue
        if kind is None and line.strip():
            raise ValueError(f"{path}:{number}: text before the first cell; start the file with '# %%' "
                             f"or '# %% [markdown]'")
        if kind == "markdown" and line.strip() and not (line == "#" or line.startswith("# ")):
            raise ValueError(f"{path}:{number}: a markdown cell (from line {start}) holds a line that is not a "
                             f"comment: write every markdown line as '# text' (or '#' alone), or start a code "
                             f"cell with '# %%' before it")
        lines.append(line[2:] if kind == "markdown" and line.startswith("# ") else
                     "" if kind == "markdown" else line)
    _close(found, kind, lines)
    return found


def _kind(rest, path, number):
    if rest == "":
        return "code"
    if rest == "[markdown]":
        return "markdown"
    raise ValueError(f"{path}:{number}: '# %%{' ' if not rest.startswith(' ') else ''}{rest}' is not a cell "
                     f"marker picockpt reads: use '# %%' (code) or '# %% [markdown]'")


def _close(found, kind, lines):
    """Add the cell being read, without its blank first and last lines (a blank line separates cells)."""
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    if kind is not None:
        found.append(Cell(kind, "\n".join(lines)))


def notebook(found):
    """An nbformat 4.5 notebook of these cells, no outputs: ids and metadata fixed, so that writing the
    same cells twice gives the same file."""
    import nbformat
    book = nbformat.v4.new_notebook()
    book.metadata = {"kernelspec": dict(KERNEL), "language_info": {"name": "python"}}
    for index, cell in enumerate(found):
        make = nbformat.v4.new_code_cell if cell.kind == "code" else nbformat.v4.new_markdown_cell
        book.cells.append(make(cell.source, id=f"cell-{index:03d}"))
    return book


def notebook_cells(path):
    """The cells of a notebook file, as Cells."""
    import nbformat
    book = nbformat.read(str(path), as_version=4)
    return [Cell(cell.cell_type, cell.source) for cell in book.cells]


def differences(source, committed):
    """What differs between a lesson's source and its committed notebook, one line each ([] = none)."""
    mine, theirs = cells(source), notebook_cells(committed)
    lines = [f"cell {i} ({a.kind} in the source, {b.kind} in the notebook) differs, from line "
             f"{_first_difference(a.source, b.source)} of the cell"
             for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
    if len(mine) != len(theirs):
        lines.append(f"the source has {len(mine)} cells, the notebook {len(theirs)}")
    return lines


def _first_difference(a, b):
    a_lines, b_lines = a.split("\n"), b.split("\n")
    differing = (i + 1 for i, (x, y) in enumerate(zip(a_lines, b_lines)) if x != y)
    return next(differing, min(len(a_lines), len(b_lines)) + 1)


def write(book, path):
    """Write a notebook (nbformat's JSON, one space indent, as Jupyter saves it)."""
    import nbformat
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_whole(path, lambda temporary: nbformat.write(book, str(temporary)))


def execute(book, folder, lesson_args="", cell_timeout=CELL_TIMEOUT_S, then=None):
    """Run every cell of `book` in a fresh Python kernel whose working directory is `folder`, with
    $PICOCKPT_LESSON_ARGS = lesson_args; the outputs go into the cells. A cell's error raises
    nbclient's CellExecutionError; Ctrl-C raises KeyboardInterrupt once the running cell has stopped.
    then: code run after the last cell in the same kernel, whose printed text is returned (the tests
    read a lesson's RESULT this way); it does not stay in the notebook. Returns (book, that text)."""
    import nbformat
    if then is not None:
        book.cells.append(nbformat.v4.new_code_cell(then, id="after-the-lesson"))
    client = _client_class()(book, timeout=cell_timeout, kernel_name="python3", record_timing=False,
                             resources={"metadata": {"path": str(folder)}})
    try:
        with environ(ARGS_VARIABLE, lesson_args):  # the kernel inherits the environment
            client.execute(stderr=subprocess.DEVNULL)  # the kernel's own log lines; cell errors still raise
    except Exception as error:  # a cell's error arrives as CellExecutionError, with the kernel's ename
        if client.interrupted or getattr(error, "ename", None) == "KeyboardInterrupt":
            raise KeyboardInterrupt from None
        raise
    finally:
        extra = book.cells.pop() if then is not None else None
    if client.interrupted:  # Ctrl-C while the last cell was finishing
        raise KeyboardInterrupt
    printed = "".join(output.get("text", "") for output in extra.outputs if output.output_type == "stream") \
        if extra is not None else None
    book.metadata["kernelspec"] = dict(KERNEL)
    return book, printed


def run_notebook(path):
    """Execute a notebook file as it is, in its own folder (not saved back); returns the executed notebook."""
    import nbformat
    path = pathlib.Path(path)
    return execute(nbformat.read(str(path), as_version=4), path.parent)[0]


def build(source, execute_cells=True, lesson_args="", out=None):
    """Make the notebook of a percent-format source, execute it (unless execute_cells is False) and write
    it beside the source (or into the folder `out`). Returns (path written, seconds)."""
    source, start = pathlib.Path(source), time.perf_counter()
    book = notebook(cells(source))
    if execute_cells:
        book = execute(book, source.parent, lesson_args)[0]
    path = write(book, pathlib.Path(out or source.parent) / f"{source.stem}.ipynb")
    return path, time.perf_counter() - start


class _Interrupted(Exception):
    """Raised inside nbclient to stop before the next cell; execute() turns it into KeyboardInterrupt."""


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

"""What the numbered lessons share: their flags, the shape each run mode uses, and interleaved timing.

A lesson is one file, lessons/NN_name.py, in the percent format (picockpt/teaching/notebooks.py): `# %%` starts
a code cell, `# %% [markdown]` a markdown cell whose lines are comments. The same file runs three ways:

    python lessons/08_the_price.py --fast          a script: the flags from its command line
    python -m picockpt reproduce --only 08         the same, run in this process (runpy) for every lesson
    lessons/08_the_price.ipynb in Jupyter          a notebook made from it (python -m picockpt notebooks):
                                                   the flags from $PICOCKPT_LESSON_ARGS, e.g. "--fast"

Its first code cell imports from this module by its bare name (lessons/ is the script's folder, and
a notebook kernel's working directory), which also puts the repository root on sys.path and, outside
a notebook, selects matplotlib's file-only backend:

    from _lesson import lesson_args, choose, small
    args = lesson_args()                 # args.mode is "fast", "cpu" or "large"; args.device a torch.device

and its last cell defines RESULT = {"figures": [paths], "summary": {short key: value}}, which
`reproduce` collects. Exercises call lessons/_check.py's check().

Every lesson takes the same flags:

    (nothing)        the CPU run: the `small` preset or a shape of the same cost, under a minute
    --fast           a few seconds: the shape the tests run (figures to out/figures/, not figures/)
    --large          a bigger shape for a GPU (use with --device cuda)
    --device auto    auto | cpu | cuda | cuda:N (auto takes CUDA when there is one)
    --seed 0         weights, data and dropout masks
    --threads 1      CPU threads for torch (default 1 on the CPU). The CPU shapes are small, so
                     more threads gain little, and on a busy machine torch's worker threads wait
                     on each other whenever another program holds a core: a step can take 10x
                     longer. --threads N asks for N.

Timings are Spreads (median [min..max] over interleaved repeats), never a single sample; at
--fast the lessons print FAST_TIMING instead of any conclusion drawn from a time. A lesson that
concludes from a time ratio first asks timed_claim(mode, ratio, what, expect, work): the sentence
that draws the conclusion is printed only when the claim is conclusive (every repeat on the side
of 1 the claim expects); otherwise the lesson prints that the timing was inconclusive on this
machine, with the exact work ratio (FLOPs or bytes) in its place. On the CPU with one torch thread a
lesson may time with clock=compute_clock(device), the CPU time of this thread, which leaves out the
moments a shared machine gives the core to another program (not what the caches lose to it).

Turning a lesson written in the older script format (a docstring and main(argv) returning
{"figures", "summary"}) into this one takes the same steps for every lesson:

  1. The module docstring becomes the first cell, `# %% [markdown]`, every line prefixed with '# ':
     its first line as a heading, `# # Lesson NN: ...`; the usage lines go under "Run it". Prose
     that main() prints without any measured number moves into markdown cells too.
  2. The imports become the first code cell, `# %%`: `from lessons._lesson import ...` becomes
     `from _lesson import ...`, listed before any other picockpt import; the sys.path line and
     matplotlib.use("Agg") go (_lesson does both).
  3. Constants and functions stay as they are, one or a few per code cell, each under a markdown
     cell that says what it is for. Tests keep calling them: picockpt.teaching.reproduce.load(path) runs only
     a lesson's imports, definitions and UPPER_CASE constants.
  4. main()'s body becomes top-level cells, in order: `args = parse_args(__doc__, argv)` becomes
     `args = lesson_args()`; each measurement with the table it prints in one cell; each figure in
     its own cell (it shows in the notebook; save_figure still writes it); `return {...}` becomes
     the last cell, `RESULT = {...}`. The `if __name__ == "__main__": main()` lines go.
     A lesson that starts processes (spawn or forkserver: ranks) starts them inside
     `with spawning_ranks():`, or each new process would run the lesson's cells again.
  5. Add two or three exercises before RESULT: a markdown cell with the question, a code cell
     `answer = ...` the learner fills in, and check(question, answer, expected, why) with the
     expected value computed by picockpt's code on a shape that does not depend on --fast.
  6. `python -m picockpt notebooks --only NN` writes the executed notebook beside it.

A script still in the older format runs as before (reproduce calls its main(argv)); parse_args
and the helpers below serve both.
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root: picockpt, no install

import argparse
import contextlib
import os
import shlex
import signal
import threading

import matplotlib
import torch

from picockpt.device import exit_if_torch_too_old, resolve_device

exit_if_torch_too_old()  # before the imports below, which a torch under the floor may lack: one line, no traceback

from _timing import (FAST_TIMING, Claim, Spread, clock_words, compute_clock, interleaved_seconds,  # noqa: F401
                     paired_ratios, timed_claim, timing_verdict)  # the lessons' timing, re-exported from here
from picockpt.cli import Parser
from picockpt.model.config import Config
from picockpt.teaching.notebooks import ARGS_VARIABLE, cells
from picockpt.ops.attention_fused import check_fused
from picockpt.model.params import check_seed
from picockpt.teaching.plotting import FAST_FIGURES, check_writable, figures_dir
from picockpt.teaching.reproduce import rank_device


# the --large shape: a 1B-parameter-class Llama layer stack (h=2048, GQA 16/4, SwiGLU 5632), fp32
LARGE = dict(vocab=32000, hidden=2048, layers=16, heads=16, kv_heads=4, ffn=5632, max_seq=4096)


def in_notebook():
    """True inside a Jupyter kernel, whose sys.argv is the kernel's own, not the lesson's flags."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


if not in_notebook():
    matplotlib.use("Agg")  # a script or reproduce: figures are files (a notebook shows them inline)


def lesson_args():
    """The lesson flags (parse_args): from the command line when the lesson runs as a script (or
    from reproduce), from $PICOCKPT_LESSON_ARGS in a notebook kernel (none: the CPU run)."""
    if in_notebook():
        words = os.environ.get(ARGS_VARIABLE, "")
        try:
            argv = shlex.split(words)
        except ValueError as error:  # e.g. an unbalanced quote: name the variable, not shlex
            raise ValueError(f"${ARGS_VARIABLE}={words!r} cannot be split into flags ({error}): close the quote, "
                             f"e.g. {ARGS_VARIABLE}='--fast --seed 1'") from None
        return parse_args(f"a picockpt lesson (${ARGS_VARIABLE}={words!r})", argv, notebook=True)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `... | head -1`: end quietly when the reader goes, as shell tools do
    path = pathlib.Path(sys.argv[0])
    usage = "\n".join(f"    python lessons/{path.name}{flags:<24}{what}" for flags, what in (
        ("", "the CPU run"), (" --fast", "seconds: what the tests run"),
        (" --large --device cuda", "a bigger shape for a GPU")))
    return parse_args(f"{lesson_title(path)}\n\n{usage}", sys.argv[1:])


def wrote(path):
    """Say where a figure went: the full path from a script, the path in the repository in a notebook."""
    path = pathlib.Path(path)
    root = pathlib.Path(__file__).resolve().parents[1]
    shown = path.relative_to(root) if in_notebook() and path.is_relative_to(root) else path
    print(f"wrote {shown}")


@contextlib.contextmanager
def spawning_ranks():
    """Start processes (spawn or forkserver) from a lesson inside this. Such a process first imports the
    parent's __main__ again from its file, which for a lesson run as a script would run the whole lesson
    again; ranks need only picockpt's functions, so the file is hidden from them while they start. (An
    older script kept main() under `if __name__ == "__main__"`; a lesson's cells cannot.)"""
    main = sys.modules["__main__"]
    path = main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        if path is not None:
            main.__file__ = path


def ranks_device(device, ranks):
    """The device for a part of a lesson that runs on `ranks` processes: `device`, or the CPU (gloo)
    when it is CUDA with fewer GPUs than ranks, said in one line (picockpt.teaching.reproduce.rank_device)."""
    chosen, note = rank_device(device, ranks)
    if note:
        print(note)
    return chosen


def lesson_title(path):
    """The first line of a lesson's first markdown cell, without its '#' marks."""
    try:
        text = next(cell.source for cell in cells(path) if cell.kind == "markdown")
    except (OSError, ValueError, StopIteration):
        return f"picockpt lesson {pathlib.Path(path).name}"
    return text.strip().split("\n", 1)[0].lstrip("# ")


class _NotebookParser(argparse.ArgumentParser):
    """In a notebook a bad flag is a ValueError naming the variable, not an exit of the kernel."""

    def error(self, message):
        raise ValueError(f"${ARGS_VARIABLE}: {message} (the flags are {NOTEBOOK_FLAGS})")

    def print_help(self, file=None):  # --help: a kernel must not exit; exit() below says it in one line
        pass

    def exit(self, status=0, message=None):
        raise ValueError(f"${ARGS_VARIABLE} asks for --help, which a notebook cannot show: the flags are "
                         f"{NOTEBOOK_FLAGS}; run `python lessons/NN_name.py --help` for the whole text")


NOTEBOOK_FLAGS = "--fast, --large, --device, --seed, --threads"


def parse_args(doc, argv=None, notebook=False):
    """The lesson flags. args.mode is "fast", "cpu" or "large"; args.device a torch.device."""
    title, _, usage = doc.partition("\n")
    parser = (_NotebookParser if notebook else Parser)(  # Parser: a mistake is one line, as the main CLI says it
        description=title, epilog=usage, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--fast", action="store_true", help="a small shape that runs in seconds (what the tests run)")
    size.add_argument("--large", action="store_true", help="a bigger shape, meant for a GPU")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights, data and dropout (default 0)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1)")
    args = parser.parse_args(argv)
    try:
        args.device = resolve_device(args.device)
    except ValueError as error:  # e.g. --device cuda on a machine without one: one line, no traceback
        parser.error(str(error))
    if args.threads < 1:
        parser.error(f"--threads={args.threads}: use 1 or more")
    try:
        check_seed(args.seed, "--seed")
        check_writable(figures_dir(args.fast))  # before any work, not when the first figure is saved
    except ValueError as error:
        parser.error(str(error))
    if args.device.type == "cpu":
        torch.set_num_threads(args.threads)
    args.mode = "large" if args.large else "fast" if args.fast else "cpu"
    if args.fast and not os.environ.get("PICOCKPT_FIGURES"):  # small figures never replace the committed ones
        os.environ["PICOCKPT_FIGURES"] = str(FAST_FIGURES)
        print(f"--fast: figures go to {FAST_FIGURES}")
    return args


def choose(mode, fast, cpu, large):
    """The value for this run mode ("fast", "cpu" or "large"): choose(args.mode, fast=.., cpu=.., large=..)."""
    return {"fast": fast, "cpu": cpu, "large": large}[mode]


def small(**overrides):
    """The `small` preset (L=8, h=128, H=4, KV=2, f=448, V=256) with some fields changed."""
    return Config.from_preset("small", **overrides)


def large(**overrides):
    return Config(**{**LARGE, **overrides})


def dtype_for_device(cfg, device, attentions=None):
    """cfg, or cfg computing in bf16 where an attention kind the lesson runs it with (`attentions`, default
    (cfg.attention,)) refuses cfg.dtype on `device`, said in one line: on CUDA `fused` runs the flash kernel,
    16-bit only. Every kind takes bf16, so kinds compared in one run stay alike; on the CPU every kind takes
    every dtype, and cfg comes back as it is. A head dimension the kernel cannot take is refused by name."""
    if "fused" not in (attentions or (cfg.attention,)):
        return cfg
    try:
        check_fused(device, cfg.torch_dtype)
    except ValueError:
        print(f"fused attention on {torch.device(device).type} runs the flash kernel, which takes bf16 or fp16: "
              f"this run computes in bfloat16 where the CPU run takes {cfg.dtype}")
        cfg = cfg.replace(dtype="bfloat16")
    check_fused(device, cfg.torch_dtype, cfg.head_dim)
    return cfg


def device_name(device):
    """'cpu (2 threads)' or 'cuda:0 (NVIDIA H100 ...)': what a timing was measured on."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads > 1 else ''})"


def shape_line(cfg, batch, seq, device):
    return (f"L={cfg.layers} h={cfg.hidden} H={cfg.heads} KV={cfg.kv_heads} f={cfg.ffn} V={cfg.vocab} "
            f"{cfg.dtype}, batch {batch} x {seq} tokens, on {device_name(device)}")


def callouts(ax, items, x, fontsize=6):
    """Name crowded points from a column of labels at data abscissa x, each tied to its point by a
    thin line: items are (text, (point x, point y), colour). Each label starts level with its point;
    going up, a label that would touch the one below moves up just enough, and the column moves
    down as a whole if it would leave the axes. Call once the axes have their final limits and
    size (after tight_layout)."""
    if not items:
        return
    to_display, gap = ax.transData.transform, fontsize * 1.35 * ax.figure.dpi / 72  # one line of text, pixels
    items = sorted(items, key=lambda item: to_display(item[1])[1])
    heights = []
    for _, point, _ in items:
        level = to_display(point)[1]
        heights.append(max(level, heights[-1] + gap) if heights else level)
    top = ax.get_window_extent().y1 - gap / 2
    if heights[-1] > top:
        heights = [height - (heights[-1] - top) for height in heights]
    from_display = ax.transData.inverted().transform
    for (text, point, color), height in zip(items, heights):
        y = from_display((to_display((x, 0))[0], height))[1]
        ax.annotate(text, point, xytext=(x, y), textcoords="data", fontsize=fontsize, color=color, va="center",
                    arrowprops=dict(arrowstyle="-", lw=0.3, color="0.6", shrinkA=1, shrinkB=3))

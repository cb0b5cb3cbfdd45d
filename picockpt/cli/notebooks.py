"""python -m picockpt notebooks: each lesson's notebook, made from its source and executed.

    python -m picockpt notebooks                  # lessons/NN_name.ipynb from lessons/NN_name.py, run on the CPU
    python -m picockpt notebooks --only 01,05     # some of them
    python -m picockpt notebooks --check          # which committed notebooks differ from their sources (exit 1)
    python -m picockpt notebooks --no-execute     # the cells only, no outputs: seconds
    python -m picockpt notebooks --fast           # fast shapes, into out/notebooks/ (never over the committed ones)

A lesson's source is its percent-format .py file (picockpt/teaching/notebooks.py); its notebook is never edited by hand.
Executing a notebook runs its lesson at the shapes its flags choose (the CPU run unless --fast), so it also rewrites the
lesson's figures (figures/, or $PICOCKPT_FIGURES). A notebook whose lesson fails is left as it was.
"""
from ..teaching.notebooks import build, differences, is_percent
from ..teaching.plotting import REPO
from ..teaching.reproduce import discover, select
from .common import add_lesson_args, check_threads


def add_arguments(parser):
    add_lesson_args(parser, "cpu", ("only these lessons, by number (e.g. 01,03)",
                                    "the lessons' --device (default cpu: the committed notebooks are CPU runs)",
                                    "the lessons' --threads (default 1)"))
    parser.add_argument("--check", action="store_true",
                        help="write nothing: list the committed notebooks whose cells differ from their sources "
                             "and exit 1 if there is one")
    parser.add_argument("--no-execute", action="store_true", help="write the cells without running them")
    parser.add_argument("--fast", action="store_true",
                        help="run the fast shapes and write to out/notebooks/, never over the committed notebooks")


def run(args):
    check_threads(args)
    sources = [path for path in select(discover(kinds=(".py",)), args.only) if is_percent(path)]
    if not sources:
        raise ValueError(f"--only {args.only!r}: none of those lessons is written in the percent format yet")
    if args.check:
        stale = 0
        for source in sources:
            committed = source.with_suffix(".ipynb")
            found = differences(source, committed) if committed.is_file() else ["there is no notebook"]
            stale += bool(found)
            print(f"{committed.name:<46} " + ("; ".join(found) if found else "follows its source"))
        return 1 if stale else 0
    lesson_args = " ".join(["--fast"] * args.fast + ["--device", args.device, "--threads", str(args.threads)])
    out = REPO / "out" / "notebooks" if args.fast else None
    failed = 0
    for index, source in enumerate(sources, 1):
        print(f"[{index}/{len(sources)}] {source.stem}.ipynb ...", flush=True)
        try:
            path, seconds = build(source, not args.no_execute, lesson_args, out)
        except Exception as error:  # a cell's error: this notebook stays as it was, the others go on
            failed += 1
            message = [line for line in str(error).splitlines() if line.strip()]
            print(f"[{index}/{len(sources)}] {source.stem}.ipynb  FAILED: {message[-1] if message else error}",
                  flush=True)
            continue
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        print(f"[{index}/{len(sources)}] {shown}  {seconds:.1f} s", flush=True)
    print(f"{len(sources) - failed} of {len(sources)} notebooks written" + (f"; {failed} failed" if failed else ""))
    return 1 if failed else 0

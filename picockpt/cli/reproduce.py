"""python -m picockpt reproduce: every lesson's experiment, all of figures/, one results table."""
from ..teaching.reproduce import discover, reproduce, select, title
from .common import add_lesson_args, check_threads


def add_arguments(parser):
    add_lesson_args(parser, "auto", ("run only these lessons, by number (e.g. 01,03)",
                                     "auto (CUDA when present), cpu, cuda or cuda:N",
                                     "CPU threads for torch (default 1: the CPU shapes are small, and one thread keeps "
                                     "timings steady on a busy machine)"))
    parser.add_argument("--fast", action="store_true",
                        help="the small shapes the tests use: seconds per lesson. Figures go to out/figures/ "
                             "(or $PICOCKPT_FIGURES), never over the committed ones in figures/")
    parser.add_argument("--list", action="store_true", help="list the lessons and exit")
    parser.add_argument("--verbose", action="store_true", help="show every lesson's own output (its full tables)")


def run(args):
    check_threads(args)
    if args.list:
        for path in select(discover(), args.only):
            print(f"{path.name:<42} {title(path)}")
        return 0
    results = reproduce(args.device, args.fast, args.only, args.threads, args.verbose)
    return 1 if any(result["error"] for result in results) else 0

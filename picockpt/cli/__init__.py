"""python -m picockpt COMMAND [flags]   (python -m picockpt COMMAND --help for each)

Each command lives in its own module with add_arguments(parser) and run(args); only the command asked for is imported.
"""
import argparse
import importlib
import os
import re
import signal
import sys

from .flag_words import flags_of, in_flags

COMMANDS = {  # name -> one-line help; the module picockpt/cli/<name>.py does the work
    "reproduce": "run every lesson's experiment, regenerate figures/ and print the results table",
    "notebooks": "make each lesson's notebook from its source and execute it (--check: do they match?)",
    "train": "train on the synthetic task: loss, tokens/s, stored and live peaks, what recomputation costs",
    "measure": "one step under a policy: peak bytes (logical, physical), FLOPs, time, exactness",
    "compare": "picockpt's policies beside torch.utils.checkpoint and Hugging Face on the same shape",
    "inventory": "what one layer stores, by name, shape and bytes: closed form and measured",
    "predict": "activation memory by formula (Korthikanti et al.'s, picockpt's); --search: a cluster's layouts",
    "plan": "the optimal recomputation schedule for a memory budget (or a uniform chain)",
    "parallel": "one step over tp/sp, cp, pp, dp (ZeRO 1-3) or ep ranks: bytes, comm, FLOPs, each checked",
}

DESCRIPTION = """picockpt: activation recomputation (gradient checkpointing) written out by hand.
A "checkpoint" here is a stored activation, never a saved model file.

Policies (--policy): none | full | every:C | budget:SIZE, optionally +selective or +cheap; with experts
+moe_act or +moe, +shared_experts, +router; +recast (16-bit weight copies cast at each layer's use);
+offload or +offload:NAMES (stored tensors to host memory), e.g. every:4+selective+recast.
Attention (--attention): eager (stores the T x T probabilities) | tiled | fused (FlashAttention: store one
log-sum-exp per row and recompute the probabilities inside the op; `selective` has nothing left to drop).
Loss (--loss-chunk N): the LM head and loss N tokens at a time; the logits are recomputed in the backward.
Devices (--device): auto (CUDA when present, else CPU) | cpu | cuda | cuda:N.
Exit codes: 0 done; 2 a user mistake (one line naming the flag); 1 a rank of a multi-rank run failed, timed out or was
killed (one line naming the rank); 130 Ctrl-C; 143 SIGTERM; 141 a closed pipe (`| head`).

commands:
""" + "\n".join(f"  {name:<11}{text}" for name, text in COMMANDS.items())


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (as every other user mistake here), not the whole usage; a word that
    starts with a minus and a digit (-5MiB, -64K, -1e3), or is minus infinity (-inf, -Infinity), is a value, as argparse
    reads -5 and -0.5, never a flag, so the flag it follows refuses it in its own words (no flag here starts with a
    digit or "inf")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\.?\d|inf(inity)?$)", re.IGNORECASE)

    def error(self, message):
        self.exit(2, f"error: {message} (`{self.prog} --help` explains every flag)\n")


class RankFailed(Exception):
    """A rank of the command's run failed, timed out or died: not a user mistake (those are ValueErrors, exit code 2),
    said in one line, exit code 1."""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    top = Parser(prog="python -m picockpt", description=DESCRIPTION,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("command", nargs="?", choices=list(COMMANDS), metavar="COMMAND")
    command = next((word for word in argv if word in COMMANDS), None)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help") and command:
        flags = " ".join(argv[:argv.index(command)])  # e.g. --preset tiny measure: the flags belong to measure
        top.error(f"{flags!r} comes before the command: flags follow it, as in "
                  f"`python -m picockpt {command} {flags}`")
    if not argv or argv[0].startswith("-"):  # no command: the overview (or --help)
        top.parse_args(argv)
        top.print_help()
        return 2
    top.parse_args(argv[:1])  # a clear error for an unknown command
    name = argv[0]
    parser = Parser(prog=f"python -m picockpt {name}", description=COMMANDS[name])
    try:  # torch loads here, for seconds: before the command's imports, which a torch under the floor may lack
        importlib.import_module("..device", __name__).check_torch()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__name__}.{name}")
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    if signal.getsignal(signal.SIGINT) is exit_while_starting:  # from here on Ctrl-C is a KeyboardInterrupt
        signal.signal(signal.SIGINT, interrupt)
    try:
        return module.run(args) or 0
    except ValueError as error:  # a user mistake: say what and how to fix it, no traceback, in the user's flags
        print(f"error: {in_flags(str(error), flags_of(parser))}", file=sys.stderr)
        return 2
    except RankFailed as error:  # a rank failed or died: said as plainly, its own exit code
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: stop here, and say so; 130 = 128 + SIGINT, as shells report it
        print(f"interrupted: python -m picockpt {name} stopped before it finished", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly, as shell tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141  # 128 + SIGPIPE


INTERRUPTED = []  # the Ctrl-Cs that reached the running command (interrupt)


def interrupt(signum, frame):
    """Ctrl-C while the command runs: Python's KeyboardInterrupt, remembered for leave()."""
    INTERRUPTED.append(signum)
    raise KeyboardInterrupt


def leave(code):
    """End `python -m picockpt` with `code`. After a Ctrl-C, at once, the streams flushed: CPython (since
    bpo-1054041) ends a `python -m` process by SIGINT, whatever code it exits with, when a KeyboardInterrupt ever left
    an exec or eval of a string (as dataclasses and namedtuple make their classes), even one the command caught and
    answered with its one line and 130."""
    if INTERRUPTED:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more to say there
                pass
        os._exit(code)
    raise SystemExit(code)


def exit_while_starting(signum, frame):
    """Ctrl-C while the command is still importing: nothing to clean up yet, so one line and exit 130 at once. A
    KeyboardInterrupt raised inside an import can be swallowed by importlib's own callbacks (the command then goes
    on), or end in a traceback from inside torch; a handler that exits cannot."""
    os.write(sys.stderr.fileno(), b"interrupted: python -m picockpt stopped while it was starting\n")
    os._exit(130)

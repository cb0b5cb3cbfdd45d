"""`python -m picockpt ARGS` as the tests run it: in this process, where torch is already imported (a new
interpreter spends about three seconds importing it, and the command tests are many), with what it printed and its
exit code in a subprocess.CompletedProcess, as the command line gives them. What only a real process shows (Ctrl-C,
a closed pipe, startup itself) stays a subprocess in the tests that check it."""
import contextlib
import io
import os
import subprocess

import torch

from picockpt.cli import main


def picockpt(*args, check=False, env=None):
    """Runs the command; env: environment variables set for the call (e.g. {"OMP_NUM_THREADS": "1"} becomes one
    torch thread), restored after. check=True raises CalledProcessError on a non-zero exit, as subprocess does."""
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    with environment(env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if env and "OMP_NUM_THREADS" in env:
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's errors and --help
            code = exit_.code
        finally:
            torch.set_num_threads(threads)
    done = subprocess.CompletedProcess(["python", "-m", "picockpt", *args], code or 0, out.getvalue(), err.getvalue())
    if check:
        done.check_returncode()
    return done


@contextlib.contextmanager
def environment(values):
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

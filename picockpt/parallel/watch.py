"""The parent's side of spawned ranks: collect each rank's one message, find the first failure, stop the rest.

Each rank sends one last message down its pipe: ("ok", result) or ("error", when, type name, message, traceback,
is_value_error), after any number of ("progress", payload), each handed on as it arrives. One that dies without it
(os._exit, a signal, the OOM killer) shows as EOF and a fired sentinel. The first failure ends the wait; LINGER_S later
the root cause among all failures is raised (_error), each said plainly: a signal's death as the signal, a collective's
timeout as the rank and operation that waited longer than timeout_s, a script's missing main guard as a ValueError.
"""
import contextlib
import pickle
import re
import signal
import sys
import threading
import time
from multiprocessing.connection import wait

LINGER_S = 0.3  # after a first failure, how long to listen for the others (to find the root cause)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "gloo/transport")  # gloo's words
STOP_GRACE_S = 2.0  # how long a terminated rank may take before it is killed


class RankError(RuntimeError):
    """A rank failed; .rank, .type_name and .remote_traceback say where and how, .failed_at when (time.monotonic(), the
    same clock in every process of this machine)."""

    def __init__(self, message, rank=None, type_name=None, remote_traceback="", failed_at=None):
        super().__init__(message)
        self.rank, self.type_name, self.remote_traceback, self.failed_at = rank, type_name, remote_traceback, failed_at


class Terminated(BaseException):
    """SIGTERM reached the caller (sigterm_raises): a BaseException, as KeyboardInterrupt, so `finally` blocks run
    (run_ranks' stops every rank) and no `except Exception` swallows it."""


@contextlib.contextmanager
def sigterm_raises():
    """Within: SIGTERM raises Terminated in the main thread, once (a second ends the process; its ranks die with it).
    Left alone where SIGTERM is handled or ignored already, or off the main thread (signal handlers live there only)."""
    ours = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated("SIGTERM: the caller was terminated; every rank it had started was stopped")
    if ours:
        signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        if ours:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def collect(ranks, pipes, started, progress=None, timeout_s=None):
    """Each rank's result, by rank (the module's docstring says how failures end the wait). started[r] (a shared
    array) is set once rank r runs picockpt's code: a rank that dies before is named as such. progress(rank, payload)
    gets each progress message; timeout_s, the collectives' limit, is named when a rank gave up waiting."""
    results, pending, failures, linger_until = [None] * len(ranks), set(range(len(ranks))), {}, None
    while pending and (linger_until is None or time.monotonic() < linger_until):
        wait([pipes[r] for r in pending] + [ranks[r].sentinel for r in pending],
             None if linger_until is None else max(0.0, linger_until - time.monotonic()))
        for r in sorted(pending):
            if not pipes[r].poll() and ranks[r].is_alive():
                continue
            try:  # a message, or EOF: a rank that exited sent everything it will send
                message = pickle.loads(pipes[r].recv_bytes()) if pipes[r].poll() else None
            except EOFError:
                message = None
            except Exception as error:  # noqa: BLE001 -- e.g. a result of a class this process cannot import
                message = ("error", time.monotonic(), type(error).__name__,
                           f"its message could not be unpickled by the caller: {error}", "", False)
            message = message or _death(ranks[r], started[r])
            if message[0] == "progress":
                if progress is not None and not failures:  # after a failure only the root cause matters
                    progress(r, message[1])
                continue
            pending.discard(r)
            if message[0] == "ok":
                results[r] = message[1]
            else:
                failures[r] = message
        if failures and linger_until is None:
            linger_until = time.monotonic() + LINGER_S
    if failures:
        raise _error(failures, ranks, pending, timeout_s)
    return results


def _death(process, started):
    process.join(1.0)  # its sentinel fired: reap it to read the exit code
    code = process.exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
    return ("died", time.monotonic(), how, started)


MAIN_GUARD = ("a rank re-imports the script that started the run (Python's spawn and forkserver start methods "
              "do), and a script without `if __name__ == \"__main__\":` runs its own calls again there, which "
              "fail while the rank is still starting (its traceback is on stderr above); put the script's "
              "calls (loss_and_grads with tp, pp, dp or ep, run_ranks, ...) under `if __name__ == \"__main__\":`")
TIMED_OUT = re.compile(r"timed out|Watchdog caught collective operation timeout|Socket Timeout|wait timeout after",
                       re.IGNORECASE)  # gloo's, NCCL's watchdog's, the TCPStore's words for a timeout
OPERATION = re.compile(r"for (\w+) operation|OpType=(\w+)")  # gloo: "for recv operation"; NCCL: "OpType=ALLREDUCE"


def _reimports_main():
    """True when a spawned rank re-imports the program that started the run and runs its top level again: a script
    (python script.py) or a module run with -m, not a package's __main__ (python -m picockpt), as multiprocessing's
    spawn.py decides (_fixup_main_from_name skips a name that is or ends with __main__; a path is run again)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return not (spec.name == "__main__" or spec.name.endswith(".__main__"))
    return getattr(main, "__file__", None) is not None


def _error(failures, ranks, pending, timeout_s=None):
    """The root cause: a rank's own exception before a death, a death before a timeout, a timeout before a
    communication error (a rank whose peer is gone fails in its collective: a consequence, not the cause)."""
    def order(item):
        rank, failure = item
        if failure[0] == "died":
            return 1, failure[1], rank
        victim = failure[2].startswith("Dist") or any(sign in failure[3] for sign in PEER_GONE)
        return (2 if TIMED_OUT.search(failure[3]) else 3 if victim else 0), failure[1], rank
    rank, failure = min(failures.items(), key=order)
    world = len(ranks)
    limit = f"timeout_s={timeout_s:g} seconds" if timeout_s is not None else "the job's timeout"
    others = [f"rank {r} {f[2]}" if f[0] == "died" else f"rank {r} raised {f[2]}: {(f[3] or ' ').splitlines()[0]}"
              for r, f in sorted(failures.items()) if r != rank]
    others += [f"rank {r} was stopped" for r in sorted(pending)]
    tail = ("\nthe other ranks: " + "; ".join(others)) if others else ""
    if failure[0] == "died":
        return _death_error(rank, world, failure, tail, limit)
    _, failed_at, type_name, text, remote_traceback, is_value_error = failure
    said = f"raised {type_name}: {text}"
    if TIMED_OUT.search(text) and not is_value_error:  # the backend's words (a C++ path, "1000ms") said plainly
        operation = next((gloo or nccl for gloo, nccl in OPERATION.findall(text)), None)
        called = re.findall(r'distributed_c10d\.py", line \d+, in (\w+)', remote_traceback)  # torch's call
        operation = f"{operation or 'wait'} (of {called[-1]})" if called and called[-1] != operation else operation
        larger = f", e.g. {min(max(120.0, 10 * timeout_s), 86400.0):g}" if timeout_s is not None else ""
        said = (f"waited longer than {limit} in {'a ' + operation.lower() if operation else 'a collective'}, for a "
                f"rank that was still computing or had stalled; give a larger timeout_s{larger}")
    cause = RankError(f"rank {rank} of {world} {said}\n\ntraceback of rank {rank}:\n{remote_traceback}{tail}", rank,
                      type_name, remote_traceback, failed_at)
    if is_value_error:  # a user mistake: the same ValueError, with the rank named, traceback chained
        error = ValueError(f"rank {rank} of {world}: {text}")
        error.__cause__ = cause
        return error
    return cause


def _death_error(rank, world, failure, tail, limit):
    """A rank that died without a message (limit: the timeout, in words): killed by a signal (which leaves no
    traceback) or exited; exited before picockpt's code ran: a missing main guard, where a script was re-run."""
    _, failed_at, how, started = failure
    if "killed by" in how:
        source = {"SIGKILL": " (sent from outside the run: `kill -9`, or the kernel's out-of-memory killer)",
                  "SIGABRT": f" (NCCL's watchdog aborts a rank whose collective waited longer than {limit}, and says "
                             f"so on stderr above; a larger timeout_s if so)"}.get(how.split()[-1], "")
        when = "before returning a result" if started else "while it was starting"
        return RankError(f"rank {rank} of {world} {how}{source} {when}; a process killed by a signal leaves no "
                         f"traceback{tail}", rank, failed_at=failed_at)
    if not started and _reimports_main():  # a user mistake, said as one
        return ValueError(f"rank {rank} of {world} {how} before it started: {MAIN_GUARD}")
    when = "before returning a result" if started else "while it was starting, before picockpt's code ran"
    return RankError(f"rank {rank} of {world} {how} {when}{tail}", rank, failed_at=failed_at)


def stop(ranks, grace_s):
    """Reap every rank: those that reported success get grace_s to leave their group and exit; whatever still runs is
    then terminated (SIGTERM: Python exits at once, even inside a collective), killed (SIGKILL) past STOP_GRACE_S."""
    for wait_s, end in ((grace_s, "terminate"), (STOP_GRACE_S, "kill")):
        deadline = time.monotonic() + wait_s
        for process in ranks:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in ranks:
            if process.is_alive():
                getattr(process, end)()
    for process in ranks:
        process.join(STOP_GRACE_S)  # the killed ones, reaped

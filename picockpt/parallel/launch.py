"""Running one function on every rank: spawned local processes, or the processes torchrun made.

    results = run_ranks(fn, 4, x, timeout_s=60)   # fn(comm, x) runs on ranks 0..3; results[r] is what rank r returned
    results = run_ranks(fn, 2, x, progress=lambda rank, payload: print(rank, payload))   # each comm.progress(payload)

Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set) this process is one rank of its
rendezvous, one node or many: a failing rank raises here, torchrun stops the others, and comm.progress is None (each
process has its own output). Otherwise world_size local processes are spawned, each importing fn by name (so fn
lives at module level of an importable module). "spawn" starts each as a new interpreter (~0.9 s of CPU, mostly
`import torch`); "forkserver" forks each from one helper that imported torch once (~0.05 s a rank after the first
call). Neither forks this process (no inherited threads or CUDA state), and nothing listens beyond 127.0.0.1. Each
rank runs one thread, sees this process's environment variables and gets its own copy of args and kwargs; its
progress payloads come down the same pipe as its result, as they are sent. The first rank to fail or die ends the
run (watch.py); no process outlives run_ranks, KeyboardInterrupt and SIGTERM (watch.Terminated) included.
"""
import contextlib
import os
import pickle
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..recompute.engine import device_generator
from .comm import Comm
from .watch import STOP_GRACE_S, RankError, collect, sigterm_raises, stop  # noqa: F401 (RankError: raised here)

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LOCALHOST = "127.0.0.1"
TIMEOUT_RANGE_S = (1.0, 86400.0)  # below a second the groups' own connect (gloo's full mesh, bounded by the same
#                                    timeout) fails on a busy machine before any step; a day is longer than any wait
JOIN_S = 60.0  # the rendezvous: ranks start seconds apart (each imports torch), whatever the collectives may wait


def ranks_generator(device):
    """The caller's generator whose state its ranks start from: its CPU one, or its current GPU's (not GPU 0's)."""
    on_gpu = str(device).startswith("cuda") and torch.cuda.is_available()
    return device_generator(torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu"))


def under_torchrun():
    """True when torchrun (torch.distributed.run) started this process as one rank."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def check_rank_count(name, count, device="cpu"):
    """ValueError naming `name` (the size that sets the number of ranks) when `count` ranks cannot run here: torchrun
    started WORLD_SIZE processes, spawned CUDA ranks take a GPU each. On the CPU any count spawns (sharing cores)."""
    if under_torchrun():
        size = int(os.environ["WORLD_SIZE"])
        if count != size:
            raise ValueError(f"{name}={count}: torchrun started {size} processes, one per rank; pass {name}={size}, "
                             f"or start torchrun with --nproc-per-node {count}")
    elif torch.device(device).type == "cuda" and count > torch.cuda.device_count():
        raise ValueError(f"{name}={count}: spawned ranks take one GPU each and this machine has "
                         f"{torch.cuda.device_count()}; use at most that many, or device='cpu'")


def check_timeout(timeout_s):
    """ValueError naming timeout_s unless it is a number of seconds a collective can wait (TIMEOUT_RANGE_S)."""
    low, high = TIMEOUT_RANGE_S
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not low <= timeout_s <= high:
        raise ValueError(f"timeout_s={timeout_s!r}: use a number of seconds from {low:g} (the groups' connect waits as "
                         f"long as a collective, and needs that much) to {high:g} (a day), e.g. 120")


def run_ranks(fn, world_size, *args, backend=None, device="cpu", timeout_s=60, port=None, start_method="spawn",
              progress=None, **kwargs):
    """fn(comm, *args, **kwargs) on every rank (other keywords go to fn); returns [rank 0's result, rank 1's, ...].
    world_size: the number of ranks (under torchrun: None, or its WORLD_SIZE). backend: None picks "nccl" for
    device="cuda", "gloo" otherwise. device: "cpu" or "cuda" (each rank takes cuda:LOCAL_RANK; an index given is not
    used). timeout_s: seconds, the limit on every collective, sub-groups' too (Comm.timeout: one made without it waits
    torch's 30 minutes), and on the rendezvous, which waits at least JOIN_S for ranks still starting. Spawned ranks
    only: port (127.0.0.1's; None: a free one), start_method, progress (above)."""
    if not callable(fn):
        raise ValueError(f"fn={fn!r}: give a function fn(comm, *args, **kwargs)")
    check_timeout(timeout_s)
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError):
        device_type = None
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: use 'cpu' or 'cuda'")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA was asked for, but torch.cuda.is_available() is False; "
                         f"use device='cpu' (gloo)")
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: use 'gloo' (CPU tensors) or 'nccl' (CUDA tensors)")
    if backend == "nccl" and device_type != "cuda":
        raise ValueError(f"backend='nccl' with device={device!r}: NCCL moves CUDA tensors only; "
                         f"use device='cuda', or backend='gloo' for the CPU")
    if world_size is not None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: use a whole number of ranks, 1 or more")
        check_rank_count("world_size", world_size, device_type)  # torchrun's WORLD_SIZE; spawned CUDA: a GPU each
    elif not under_torchrun():
        raise ValueError("world_size=None: give the number of ranks to spawn (None only under torchrun)")
    if under_torchrun():
        if port is not None:
            raise ValueError(f"port={port}: under torchrun the rendezvous is MASTER_ADDR:MASTER_PORT "
                             f"({os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}); leave port out")
        return _run_here(fn, args, kwargs, backend, device_type, timeout_s)
    methods = [method for method in ("spawn", "forkserver") if method in mp.get_all_start_methods()]
    if start_method not in methods:
        raise ValueError(f"start_method={start_method!r}: use one of {methods}")
    with sigterm_raises():  # SIGTERM stops the ranks and says so, as Ctrl-C does
        return _spawn(fn, world_size, args, kwargs, backend, device_type, timeout_s, port, start_method, progress)


# -- torchrun: this process is one rank ---------------------------------------------------------
def _run_here(fn, args, kwargs, backend, device_type, timeout_s):
    device, bound = _rank_device(device_type, int(os.environ["LOCAL_RANK"]))
    owns_group = not dist.is_initialized()  # a second run_ranks in the same job reuses the group
    if owns_group:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **bound)  # env:// rendezvous
    try:
        result = fn(Comm(device=device, timeout=timedelta(seconds=timeout_s)), *args, **kwargs)
        results = [None] * int(os.environ["WORLD_SIZE"])
        dist.all_gather_object(results, result)  # every rank gets every rank's result
    finally:
        if owns_group:
            dist.destroy_process_group()
    return results


def _rank_device(device_type, local_rank):
    """This rank's device, and init_process_group's keywords for it: device_id on CUDA (NCCL need not guess the GPU
    for barriers; its communicator is eager)."""
    if device_type != "cuda":
        return torch.device("cpu"), {}
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)  # NCCL's communicator and every new tensor land on this GPU
    return device, {"device_id": device}


# -- spawned: this process is the parent, the ranks are its children -------------------------------
def _spawn(fn, world_size, args, kwargs, backend, device_type, timeout_s, port, start_method, progress):
    try:
        payload = pickle.dumps((fn, args, kwargs, dict(os.environ)))  # by value: each rank its own copy
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise ValueError(f"fn={getattr(fn, '__qualname__', fn)!r} or its arguments cannot be sent to "
                         f"spawned ranks ({error}); define fn at module level of an importable module "
                         f"and pass picklable arguments") from error
    store = _serve_rendezvous(port, world_size, timeout_s)  # bound here, before any rank starts
    context = mp.get_context(start_method)
    parent = None if start_method == "forkserver" else os.getpid()  # forkserver: the ranks' parent is its helper
    if start_method == "forkserver":
        context.set_forkserver_preload([__name__])  # torch and this module, imported once by the helper
    started = context.Array("b", world_size, lock=False)  # rank r sets started[r] once it runs picockpt's code
    ranks, pipes, outboxes, results = [], [], [], None
    try:
        for rank in range(world_size):
            reader, writer = context.Pipe(duplex=False)  # the rank's progress, then its result or error
            inbox, outbox = context.Pipe(duplex=False)  # the payload (fn and its arguments, often megabytes)
            # not a daemon: a rank may start processes of its own (torch.compile's workers, say)
            process = context.Process(target=_spawned_rank, name=f"picockpt-rank-{rank}", args=(
                rank, world_size, store.port, backend, device_type, timeout_s, inbox, writer, parent, started,
                progress is not None))
            process.start()  # sends only these small arguments: never blocks on a rank that dies starting
            writer.close()  # the parent keeps only the reading end: EOF once the rank is gone
            inbox.close()  # and only the writing end of the payload's pipe: EPIPE once the rank is gone
            ranks.append(process)
            pipes.append(reader)
            outboxes.append(outbox)
        for outbox in outboxes:  # each rank reads its payload first thing; a rank that died never will
            with contextlib.suppress(OSError):  # BrokenPipeError: the rank is gone; collect() says how and why
                outbox.send_bytes(payload)
            outbox.close()
        results = collect(ranks, pipes, started, progress, timeout_s)
        return results
    finally:  # whatever happened (a failure, KeyboardInterrupt): no rank outlives this call
        stop(ranks, grace_s=STOP_GRACE_S if results is not None else 0.0)
        for connection in pipes + outboxes:
            connection.close()
        del store  # closes the rendezvous port


def _serve_rendezvous(port, world_size, timeout_s):
    """A TCPStore served here on 127.0.0.1 only (bound by itself it would listen on every address: it gets a socket)."""
    if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
        raise ValueError(f"port={port!r}: use a TCP port number 1..65535, or leave port out for a free one")
    try:  # port 0: the kernel picks a free one
        listener = socket.create_server((LOCALHOST, port or 0), backlog=max(world_size, 8))
    except OSError as error:  # its words name the address: the system's alone say why
        raise ValueError(f"port={port}: cannot listen on {LOCALHOST}:{port} ({os.strerror(error.errno)}); another "
                         f"process holds it. Leave port out (on the command line: no --port) and a free one is "
                         f"picked") from None
    return dist.TCPStore(LOCALHOST, listener.getsockname()[1], world_size, is_master=True,
                         timeout=timedelta(seconds=max(timeout_s, JOIN_S)),
                         wait_for_workers=False, master_listen_fd=listener.detach(), use_libuv=True)


def _spawned_rank(rank, world_size, port, backend, device_type, timeout_s, inbox, pipe, parent_pid, started,
                  reports_progress=False):
    """One spawned rank: read the payload, join the group, run fn (its progress sent, if asked), send one message."""
    started[rank] = 1  # past Python's bootstrap (which re-imports the caller's script): picockpt's code runs
    _die_with_parent(parent_pid)
    torch.set_num_threads(1)  # ranks share the machine's cores: one thread each, no oversubscription
    try:
        fn, args, kwargs, environment = pickle.loads(inbox.recv_bytes())  # pickled by the parent
        inbox.close()
        os.environ.clear()
        os.environ.update(environment)  # the caller's variables now (a forkserver helper's may be older)
        if backend == "gloo":
            os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()  # gloo's own sockets on 127.0.0.1 only
        device, bound = _rank_device(device_type, rank)
        store = dist.TCPStore(LOCALHOST, port, world_size, is_master=False,
                              timeout=timedelta(seconds=max(timeout_s, JOIN_S)))
        store.set(f"joined/{rank}", "1")  # every rank here before any group connects: the connect itself is quick
        store.wait([f"joined/{r}" for r in range(world_size)])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), **bound)
        dist.barrier()  # gloo's full-mesh connect can finish on one rank before another: a rank that
        #                 left (returned, failed) that early would break its peers' connect
        progress = (lambda payload: pipe.send_bytes(pickle.dumps(("progress", payload)))) if reports_progress else None
        result = fn(Comm(device=device, timeout=timedelta(seconds=timeout_s), progress=progress), *args, **kwargs)
        message = pickle.dumps(("ok", result))  # by value; a CUDA tensor would come back on CUDA
    except BaseException as error:  # noqa: BLE001 -- every failure, KeyboardInterrupt too, goes back
        message = pickle.dumps(("error", time.monotonic(), type(error).__name__, str(error),
                                traceback.format_exc(), isinstance(error, ValueError)))
    with contextlib.suppress(OSError):  # the caller has stopped listening (another rank failed first): nothing to tell
        pipe.send_bytes(message)  # sent before leaving the group, so this rank's error is the first one
        pipe.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (torch's takes ~0.5 s); everything was sent above


def _die_with_parent(parent_pid):
    """Linux: the kernel kills this rank when its parent (the caller or the forkserver helper) dies, even of SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # prctl(PR_SET_PDEATHSIG, SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)


def _loopback_interface():
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):  # Linux's name, then macOS's
        if name in names:
            return name
    raise RuntimeError(f"no loopback network interface among {names}: spawned gloo ranks bind to it only")

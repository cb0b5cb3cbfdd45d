"""What the parallel command's layouts share: the device of this process (its own GPU under
torchrun), every layout flag handed to the one job (whose checks refuse what a layout does not use), the
step itself beside the single-process reference, the JSON row's keys, and errors in the command's words: a
parameter's name said as its flag, a rank's failure as one line, SIGTERM as one line."""
import contextlib
from dataclasses import fields
import json
import os
import re
import sys

import torch

from ..recompute.engine import loss_and_grads as single_loss_and_grads
from ..device import resolve_device
from ..planning.fit import check_fits
from ..measurement.measure import make_batch, max_relative_diff
from ..model.params import init_params
from ..parallel import Layout, RankError, loss_and_grads, under_torchrun
from ..parallel.launch import TIMEOUT_RANGE_S
from ..parallel.watch import Terminated, sigterm_raises
from ..recompute.policy import Policy, parse_policy
from . import RankFailed
from .common import SHAPE_FLAGS, config_from_args
from .parallel_zero import print_zero

LAYOUT = tuple(field.name for field in fields(Layout))  # every dimension and option, one flag each
SWITCHES = {"sp", "distribute_saved", "recompute_early", "keep_dispatched", "cp_keep_kv", "keep_kv", "keep_gathered",
            "trace", "verbose"}  # store_true flags: name=True is the flag given
NEGATED = {"overlap": "--no-overlap", "prefetch": "--no-prefetch"}  # the flag that makes them False
FLAGS = {name: "--" + name.replace("_", "-") for name in (
    *(name for name in LAYOUT if name not in NEGATED), "trace", "verbose", "port", "device", "policy", "batch", "seq",
    *SHAPE_FLAGS)}
FLAGS.update(NEGATED, keep_kv="--cp-keep-kv", layout="--cp-layout", timeout_s="--timeout")
NAME = r"(?<![\w.-])(?:Config\.)?(" + "|".join(sorted(FLAGS, key=len, reverse=True)) + r")"
VALUE = r"('[^']*'|\"[^\"]*\"|[-+]?[\w.]*\w(?:[-+]\d+)?)"


TIMEOUT_S = 120.0  # --timeout's default


def add_timeout(parser, default=TIMEOUT_S):
    """--timeout, as every command that launches ranks has it (default None: the command sees whether it was given,
    and uses TIMEOUT_S)."""
    low, high = TIMEOUT_RANGE_S
    parser.add_argument("--timeout", type=float, default=default, help=f"seconds any collective may wait, {low:g} to "
                        f"{high:g} (default {TIMEOUT_S:g}); a rank that waits longer ends the run, in one line naming "
                        f"it, what it waited in and this flag")


def rank_device(args):
    """The device this process computes on: under torchrun on CUDA, its own GPU (LOCAL_RANK), set as the
    current device before anything is made on it; otherwise --device as everywhere."""
    device = resolve_device(args.device)
    if under_torchrun() and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def prepared(args):
    """(cfg, policy, device) of the command's flags, once the whole step is known to fit there (the command
    also runs it in one process, with policy none, to check the ranks' gradients): a ValueError first."""
    cfg = config_from_args(args)
    policy = parse_policy(args.policy, cfg)
    device = rank_device(args)
    check_fits(cfg, device, args.batch, args.seq, Policy("none"),
               note=" (this command also runs the whole step in one process, to check the ranks' gradients)")
    return cfg, policy, device


def layout_of(args):
    """Every layout flag as the job's field, whichever layout runs: the job's checks refuse, by name, a flag the
    layout does not use (picockpt/parallel/job.py), so none is dropped on the way."""
    return {name: not getattr(args, "no_" + name) if name in NEGATED else getattr(args, name) for name in LAYOUT}


def measured_step(args, cfg, policy, device):
    """The parallel step of the flags' layout and, in the process that prints (the only one, or torchrun's
    rank 0), the single-process reference: (loss, ranks, single-process loss, max relative gradient difference,
    params, input_ids), or None in the other torchrun processes. A rank's failure is one line (rank_failure)."""
    params = init_params(cfg, seed=args.seed, device=device)
    input_ids, targets = make_batch(cfg, args.batch, args.seq, device, args.seed)
    torch.manual_seed(args.seed)  # the dropout masks and the router jitter: the same state for both runs
    try:
        loss, grads, ranks = loss_and_grads(params, cfg, input_ids, targets, policy, device=device.type,
                                            timeout_s=args.timeout, port=args.port, trace=args.trace,
                                            optimizer_step=bool(args.zero), layout=Layout(**layout_of(args)))
    except RankError as error:
        raise rank_failure(error, args.verbose) from None
    except ValueError as error:  # a rank's own ValueError is one line already; --verbose adds its traceback
        cause = error.__cause__
        if args.verbose and isinstance(cause, RankError):
            raise ValueError(f"{error}\n\ntraceback of rank {cause.rank}:\n{cause.remote_traceback}") from None
        raise
    if under_torchrun() and os.environ.get("RANK") != "0":  # every torchrun process ran the step; one prints
        return None
    torch.manual_seed(args.seed)
    single_loss, single_grads = single_loss_and_grads(params, cfg, input_ids, targets, "none")  # every policy's
    worst = max(max_relative_diff(grads[name], single_grads[name]) for name in single_grads)
    return loss, ranks, single_loss, worst, params, input_ids


def printed(args, cfg, policy, device, row, measured, print_table, ranks):
    """The command's row: every layout's keys (the same in every layout, each with the value that ran) and the
    model's, then `row`'s own, completed by the step's outcome (the loss, the single process's, the gradients'
    largest relative difference, the ranks' reports `ranks`): one JSON object with --json, else the table
    (and under --zero ZeRO's table below it)."""
    loss, _, single_loss, worst, _, _ = measured
    row = {**layout_of(args), "policy": policy.text, "device": str(device), "dtype": cfg.dtype,
           "attention": cfg.attention, "layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
           "kv_heads": cfg.kv_heads, "ffn": cfg.ffn, "vocab": cfg.vocab, "experts": cfg.experts,
           "experts_per_token": cfg.experts_per_token, "batch": args.batch, "seq": args.seq, **row,
           "loss": loss.item(), "single_process_loss": single_loss.item(), "grad_max_rel_diff_vs_single": worst,
           "ranks": ranks}
    if args.json:
        print(json.dumps(row, indent=1))
    else:
        print_table(row)
        if row["zero"]:  # under any layout's table, ZeRO's own (parallel_zero.py)
            print_zero(row)


def layout_words(row):
    """Every layout choice the step ran with, from the row's own keys (layout_of): 'pp=2, cp=2, tp=2, M=2
    micro-batches, zb-h1, sequence parallel, ring K/V (zigzag)'; what is left at its default is left out. Every
    header says the layout this way, so none can leave out a dimension that ran."""
    words = [f"{name}={row[name]}" for name in ("dp", "pp", "ep", "cp", "tp") if row[name] > 1]
    if row["microbatches"] > 1:
        words.append(f"M={row['microbatches']} micro-batches")
    if row["pp"] > 1 or row["microbatches"] > 1:
        words.append(row["schedule"] + (f" (V={row['virtual_stages']} chunks a rank)" if row["virtual_stages"] > 1
                                         else ""))
    if row["cp"] > 1:
        words.append(f"K/V by {row['cp_comm']} ({row['cp_layout']})" + (", kept" if row["cp_keep_kv"] else ""))
    if row["zero"]:
        words.append(f"ZeRO-{row['zero']}" + (f", gathers kept ({row['keep_gathered']})" if row["keep_gathered"] is
                                               not False else "") + ("" if row["prefetch"] else ", no prefetch"))
    words += [text for key, text in (("sp", "sequence parallel"), ("distribute_saved", "distributed saved "
              "activations"), ("recompute_early", "recompute early"), ("keep_dispatched", "the dispatched rows "
              "kept")) if row[key]]
    if not row["overlap"]:
        words.append("all-reduce after the backward")
    return ", ".join(words) or "one rank"


def rank_failure(error, verbose=False):
    """A RankError as the command's one line (a RankFailed: exit code 1), the rank's last frame named; verbose: every
    rank's traceback below (a rank killed by a signal has none, and the line does not offer it)."""
    first, _, rest = str(error).partition("\n")
    if verbose or not error.remote_traceback:
        return RankFailed(f"{first}{last_frame(error)}" + (f"\n{rest}" if rest and verbose else ""))
    return RankFailed(f"{first}{last_frame(error)}; --verbose prints the rank's traceback")


def as_flags(message):
    """A job's ValueError in the command's words: each parameter it names (cp_keep_kv=True, zero=3, dp >= 2, leave
    prefetch out, Config.attention='eager') said as its flag (--cp-keep-kv, --zero 3, --dp >= 2, leave
    --no-prefetch out, --attention eager); a message already in flags is left as it is."""
    def flag_with_value(match):
        name, value = match.group(1), match.group(2).strip("'\"")
        if name in NEGATED or name in SWITCHES:
            given = (value == "False") == (name in NEGATED)  # overlap=False: --no-overlap given; sp=True: --sp
            return FLAGS[name] if given else f"no {FLAGS[name]}"
        return f"{FLAGS[name]} {value}"
    message = re.sub(NAME + "=" + VALUE, flag_with_value, message)
    message = re.sub(NAME + r"(?=\s*(?:>=|<=|>|<|in \[))", lambda match: FLAGS[match.group(1)], message)
    message = re.sub(r"\b(without|leave|add|set) " + NAME + r"\b(?![=-])",
                     lambda match: f"{match.group(1)} {FLAGS[match.group(2)]}", message)
    return re.sub(NAME + r"(?![\w=-])", lambda match: FLAGS[match.group(1)] if "_" in match.group(1) else
                  match.group(0), message)


def one_line_errors(command, run, args):
    """run(args) with its ValueErrors and its ranks' failures (RankFailed) said in flags (as_flags: timeout_s=1 is
    --timeout 1), and SIGTERM stopping every rank and saying so in one line, exit code 143 (128 + SIGTERM, as shells
    report it); Ctrl-C is the CLI's own (cli/__init__.py). Under torchrun, SIGTERM is left to torchrun, which ends
    its processes itself."""
    try:
        with contextlib.nullcontext() if under_torchrun() else sigterm_raises():
            return run(args)
    except (ValueError, RankFailed) as error:
        raise type(error)(as_flags(str(error))) from None
    except Terminated:
        print(f"terminated: python -m picockpt {command} stopped before it finished (SIGTERM; no rank of it is left "
              f"running)", file=sys.stderr)
        return 143


def last_frame(error):
    """', at FILE:LINE in FUNCTION' of the rank's last frame, from its traceback ('' without one)."""
    lines = [line.strip() for line in (error.remote_traceback or "").splitlines() if line.strip().startswith("File ")]
    return f" (rank's last frame: {lines[-1]})" if lines else ""

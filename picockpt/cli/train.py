"""python -m picockpt train: the synthetic Markov task, step by step; with --dp D --zero S on D ZeRO ranks.

    python -m picockpt train --preset tiny --steps 50 --policy full
    python -m picockpt train --preset tiny --steps 50 --policy full --dp 2 --zero 3 --keep-gathered
    python -m picockpt train --preset tiny --steps 50 --policy full --dp 2 --zero 2 --tp 2 --pp 2   # 8 ranks

With --zero the same batches (the same seed draws the same MarkovTask streams and the same initial weights)
train on ZeRO ranks (picockpt/parallel/training.py: zero_train): each of the D data-parallel ranks computes
batch/D of every step's sequences, and every rank steps AdamW on its shards only. ZeRO stacks on the other
layouts (--tp, --sp, --pp, --microbatches, --cp, --ep: dp x tp x pp x cp x ep ranks in all) and shards over
the dp x ep x cp of them. Each step's loss is printed as the ranks end it (under torchrun, once they are done), then
each rank's model state, stored and gathered peaks and bytes moved in the last step, beside their closed forms.
"""
import math
import os

import torch

from ..planning.fit import check_fits
from ..planning.hardware import H200_SXM_BF16
from ..model.params import init_params
from ..parallel import Layout, RankError, under_torchrun
from ..parallel.training import zero_train
from ..parallel.data_parallel.dp_check import check_zero
from ..parallel.launch import check_rank_count, check_timeout
from ..device import resolve_device
from ..recompute.policy import POLICY_HELP, parse_policy
from ..measurement.train import MarkovTask, Monitor, train
from .common import add_run_args, add_shape_args, config_from_args
from .parallel_run import TIMEOUT_S, add_timeout, one_line_errors, rank_device, rank_failure
from .parallel_zero import print_ranks


CUDA_PEAK_TFLOPS = H200_SXM_BF16 / 1e12  # 989.5: H100/H200 SXM dense bf16 (picockpt/planning/hardware.py)


def add_arguments(parser):
    add_shape_args(parser, batch=8, seq=128)
    add_run_args(parser)
    parser.add_argument("--policy", default="none", help=POLICY_HELP)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--log-every", type=int, default=1, help="print every N steps, and the last (default 1)")
    parser.add_argument("--watch-live", action="store_true",
                        help="CPU: also measure the live peak (every tensor of the step, not only the stored ones) "
                             "at every step; slow. On CUDA the live peak comes from the allocator, always")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense peak in TFLOP/s, for MFU and HFU (PaLM's model and hardware FLOPs "
                             "utilisation); default on CUDA 989.5 (an H100/H200 SXM in bf16; an A100 is 312), "
                             "on CPU none (give your CPU's peak to see them)")
    zero = parser.add_argument_group("ZeRO data parallelism (spawned ranks: gloo on the CPU, NCCL with a GPU each; "
                                     "or torchrun's)")
    zero.add_argument("--dp", type=int, help="data-parallel ranks D (needs --zero; 2 or more, or 1 beside --ep or "
                      "--cp): each trains on batch/D of every step's sequences, the same batches as without --dp")
    zero.add_argument("--zero", type=int, choices=(1, 2, 3), help="ZeRO stage over the data-parallel ranks "
                      "(--dp x --ep x --cp of them): 1 shards the AdamW state, 2 also the gradients, 3 also the "
                      "parameters (all-gathered around each use)")
    zero.add_argument("--keep-gathered", action="store_true", help="--zero 3: a recomputed layer's gathered "
                      "parameters stay from its recompute through its backward (one gather fewer per layer)")
    zero.add_argument("--no-prefetch", action="store_true", help="--zero 3: gather each use's parameters only when "
                      "it starts, not while the use before computes")
    layouts = parser.add_argument_group("layouts beside ZeRO (need --zero; picockpt/parallel/, as in `picockpt "
                                        "parallel`; dp x tp x pp x cp x ep ranks in all)")
    layouts.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1); with --sp, sequence "
                         "parallel too")
    layouts.add_argument("--sp", action="store_true", help="--tp N: sequence parallelism (norms, residual adds and "
                         "dropout on T/N tokens per rank)")
    layouts.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1); layers split over them")
    layouts.add_argument("--microbatches", type=int, default=1, help="micro-batches per step (default 1, 1F1B); "
                         "--batch a multiple of dp x microbatches")
    layouts.add_argument("--cp", type=int, default=1, help="context-parallel ranks (default 1; tiled or fused "
                         "attention): each holds 1/cp of every sequence's tokens; ZeRO shards over them too")
    layouts.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (default 1; needs --experts): "
                         "each holds experts/ep experts; ZeRO shards every other weight over them too")
    add_timeout(zero, default=None)
    zero.add_argument("--verbose", action="store_true", help="--dp/--zero: a rank's failure with every failed rank's "
                      "traceback below it (without: one line, naming the rank and its last frame)")


def run(args):
    return one_line_errors("train", train_command, args)  # errors in flags; SIGTERM stops the ranks in one line


def train_command(args):
    cfg = config_from_args(args)
    zero = check_zero_flags(args, cfg)  # before the dtype advice below, which names bf16
    if cfg.dtype == "float16":
        raise ValueError("--dtype fp16: training in fp16 needs loss scaling, which picockpt leaves out; "
                         "use bf16 (same bytes, fp32's exponent range) or fp32")
    if args.steps <= 0:
        raise ValueError(f"--steps={args.steps}: must be a positive integer")
    if args.log_every < 1:
        raise ValueError(f"--log-every={args.log_every}: print every N steps with N >= 1 (the last step is "
                         f"always printed; --log-every {args.steps} prints the first and the last)")
    if args.peak_tflops is not None and (not math.isfinite(args.peak_tflops) or args.peak_tflops <= 0):
        raise ValueError(f"--peak-tflops={args.peak_tflops}: give the device's dense peak, a positive number "
                         f"(989.5 for an H100/H200 SXM in bf16)")
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise ValueError(f"--lr={args.lr}: AdamW's learning rate must be a positive number, e.g. 3e-3")
    policy = parse_policy(args.policy, cfg)
    device = rank_device(args) if zero else resolve_device(args.device)  # under torchrun, this process's own GPU
    peak_tflops = args.peak_tflops if args.peak_tflops is not None else \
        CUDA_PEAK_TFLOPS if device.type == "cuda" else None  # a CPU has no datasheet peak: no MFU/HFU unless given
    check_fits(cfg, device, args.batch, args.seq, policy)
    task = MarkovTask(cfg.vocab, seed=args.seed)
    words = layout_words(args) if zero else ""
    over = f" over {world_size(args)} ZeRO-{args.zero} ranks{' = ' + words if words else ''}" if zero else ""
    print(f"training {cfg.num_params():,} parameters on {device}{over} ({cfg.dtype}), policy {policy.text}, "
          f"{'global ' if zero else ''}batch {args.batch} x {args.seq} tokens; loss starts near ln(vocab) = "
          f"{math.log(cfg.vocab):.3f}, the task's floor is ln({task.branching}) = {task.loss_floor:.3f}")
    params = init_params(cfg, seed=args.seed, device=device)
    if zero:
        losses = train_with_zero(args, cfg, task, params, policy, device)
        if losses is None:  # another torchrun process: rank 0 prints
            return
    else:
        losses = train(params, cfg, task, args.steps, args.batch, args.seq, policy, args.lr, device, args.seed,
                       monitor=Monitor(every=args.log_every, watch_live=args.watch_live, peak_tflops=peak_tflops))
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps")


LAYOUTS = (("--tp", "tp"), ("--pp", "pp"), ("--microbatches", "microbatches"), ("--cp", "cp"), ("--ep", "ep"))


def world_size(args):
    """Every rank of the layout: dp x tp x pp x cp x ep (--dp left out: 1)."""
    return (args.dp or 1) * args.tp * args.pp * args.cp * args.ep


def layout_words(args):
    """'dp 2 x tp 2, 2 micro-batches, sequence parallel' for a layout other than --dp alone, else ''."""
    sizes = [f"{name} {value}" for name, value in (("dp", args.dp or 1), ("tp", args.tp), ("pp", args.pp),
                                                   ("cp", args.cp), ("ep", args.ep)) if value > 1]
    extra = [f"{args.microbatches} micro-batches"] * (args.microbatches > 1) + ["sequence parallel"] * args.sp
    if not extra and [size.split()[0] for size in sizes] in (["dp"], []):
        return ""  # --dp alone: said by the count of ranks
    return ", ".join([" x ".join(sizes)] + extra)


def check_zero_flags(args, cfg):
    """True with --zero (and --dp, --ep or --cp); a ValueError for a ZeRO or layout flag without it, or one the ZeRO
    ranks ignore."""
    layouts = [f"{flag} {getattr(args, name)}" for flag, name in LAYOUTS if getattr(args, name) != 1]
    layouts += ["--sp"] if args.sp else []
    if args.dp is None and args.zero is None:
        for flag, given in (("--keep-gathered", args.keep_gathered), ("--no-prefetch", args.no_prefetch)):
            if given:
                raise ValueError(f"{flag} without --zero 3 (and --dp D): it changes when ZeRO-3 gathers parameters, "
                                 f"and there is none here; add --dp 2 --zero 3, or leave {flag} out")
        if layouts:
            raise ValueError(f"{layouts[0]} without --zero: the parallel layouts train on ZeRO ranks here (one "
                             f"process trains without them); add --dp 2 --zero 1, or leave {layouts[0].split()[0]} "
                             f"out")
        for flag, given, what in (("--verbose", args.verbose, "adds a failed rank's traceback"),
                                  ("--timeout", args.timeout is not None, "bounds the ranks' collectives")):
            if given:
                raise ValueError(f"{flag} without --dp/--zero: it {what}, and one process trains here (its own errors "
                                 f"say where); add --dp 2 --zero 1, or leave {flag} out")
        return False
    check_timeout(TIMEOUT_S if args.timeout is None else args.timeout)  # timeout_s, said as --timeout
    if args.zero is None:
        raise ValueError(f"--dp {args.dp} without --zero: plain data-parallel training is not built; --zero 1 holds "
                         f"what plain data parallelism holds (whole parameters and gradients on every rank) with "
                         f"the AdamW state sharded; add --zero 1, 2 or 3")
    for flag, name in (("--dp", "dp"),) + LAYOUTS:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: give a whole number of ranks (micro-batches for --microbatches), "
                             f"1 or more")
    dp = args.dp or 1
    shard = dp * args.ep * args.cp  # the ranks ZeRO shards every weight but the experts' over
    if shard < 2:
        raise ValueError(f"--zero {args.zero} {'without --dp' if args.dp is None else f'with --dp {args.dp}'}: ZeRO "
                         f"shards the model state over data-parallel ranks (dp x ep x cp of them), and here there "
                         f"is one; add --dp D with D >= 2 (or --ep N, --cp N beside it)")
    if args.sp and args.tp == 1:
        raise ValueError("--sp with a tensor-parallel size of 1 (--tp 1): it splits a tensor-parallel rank's "
                         "tokens, and there is none here; add --tp N (N > 1), or leave --sp out")
    for flag, given in (("--keep-gathered", args.keep_gathered), ("--no-prefetch", args.no_prefetch)):
        if given and args.zero != 3:
            raise ValueError(f"{flag} with --zero {args.zero}: only stage 3 gathers parameters; use --zero 3, or "
                             f"leave {flag} out")
    for flag, given, why in (("--watch-live", args.watch_live, "the ranks measure the activation store's bytes, "
                              "not every live tensor"),
                             ("--peak-tflops", args.peak_tflops is not None, "the ranks report no FLOPs, so no "
                              "MFU or HFU")):
        if given:
            raise ValueError(f"{flag} with --dp/--zero: {why}; leave {flag} out, or train without --dp")
    rows = dp * args.microbatches  # micro-batches of the whole batch: each data-parallel rank's, one after another
    if shard != dp and args.batch % rows:  # ZeRO's own check counts whole sequences per rank of dp alone
        raise ValueError(f"--batch {args.batch} is not divisible into --dp x --microbatches = {dp} x "
                         f"{args.microbatches} = {rows} micro-batches of equal size; use a batch that is a multiple "
                         f"of {rows}")
    check_zero(args.zero, shard, cfg, args.batch * shard // dp, args.keep_gathered, not args.no_prefetch)  # bf16 too
    sizes = [flag for flag, value in (("--dp", dp), ("--tp", args.tp), ("--pp", args.pp), ("--cp", args.cp),
                                      ("--ep", args.ep)) if value > 1]
    check_rank_count(" x ".join(sizes), world_size(args), rank_device(args))  # CUDA: a GPU per rank; torchrun's
    policy = parse_policy(args.policy, cfg).refuse_offload("ZeRO training")
    if world_size(args) == dp and args.microbatches == 1:  # dp alone: a rank's rows; other layouts: the job plans
        policy.schedule(cfg, args.batch // dp, args.seq)  # a budget too small for a rank's rows
    return True


def train_with_zero(args, cfg, task, params, policy, device):
    """The single process's batches and weights on the ZeRO ranks: the losses (printed per --log-every as each step
    ends) and each rank's report of the last step; None in torchrun's processes but rank 0."""
    batches = [task.batch(args.batch, args.seq, device) for _ in range(args.steps)]  # train()'s draws, in order
    torch.manual_seed(args.seed)  # the dropout masks: train()'s generator state
    layout = Layout(dp=args.dp or 1, pp=args.pp, tp=args.tp, ep=args.ep, cp=args.cp, zero=args.zero,
                    keep_gathered=args.keep_gathered, prefetch=not args.no_prefetch, microbatches=args.microbatches,
                    sp=args.sp)
    printed = set()

    def print_step(step, loss, seconds):  # seconds: the slowest rank's
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss:7.4f}  {args.batch * args.seq / seconds:10,.0f} tokens/s", flush=True)
        printed.add(step)
    try:  # spawned ranks: each step printed as it ends (zero_train's on_step), as one process prints it
        losses, _, ranks = zero_train(params, cfg, batches, policy, layout, args.lr, device=device.type,
                                      on_step=print_step, timeout_s=TIMEOUT_S if args.timeout is None else args.timeout)
    except RankError as error:
        raise rank_failure(error, args.verbose) from None
    if under_torchrun() and os.environ.get("RANK") != "0":  # every torchrun process trained; one prints
        return None
    for step, loss in enumerate(losses):  # under torchrun: every step's line once the ranks are done
        if step not in printed:
            print_step(step, loss, max(r["seconds_per_step"][step] for r in ranks))
    dp = args.dp or 1
    shard = dp * args.ep * args.cp
    words = layout_words(args)
    print(f"ZeRO stage {args.zero} over {shard} ranks{'' if shard == dp else ' (dp x ep x cp)'} ({args.batch // dp} "
          f"sequences per data-parallel rank){', layout ' + words if words else ''}; each rank after the last step:")
    print_ranks(ranks)
    return losses

"""python -m picockpt train: the synthetic Markov task, step by step."""
import math

from ..fit import check_fits
from ..params import init_params
from ..policy import parse_policy
from ..train import MarkovTask, train
from .common import add_run_args, add_shape_args, config_from_args, device_from_args


CUDA_PEAK_TFLOPS = 989.5  # H100/H200 SXM dense bf16 (NVIDIA's datasheet: 1979 with sparsity)


def add_arguments(parser):
    add_shape_args(parser, batch=8, seq=128)
    add_run_args(parser)
    parser.add_argument("--policy", default="none", help="recomputation policy (default none)")
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


def run(args):
    cfg = config_from_args(args)
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
    device = device_from_args(args)
    peak_tflops = args.peak_tflops if args.peak_tflops is not None else \
        CUDA_PEAK_TFLOPS if device.type == "cuda" else None  # a CPU has no datasheet peak: no MFU/HFU unless given
    check_fits(cfg, device, args.batch, args.seq, policy)
    task = MarkovTask(cfg.vocab, seed=args.seed)
    print(f"training {cfg.num_params():,} parameters on {device} ({cfg.dtype}), policy {policy.text}, "
          f"batch {args.batch} x {args.seq} tokens; loss starts near ln(vocab) = "
          f"{math.log(cfg.vocab):.3f}, the task's floor is ln({task.branching}) = {task.loss_floor:.3f}")
    params = init_params(cfg, seed=args.seed, device=device)
    losses = train(params, cfg, task, args.steps, args.batch, args.seq, policy, args.lr, device,
                   every=args.log_every, seed=args.seed, watch_live=args.watch_live, peak_tflops=peak_tflops)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps")

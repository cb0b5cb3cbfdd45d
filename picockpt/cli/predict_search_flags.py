"""predict --search's flags, and the one-line refusals of what the search would ignore or price as something else,
before any work (predict_search.py runs the search).

A flag left out stands for the GPU's own: --hardware h100; --kernels the published rates where that GPU has a
published table (picockpt/planning/kernel_rates.py), else every kernel at the datasheet's rate (the roofline), and
the header says which; --gpu-gib the memory its driver reports (predict_parallel.gpu_gib).
"""
from dataclasses import replace

from ..model.config import DTYPES
from ..planning.cost import DEFAULT_HARDWARE, HARDWARE, hardware
from ..planning.frameworks import FRAMEWORKS
from ..planning.kernel_rates import ATTENTION_KERNELS, from_json, published
from ..planning.published import GIB
from .predict_parallel import gpu_bytes, gpu_gib, hardware_name

CHOSEN = ("--tp", "tp", 1), ("--sp", "sp", False), ("--cp", "cp", 1), ("--pp", "pp", 1), ("--dp", "dp", 1), \
    ("--zero", "zero", None), ("--microbatches", "microbatches", None), ("--recompute", "recompute", "none"), \
    ("--batch", "batch", 1), ("--distribute-saved", "distribute_saved", False), ("--schedule", "schedule", "1f1b"), \
    ("--virtual-stages", "virtual_stages", 1)
PRICED = ("--cp-comm", "cp_comm", "ring", "each layer's K/V all-gathered over the cp ranks"), \
    ("--keep-kv", "keep_kv", False, "the gathered K/V not kept (gathered again in the backward)"), \
    ("--attention", "attention", (None, "fused"), "attention as a flash kernel (fused)")  # what the search prices
SEARCH_ONLY = ("--gpus", "gpus", None), ("--tokens-per-batch", "tokens_per_batch", None), ("--top", "top", 10), \
    ("--framework", "framework", "any"), ("--hardware", "hardware", None), ("--kernels", "kernels", None), \
    ("--attention-kernel", "attention_kernel", None)  # (flag, name, its value when left out)
# The rates the search prices at are dense 16-bit tensor-core matmuls (hardware.py), and every activation 2 bytes:
# bf16 and fp16 alike (the H100, H200 and A100 run both at the same rate); fp32 would run at another rate entirely.
SEARCH_DTYPES = ("bfloat16", "float16")


def add_search_arguments(parser):
    group = parser.add_argument_group("layout search (--search)")
    group.add_argument("--search", action="store_true",
                       help="rank every tp x cp x pp x dp layout of --gpus GPUs, ZeRO stage, pipeline schedule and "
                            "recompute policy whose every rank fits --gpu-gib, by modelled step time")
    group.add_argument("--gpus", type=int, help="--search: GPUs in the job, e.g. 16384")
    group.add_argument("--tokens-per-batch", help="--search: tokens a step, a whole number of --seq sequences; "
                                                  "K, M, G are powers of two (16M = 2,048 x 8,192)")
    group.add_argument("--hardware", choices=tuple(HARDWARE), default=None,
                       help=f"--search: the GPU's datasheet rates and memory (default {DEFAULT_HARDWARE}; 8 a node, "
                            f"NVLink inside, one InfiniBand port a GPU between nodes)")
    group.add_argument("--framework", choices=tuple(FRAMEWORKS), default="any",
                       help="--search: only the schedules, ZeRO stages, recompute policies and tensor parallelism "
                            "this framework has (picockpt/planning/frameworks.py names each one's source); default any")
    group.add_argument("--kernels", default=None, metavar="published|peak|FILE",
                       help="--search: how fast each matmul and attention kernel runs: published (the H100's "
                            "measured matmul ceiling and attention benchmarks, picockpt/planning/kernel_rates.py "
                            "names them; the H200 shares them, the A100 has none), peak (every kernel at the "
                            "datasheet's rate: the roofline), or a JSON table lessons/kernel_rates.py measured; "
                            "default: published where the --hardware has them, else peak")
    group.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default=None,
                       help="--search with the published rates: whose attention rates (cudnn, what sdpa picks on "
                            "Hopper; flash2; flash3); default cudnn")
    group.add_argument("--top", type=int, default=10,
                       help="--search: the fastest distinct tp x cp x pp x dp splits printed, each by its best "
                            "variant (default 10; --json too)")


def check_search_flags(args):
    """--search chooses the layout: a layout flag beside it is refused, naming it; the search's flags need it."""
    if not args.search:
        given = [flag for flag, name, left_out in SEARCH_ONLY if getattr(args, name) != left_out]
        it = "it" if len(given) == 1 else "them"
        if given:
            raise ValueError(f"{', '.join(given)}: only --search reads {it}; add --search, or leave {it} out")
        return
    chosen = [flag for flag, name, default in CHOSEN if getattr(args, name) != default]
    it = "it" if len(chosen) == 1 else "them"
    if chosen:
        raise ValueError(f"{', '.join(chosen)} with --search: the search chooses {it} for every layout it ranks; leave "
                         f"{it} out (give --gpus, --tokens-per-batch, --seq, --gpu-gib)")
    for flag, name, default, priced in PRICED:  # not chosen, and not read either: the search prices one way
        value = getattr(args, name)
        if value not in (default if isinstance(default, tuple) else (default,)):
            given = flag if value is True else f"{flag} {value}"
            raise ValueError(f"{given} with --search: the search prices {priced} in every layout; leave {flag} "
                             f"out")
    for flag, name in (("--gpus", "gpus"), ("--tokens-per-batch", "tokens_per_batch")):
        if getattr(args, name) is None:
            raise ValueError(f"--search needs {flag}, e.g. --gpus 16384 --tokens-per-batch 16M")
    if args.top < 1:
        raise ValueError(f"--top={args.top}: print at least one layout, e.g. --top 10")
    if DTYPES[args.dtype] not in SEARCH_DTYPES:
        raise ValueError(f"--dtype {args.dtype} with --search: the search prices every matmul at the GPU's dense "
                         f"16-bit tensor-core rate and every activation at 2 bytes; use --dtype bf16 (the default) or "
                         f"fp16, or leave --dtype out")
    _check_memory(args)
    _check_kernels(args)


def _check_memory(args):
    """--gpu-gib: a positive finite size, and no more than the --hardware's GPU holds."""
    hw, capacity = HARDWARE[hardware_name(args)], gpu_bytes(gpu_gib(args))
    if capacity > hw.capacity:
        most, reported = f"{hw.capacity / GIB:g}", f"{hw.reported / GIB:.2f}"
        raise ValueError(f"--gpu-gib {args.gpu_gib:g} with --hardware {hw.name}: an {hw.name} holds {most} GiB (its "
                         f"datasheet's {most} GB, in binary gigabytes), and its driver reports {reported} GiB of it; "
                         f"give --gpu-gib {most} or less, or leave --gpu-gib out for {reported}")


def _check_kernels(args):
    """--kernels published needs the --hardware's published table; --attention-kernel chooses among its rows."""
    name = hardware_name(args)
    table = published(name) is not None
    if args.kernels == "published" and not table:
        raise ValueError(f"--kernels published with --hardware {name}: picockpt has no published kernel rates for "
                         f"the {name} (only the H100's, which the H200 shares); use --kernels peak (the roofline) or "
                         f"--kernels FILE, a table lessons/kernel_rates.py measured on an {name}")
    if args.attention_kernel is not None and (args.kernels not in (None, "published") or not table):
        given = f"--kernels {args.kernels}" if args.kernels is not None else f"--hardware {name}"
        none = "" if args.kernels is not None else f", and the {name} has none"
        raise ValueError(f"--attention-kernel {args.attention_kernel} with {given}: only the published rates have a "
                         f"choice of attention kernel{none}; leave --attention-kernel out")


def kernel_hardware(args):
    """The --hardware with the kernel rates --kernels names (hw.kernels None: the roofline); --kernels left out, the
    published rates where the GPU has them, else the roofline (kernels_line says why)."""
    hw = hardware(hardware_name(args))
    if args.kernels == "peak":
        return replace(hw, kernels=None)
    if args.kernels in (None, "published"):
        return replace(hw, kernels=published(hw.name, args.attention_kernel or "cudnn"))
    return replace(hw, kernels=from_json(args.kernels))

"""What every command shares: the shape flags, the device flag, numbers with units, tables and text reports."""
import json

from ..model.config import ATTENTIONS, DTYPES, PRESETS, Config

SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_seq", "dropout", "dtype", "attention",
               "attention_tile", "loss_chunk", "experts", "experts_per_token", "shared_expert_ffn", "router_jitter")


def add_shape_args(parser, preset="small", batch=4, seq=128, dtype=None, batch_help="sequences per batch"):
    group = parser.add_argument_group("model and batch shape")
    group.add_argument("--preset", default=preset, choices=list(PRESETS),
                       help=f"starting shape (default {preset}); the flags below override it")
    group.add_argument("--layers", type=int, help="number of decoder layers L")
    group.add_argument("--hidden", type=int, help="hidden size h")
    group.add_argument("--heads", type=int, help="attention heads H")
    group.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention when < heads)")
    group.add_argument("--ffn", type=int, help="SwiGLU intermediate size")
    group.add_argument("--vocab", type=int, help="vocabulary size")
    group.add_argument("--max-seq", type=int, help="longest sequence the rotary table covers")
    group.add_argument("--dropout", type=float, help="dropout on attention probabilities and residual branches")
    group.add_argument("--dtype", choices=sorted(set(DTYPES)), default=dtype,  # None: the preset's (fp32)
                       help=f"activation dtype; bf16/fp16 keep fp32 master weights (default {dtype or 'fp32'})")
    group.add_argument("--attention", choices=ATTENTIONS,
                       help="eager: materialise the T x T probabilities (default); tiled: FlashAttention-2 written "
                            "out in PyTorch (stores one log-sum-exp per row, recomputes the probabilities tile by "
                            "tile); fused: torch's own flash kernels. Under tiled/fused `selective` drops nothing.")
    group.add_argument("--attention-tile", type=int, help="tiled: query/key rows per tile (default 128)")
    group.add_argument("--loss-chunk", type=int,
                       help="tokens per chunk of the LM head and loss; each chunk's logits are recomputed in the "
                            "backward, so the (B*T, V) logits never exist whole (default 0: no chunking)")
    group.add_argument("--experts", type=int,
                       help="routed experts per layer: a Mixtral-style mixture of experts in place of the MLP "
                            "(default 0: the dense MLP); --ffn is then each expert's width")
    group.add_argument("--experts-per-token", type=int, help="top-k: experts each token is routed to (default 2)")
    group.add_argument("--shared-expert-ffn", type=int,
                       help="width of an always-on shared expert beside the routed ones (default 0: none)")
    group.add_argument("--router-jitter", type=float,
                       help="the MoE input times U(1 - j, 1 + j) noise in training, as Mixtral's router_jitter_noise "
                            "(default 0)")
    group.add_argument("--seq", type=int, default=seq, help=f"tokens per sequence (default {seq})")
    group.add_argument("--batch", type=int, default=batch, help=f"{batch_help} (default {batch})")
    return group


def add_run_args(parser):
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights, data and dropout (default 0)")


def add_lesson_args(parser, device, helps):
    """--only, --device, --threads (check_threads checks it) with `helps`: the flags of reproduce and notebooks."""
    parser.add_argument("--only", metavar="NN[,NN]", help=helps[0])
    parser.add_argument("--device", default=device, help=helps[1])
    parser.add_argument("--threads", type=int, default=1, help=helps[2])


def check_threads(args):
    if args.threads < 1:
        raise ValueError(f"--threads={args.threads}: use 1 or more")


def config_from_args(args):
    overrides = {name: getattr(args, name) for name in SHAPE_FLAGS if getattr(args, name, None) is not None}
    cfg = Config.from_preset(args.preset, **overrides)
    if getattr(args, "attention_tile", None) is not None and cfg.attention != "tiled":
        raise ValueError(f"--attention-tile={args.attention_tile} with --attention {cfg.attention}: only tiled "
                         f"attention works in tiles; add --attention tiled, or leave --attention-tile out")
    if args.seq > cfg.max_seq and args.max_seq is None:
        cfg = cfg.replace(max_seq=args.seq)  # a longer rotary table costs nothing
    cfg.check_seq(args.seq)
    if args.batch <= 0:
        raise ValueError(f"batch={args.batch}: must be a positive integer")
    seed = getattr(args, "seed", 0)
    if not 0 <= seed <= 2**63 - 2:  # torch seeds are 64-bit; the synthetic task also draws from seed + 1
        raise ValueError(f"--seed={seed}: use a whole number from 0 to 2**63 - 2")
    return cfg


def check_repeats(args):
    """--repeats: how many timed steps a median is taken over; at least one."""
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats}: time at least one step (e.g. --repeats 3)")


def fmt_bytes(n):
    """Bytes with a binary unit: 1536 -> '1.50 KiB'."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def fmt_flops(n):
    return "-" if n is None else f"{n / 1e9:.3f} GFLOP"


def report(args, row, header, lines, widths):
    """--json: print the row, and True; else the header and the (name, value, note) lines in columns `widths`."""
    print(json.dumps(row, indent=1) if args.json else "\n".join(
        [header] + [f"  {name:<{widths[0]}}{value:>{widths[1]}}  {note}" for name, value, note in lines]))
    return args.json


def table(rows, columns):
    """rows: list of dicts; columns: list of (header, function of row -> str)."""
    cells = [[header for header, _ in columns]] + [[fn(row) for _, fn in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


PHASES = ("forward", "recompute", "backward")


def rank_columns(*first, phases=True):
    """The per-rank table's columns for the parallel commands: `first` (name, value of a rank report), then the stored
    peak and its closed form, the live peak and (phases) communication and FLOPs by phase."""
    columns = [("rank", lambda r: str(r["rank"])), *first,
               ("stored peak", lambda r: f"{r['peak_activation_bytes']:,} B"),
               ("predicted", lambda r: f"{r['predicted_activation_bytes']:,} B"),
               ("live peak", lambda r: fmt_bytes(r["peak_live_bytes"]))]
    if not phases:
        return columns
    columns += [(f"comm {phase}", lambda r, phase=phase: fmt_bytes(r["comm_bytes"][phase])) for phase in PHASES]
    return columns + [(phase, lambda r, phase=phase: fmt_flops(r["flops"][phase])) for phase in PHASES]


def spans(labels):
    """{k: label} -> '0-6 input, 7 all:cheap': consecutive keys with one label grouped ('' labels: '1-3, 7')."""
    groups = []
    for k in sorted(labels):
        if groups and groups[-1][2] == labels[k] and groups[-1][1] == k - 1:
            groups[-1][1] = k
        else:
            groups.append([k, k, labels[k]])
    return ", ".join((f"{a}-{b}" if b > a else f"{a}") + (f" {label}" if label else "") for a, b, label in groups)

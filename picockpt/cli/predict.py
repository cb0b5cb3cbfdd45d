"""python -m picockpt predict: activation memory from the formulas, for shapes too big to run here.

In the published convention (Korthikanti et al. 2022: 16-bit activations, 1-byte dropout masks),
per layer sbh(34 + 5as/h) and its tensor-parallel, sequence-parallel, selective and full
variants, and the model total L x per layer + the s*b*h-byte embedding dropout mask, as the
Ultra-Scale Playbook charts it. Beside them, picockpt's own exact figure for the same shape
(grouped-query attention, SwiGLU, RMSNorm, no dropout, bfloat16 unless --dtype says otherwise),
which its tracker matches to the byte on shapes that do run.

    python -m picockpt predict --model llama3-8b --seq 4096 --recompute selective
    python -m picockpt predict --model llama3-70b --seq 8192 --tp 8 --sp --json
"""
import argparse
import json

from ..config import PRESETS
from ..formulas import GIB, RECOMPUTE, korthikanti_flops, korthikanti_layer_bytes, playbook_activation_bytes
from ..inventory import chain_sizes, layer_inventory, predicted_peak_bytes, step_flops, total
from ..policy import SELECTIVE
from .common import add_shape_args, config_from_args

POLICY_OF = {"none": "none", "selective": "selective", "full": "full"}  # --recompute -> picockpt policy


def add_arguments(parser):
    add_shape_args(parser, preset="llama3-8b", batch=1, seq=4096)
    parser.add_argument("--model", dest="preset", default=argparse.SUPPRESS,
                        help="the shape to start from: llama3-8b (default), llama3-70b, llama3-405b, "
                             "or a picockpt preset; the shape flags override it (same as --preset)")
    parser.add_argument("--recompute", default="none", help="none (default), selective or full (any case)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size t (default 1)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism; needs --tp t > 1")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args):
    if args.preset not in PRESETS:
        raise ValueError(f"--model={args.preset!r} is unknown: use one of {', '.join(PRESETS)}")
    recompute = args.recompute.strip().lower()  # any case, as --policy takes it
    if recompute not in RECOMPUTE:
        raise ValueError(f"--recompute={args.recompute!r}: use one of {', '.join(RECOMPUTE)}")
    cfg = config_from_args(args)
    if args.dtype is None:
        cfg = cfg.replace(dtype="bfloat16")  # the published convention: 16-bit activations
    _check_tp(args.tp, cfg)
    if args.sp and args.tp == 1:
        raise ValueError("--sp with --tp 1: sequence parallelism splits the sequence over the tensor-parallel "
                         "ranks (the tensors that tensor parallelism leaves whole), so it needs --tp t > 1, "
                         "e.g. --tp 8 --sp; with one rank leave --sp out")
    args.recompute = recompute
    row = predict(cfg, args.batch, args.seq, args.recompute, args.tp, args.sp)
    row["model"] = args.preset
    if args.json:
        print(json.dumps(row, indent=1))
        return
    _print_table(row)


def predict(cfg, batch, seq, recompute="none", tp=1, sp=False):
    """One dict: the published per-layer and model bytes, and picockpt's exact ones (t = 1)."""
    s, b, h, a, L = seq, batch, cfg.hidden, cfg.heads, cfg.layers
    per_layer = korthikanti_layer_bytes(s, b, h, a, tp, sp, recompute)
    activations = playbook_activation_bytes(L, s, b, h, a, recompute, tp, sp)
    policy = POLICY_OF[recompute]
    drop = SELECTIVE if recompute == "selective" else frozenset()
    X, A, F = chain_sizes(cfg, batch, seq, drop)
    own_layer = X if recompute == "full" else total(layer_inventory(cfg, batch, seq, drop))
    own_peak = predicted_peak_bytes(cfg, batch, seq, policy)
    published_flops = korthikanti_flops(L, s, b, h, cfg.vocab, recompute)
    own_flops = step_flops(cfg, batch, seq, policy)
    return {
        "layers": L, "hidden": h, "heads": a, "kv_heads": cfg.kv_heads, "ffn": cfg.ffn, "vocab": cfg.vocab,
        "seq": s, "batch": b, "recompute": recompute, "tp": tp, "sp": sp,
        "formula": _formula_text(recompute, tp, sp),
        "per_layer_bytes": per_layer, "per_layer_gib": per_layer / GIB,
        "embedding_dropout_bytes": activations - L * per_layer,
        "activation_bytes": activations, "activation_gib": activations / GIB,
        "picockpt_dtype": cfg.dtype, "picockpt_dropout": cfg.dropout,
        "picockpt_per_layer_bytes": own_layer, "picockpt_per_layer_gib": own_layer / GIB,
        "picockpt_head_bytes": F,
        "picockpt_peak_bytes": own_peak, "picockpt_peak_gib": own_peak / GIB,
        "published_flops": published_flops, "picockpt_flops": own_flops,
    }


def _formula_text(recompute, tp, sp):
    if recompute == "full":
        return "sbh*2/t" if sp and tp > 1 else "sbh*2"
    core = "" if recompute == "selective" else " + 5as/h" if tp == 1 else " + 5as/(ht)"
    if tp == 1:
        return f"sbh(34{core})"
    return f"sbh(34/t{core})" if sp else f"sbh(10 + 24/t{core})"


def _check_tp(tp, cfg):
    divisors = [t for t in range(1, cfg.heads + 1) if cfg.heads % t == 0]
    if tp not in divisors:
        raise ValueError(f"--tp={tp}: the tensor-parallel size must divide the {cfg.heads} attention heads "
                         f"(each device computes whole heads); use one of {', '.join(map(str, divisors))}")


def _gib(n):
    return f"{n / GIB:,.2f} GiB"


def _print_table(row):
    parallel = f"t={row['tp']}" + (", sequence parallel" if row["sp"] else "")
    print(f"{row['model']}: L={row['layers']} h={row['hidden']} a={row['heads']} (kv {row['kv_heads']}) "
          f"f={row['ffn']} V={row['vocab']}; s={row['seq']} b={row['batch']}; recompute {row['recompute']}; "
          f"{parallel}")
    print("Korthikanti et al. 2022, Table 2 (16-bit activations, 1-byte dropout masks), per device:")
    print(f"  per_layer_bytes      {row['per_layer_bytes']:>22,.0f}  {_gib(row['per_layer_bytes']):>14}   "
          f"{row['formula']}")
    print(f"  activation_bytes     {row['activation_bytes']:>22,.0f}  {_gib(row['activation_bytes']):>14}   "
          f"L x per layer + {row['embedding_dropout_bytes']:,.0f} (embedding dropout mask), as the "
          f"Ultra-Scale Playbook charts it")
    print(f"picockpt's exact store ({row['picockpt_dtype']}, GQA, SwiGLU, RMSNorm, dropout "
          f"{row['picockpt_dropout']}; one device, no tensor parallelism):")
    print(f"  per layer            {row['picockpt_per_layer_bytes']:>22,}  "
          f"{_gib(row['picockpt_per_layer_bytes']):>14}   "
          f"{'the layer input (checkpoint)' if row['recompute'] == 'full' else 'what one stored layer keeps'}")
    print(f"  peak of the store    {row['picockpt_peak_bytes']:>22,}  {_gib(row['picockpt_peak_bytes']):>14}   "
          f"with final norm and logits ({_gib(row['picockpt_head_bytes'])})"
          + (" and one recomputed layer" if row["recompute"] == "full" else ""))
    own, published = row["picockpt_flops"], row["published_flops"]
    print(f"FLOPs per step: picockpt forward {own['forward']:.3e}, backward {own['backward']:.3e}, "
          f"recompute {own['recompute']:.3e} (+{own['recompute'] / (own['forward'] + own['backward']):.1%}); "
          f"GPT-shape formula (f = 4h, no GQA) recompute +"
          f"{published['recompute'] / (published['forward'] + published['backward']):.1%}")

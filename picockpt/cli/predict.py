"""python -m picockpt predict: activation memory from the formulas, for shapes too big to run here.

In the published convention (Korthikanti et al. 2022: 16-bit activations, 1-byte dropout masks), per layer
sbh(34 + 5as/h) and its tensor-parallel, sequence-parallel, selective and full variants, and the model total L x per
layer + the s*b*h-byte embedding dropout mask, as the Ultra-Scale Playbook charts it. Beside them, picockpt's own exact
figure for the same shape (grouped-query attention, SwiGLU, RMSNorm, no dropout, bfloat16 unless --dtype says
otherwise), which its tracker matches to the byte on shapes that do run.

    python -m picockpt predict --model llama3-8b --seq 4096 --recompute selective
    python -m picockpt predict --model llama3-70b --seq 8192 --tp 8 --sp --json
    python -m picockpt predict --model llama3-70b --seq 8192 --zero 3 --dp 8     (predict_parallel.py)
    python -m picockpt predict --search --model llama3-405b --seq 8192 --gpus 16384 --tokens-per-batch 16M
                                                                                 (predict_search.py)
"""
import json

from ..model.config import PRESETS
from ..planning.published import GIB, RECOMPUTE, korthikanti_flops, korthikanti_layer_bytes, playbook_activation_bytes
from ..planning.step_forms import chain_sizes, layer_inventory, predicted_peak_bytes, step_flops, total
from ..parallel.tensor_parallel.tp_forms import (rank_comm_bytes, rank_flops, rank_peak_bytes, rank_sizes,
                                                    replicated_and_split)
from ..parallel.tensor_parallel.tp_shard import check_tensor_parallel
from ..recompute.policy import SELECTIVE
from .common import add_shape_args, config_from_args, fmt_bytes
from .predict_layouts import layouts_for, tp_fits
from .predict_parallel import add_parallel_arguments, add_parallel_rows, check_parallel, print_parallel
from .predict_zero import gib
from .predict_search import run_search
from .predict_search_flags import add_search_arguments, check_search_flags


DEFAULT_MODEL = "llama3-8b"


def add_arguments(parser):
    add_shape_args(parser, preset=DEFAULT_MODEL, batch=1, seq=4096, dtype="bf16",  # the published 16-bit convention
                   batch_help="sequences per rank (a data-parallel rank's own; --pp's micro-batches split it)")
    parser.set_defaults(preset=None)  # left out: DEFAULT_MODEL, once run() knows whether --model was given
    parser.add_argument("--model", default=None,
                        help=f"the shape to start from: {DEFAULT_MODEL} (default), llama3-70b, llama3-405b, "
                             f"or a picockpt preset; the shape flags override it (same as --preset)")
    parser.add_argument("--recompute", default="none", help="none (default), selective or full (any case)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size t (default 1)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism; needs --tp t > 1")
    parser.add_argument("--distribute-saved", action="store_true",
                        help="picockpt's per-rank figures with distributed saved activations (without --sp: each "
                             "rank keeps 1/t of every checkpoint, as Megatron's --distribute-saved-activations)")
    add_parallel_arguments(parser)  # --zero/--dp, --cp (predict_parallel.py)
    add_search_arguments(parser)  # --search and its flags (predict_search_flags.py)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args):
    args.preset = _model(args.model, args.preset)
    if args.preset not in PRESETS:
        raise ValueError(f"--model={args.preset!r} is unknown: use one of {', '.join(PRESETS)}")
    recompute = args.recompute.strip().lower()  # any case, as --policy takes it
    if recompute not in RECOMPUTE:
        raise ValueError(f"--recompute={args.recompute!r}: use one of {', '.join(RECOMPUTE)}")
    check_search_flags(args)
    cfg = config_from_args(args)
    if args.search:
        return run_search(args, cfg)
    _check_tp(args.tp, cfg, args.seq)
    if args.sp and args.tp == 1:
        raise ValueError("--sp with --tp 1: sequence parallelism splits the sequence over the tensor-parallel "
                         "ranks (the tensors that tensor parallelism leaves whole), so it needs --tp t > 1, "
                         "e.g. --tp 8 --sp; with one rank leave --sp out")
    if args.distribute_saved and args.tp == 1:
        raise ValueError("--distribute-saved with --tp 1: it splits each checkpoint over the tensor-parallel ranks, "
                         "so it needs --tp t > 1, e.g. --tp 8 --distribute-saved; with one rank leave it out")
    if args.distribute_saved and args.sp:
        raise ValueError("--distribute-saved with --sp: under sequence parallelism the checkpoints are already split "
                         "over the ranks; use one or the other")
    check_parallel(args, cfg, recompute)
    row = predict(cfg, args.batch, args.seq, recompute, args.tp, args.sp)
    row.update(per_rank(cfg, args.batch, args.seq, recompute, args.tp, args.sp, args.distribute_saved))
    row["model"] = args.preset
    add_parallel_rows(row, args, cfg, recompute)
    if args.json:
        print(json.dumps(row, indent=1))
        return
    _print_table(row)


def predict(cfg, batch, seq, recompute, tp, sp):
    """One dict: the published per-layer and model bytes, and picockpt's exact ones (t = 1; each --recompute word is
    a picockpt policy too)."""
    s, b, h, a, L = seq, batch, cfg.hidden, cfg.heads, cfg.layers
    per_layer = korthikanti_layer_bytes(s, b, h, a, tp, sp, recompute)
    activations = playbook_activation_bytes(L, s, b, h, a, recompute, tp, sp)
    own_layer, F = _single_layer_bytes(cfg, batch, seq, recompute)
    own_peak = predicted_peak_bytes(cfg, batch, seq, recompute)
    return {
        "layers": L, "hidden": h, "heads": a, "kv_heads": cfg.kv_heads, "ffn": cfg.ffn, "vocab": cfg.vocab,
        "experts": cfg.experts, "experts_per_token": cfg.experts_per_token,
        "seq": s, "batch": b, "recompute": recompute, "tp": tp, "sp": sp,
        "formula": _row_formula(recompute, tp, sp and tp > 1, False, full="sbh*2"),
        "per_layer_bytes": per_layer, "per_layer_gib": per_layer / GIB,
        "embedding_dropout_bytes": activations - L * per_layer,
        "activation_bytes": activations, "activation_gib": activations / GIB,
        "picockpt_dtype": cfg.dtype, "picockpt_dropout": cfg.dropout,
        "picockpt_per_layer_bytes": own_layer, "picockpt_per_layer_gib": own_layer / GIB,
        "picockpt_head_bytes": F,
        "picockpt_peak_bytes": own_peak, "picockpt_peak_gib": own_peak / GIB,
        "published_flops": korthikanti_flops(L, s, b, h, cfg.vocab, recompute),
        "picockpt_flops": step_flops(cfg, batch, seq, recompute),
    }


TABLE2 = (  # (row, recompute, tensor parallel?, sp, distributed saved): Korthikanti et al. 2022, Table 2
    ("no parallelism", "none", False, False, False),
    ("tensor parallel", "none", True, False, False),
    ("tensor + sequence parallel", "none", True, True, False),
    ("tensor parallel + selective", "selective", True, False, False),
    ("tensor + sequence parallel + selective", "selective", True, True, False),
    ("full recomputation", "full", True, False, False),
    ("full, sequence parallel", "full", True, True, False),
    ("full, distributed saved activations", "full", True, False, True),
)


def per_rank(cfg, batch, seq, recompute, tp, sp, distribute_saved):
    """Table 2's rows at t = tp, term by term, beside picockpt's exact bytes on one rank of tp; and
    picockpt's per-rank peak, communication and FLOPs for (recompute, tp, sp, distribute_saved)."""
    s, b, h, a = seq, batch, cfg.hidden, cfg.heads
    rows = []
    for name, kind, parallel, row_sp, distributed in TABLE2:
        t = tp if parallel else 1
        if kind == "full":  # the layer input: 2sbh, over t with sp (or when each rank keeps 1/t of it)
            terms = {"input": 2 * s * b * h / (t if row_sp or distributed else 1)}
        else:
            terms = {"replicated": 0 if row_sp else 10 * s * b * h, "split": (34 if row_sp else 24) * s * b * h / t}
            if kind == "none":
                terms["attention core"] = 5 * a * s * s * b / t
        published = sum(terms.values())  # = korthikanti_layer_bytes(s, b, h, a, t, row_sp, kind) (the tests check)
        rows.append({"row": name, "recompute": kind, "t": t, "sp": row_sp, "distribute_saved": distributed,
                     "formula": _row_formula(kind, t, row_sp, distributed), "published_terms": terms,
                     "published_bytes": published, **_own_row(cfg, batch, seq, kind, t, row_sp, distributed)})
    out = {"table2": rows}
    try:
        check_tensor_parallel(cfg, tp, sp, seq, distribute_saved)
    except ValueError as error:
        return {**out, "picockpt_rank_note": str(error) if tp == 1 else f"{error}; {layouts_for(cfg, seq, tp)}"}
    layout = (tp, sp, distribute_saved)
    return {**out, "picockpt_rank_peak_bytes": rank_peak_bytes(cfg, batch, seq, recompute, *layout),
            "picockpt_rank_comm_bytes": rank_comm_bytes(cfg, batch, seq, recompute, *layout),
            "picockpt_rank_flops": rank_flops(cfg, batch, seq, recompute, *layout)}


def _own_row(cfg, batch, seq, kind, t, sp, distributed):
    """picockpt's exact bytes of one layer on one rank for a Table 2 row (None where t cannot split it)."""
    try:
        check_tensor_parallel(cfg, t, sp, seq, distributed)
    except ValueError as error:
        if t == 1:  # one rank holds the whole model (a mixture of experts too): the single-process bytes
            own = _single_layer_bytes(cfg, batch, seq, kind)[0]
            return {"picockpt_bytes": own, "picockpt_replicated_bytes": own}
        return {"picockpt_bytes": None, "picockpt_note": str(error)}
    if kind == "full":
        X, Xc, _, _ = rank_sizes(cfg, batch, seq, t, sp, distributed)
        return {"picockpt_bytes": Xc, "picockpt_replicated_bytes": 0 if sp or distributed else Xc}
    whole, split = replicated_and_split(cfg, batch, seq, t, sp, SELECTIVE if kind == "selective" else frozenset())
    return {"picockpt_bytes": whole + split, "picockpt_replicated_bytes": whole}


def _single_layer_bytes(cfg, batch, seq, kind):
    """(one layer's stored bytes in one process under `kind` (full: its input), the final norm's and logits')."""
    unstored = SELECTIVE if kind == "selective" else frozenset()
    X, _, F = chain_sizes(cfg, batch, seq, unstored)
    return X if kind == "full" else total(layer_inventory(cfg, batch, seq, unstored)), F


def _row_formula(kind, t, sp, distributed, full="2sbh"):
    """Table 2's formula of a row (`full`: how the full-recomputation row writes the layer input)."""
    if kind == "full":
        return f"{full}/t" if sp or distributed else full
    if t == 1 and not sp:
        return "sbh(34 + 5as/h)" if kind == "none" else "sbh(34)"
    core = " + 5as/(ht)" if kind == "none" else ""
    return f"sbh(34/t{core})" if sp else f"sbh(10 + 24/t{core})"


def _model(model, preset):
    """--model, or its other name --preset; DEFAULT_MODEL when both are left out, a refusal when they differ."""
    if model is not None and preset is not None and model != preset:
        raise ValueError(f"--model {model} with --preset {preset}: they are one flag under two names; give one of "
                         f"them, e.g. --model {model}")
    return model or preset or DEFAULT_MODEL


def _check_tp(tp, cfg, seq):
    divisors = ", ".join(str(t) for t in range(1, cfg.heads + 1) if cfg.heads % t == 0 and
                         (cfg.experts or tp_fits(cfg, seq, t)))  # dense: what picockpt's per-rank forms split
    if tp < 1:
        raise ValueError(f"--tp={tp}: give a whole number of tensor-parallel ranks, 1 or more (one of {divisors})")
    if cfg.heads % tp:
        raise ValueError(f"--tp={tp}: the tensor-parallel size must divide the {cfg.heads} attention heads "
                         f"(each device computes whole heads); use one of {divisors}, or for {tp} ranks: "
                         f"{layouts_for(cfg, seq, tp)}")


def _print_table(row):
    parallel = f"t={row['tp']}" + (", sequence parallel" if row["sp"] else "")
    print(f"{row['model']}: L={row['layers']} h={row['hidden']} a={row['heads']} (kv {row['kv_heads']}) "
          f"f={row['ffn']} V={row['vocab']}; s={row['seq']}, batch {row['batch']} per rank (b={row['batch']}); "
          f"recompute {row['recompute']}; {parallel}")
    print("Korthikanti et al. 2022, Table 2 (16-bit activations, 1-byte dropout masks), per device:")
    if row.get("experts"):
        print(f"  (a dense GPT layer's formula, MLP 4h wide: it knows nothing of the {row['experts']} experts, each "
              f"token's activations stored top-k = {row['experts_per_token']} times; picockpt's rows below count them)")
    print(f"  per_layer_bytes      {row['per_layer_bytes']:>22,.0f}  {gib(row['per_layer_bytes']):>14}   "
          f"{row['formula']}")
    print(f"  activation_bytes     {row['activation_bytes']:>22,.0f}  {gib(row['activation_bytes']):>14}   "
          f"L x per layer + {row['embedding_dropout_bytes']:,.0f} (embedding dropout mask), as the "
          f"Ultra-Scale Playbook charts it")
    print(f"picockpt's exact store ({row['picockpt_dtype']}, GQA, SwiGLU, RMSNorm, dropout "
          f"{row['picockpt_dropout']}; one device, no tensor parallelism):")
    print(f"  per layer            {row['picockpt_per_layer_bytes']:>22,}  "
          f"{gib(row['picockpt_per_layer_bytes']):>14}   "
          f"{'the layer input (checkpoint)' if row['recompute'] == 'full' else 'what one stored layer keeps'}")
    print(f"  peak of the store    {row['picockpt_peak_bytes']:>22,}  {gib(row['picockpt_peak_bytes']):>14}   "
          f"with final norm and logits ({gib(row['picockpt_head_bytes'])})"
          + (" and one recomputed layer" if row["recompute"] == "full" else ""))
    _print_table2(row)
    own, published = row["picockpt_flops"], row["published_flops"]
    print(f"FLOPs per step: picockpt forward {own['forward']:.3e}, backward {own['backward']:.3e}, "
          f"recompute {own['recompute']:.3e} (+{own['recompute'] / (own['forward'] + own['backward']):.1%}); "
          f"GPT-shape formula (f = 4h, no GQA) recompute +"
          f"{published['recompute'] / (published['forward'] + published['backward']):.1%}")
    print_parallel(row)


def _print_table2(row):
    t = row["tp"]
    print(f"Table 2's rows at t={t}, bytes of one layer per device, term by term, beside picockpt's exact bytes "
          f"on one of {t} ranks (picockpt/parallel/tensor_parallel/tp_forms.py):")
    print(f"  {'row':<40}{'formula':<27}{'terms: replicated + split by t (+ attention core)':<60}"
          f"{'published':>12}{'picockpt per rank':>19}")
    for entry in row["table2"]:
        terms = " + ".join(f"{name} {fmt_bytes(value)}" for name, value in entry["published_terms"].items())
        own = "-" if entry["picockpt_bytes"] is None else fmt_bytes(entry["picockpt_bytes"])
        print(f"  {entry['row']:<40}{entry['formula']:<27}{terms:<60}{fmt_bytes(entry['published_bytes']):>12}"
              f"{own:>19}")
    if "picockpt_rank_note" in row:
        print(f"picockpt per rank: one rank holds the whole model, as picockpt's exact store above" if t == 1 else
              f"picockpt per rank: not at t={t} ({row['picockpt_rank_note']})")
        return
    layout = f"t={t}" + (", sequence parallel" if row["sp"] else "") + \
        (", distributed saved activations" if row.get("distribute_saved") else "")
    comm = row["picockpt_rank_comm_bytes"]
    print(f"picockpt per rank ({layout}, recompute {row['recompute']}): store peak "
          f"{gib(row['picockpt_rank_peak_bytes'])}; communication forward {fmt_bytes(comm['forward'])}, "
          f"recompute {fmt_bytes(comm['recompute'])}, backward {fmt_bytes(comm['backward'])}")

"""python -m picockpt parallel: one tensor-parallel step (optionally sequence parallel), measured per rank.

Spawns --tp ranks on 127.0.0.1 (gloo on the CPU, NCCL with one GPU per rank), or runs as one of
torchrun's processes, and prints per rank: the activation store's peak and its closed form, the
peak of live bytes, the bytes its collectives moved in each phase (with their closed form), and
its FLOPs by phase; then the loss, and how far the gradients are from the single-process engine's.

    python -m picockpt parallel --tp 2 --sp --policy selective
    python -m picockpt parallel --tp 2 --policy full --distribute-saved --json
    torchrun --nproc-per-node 2 -m picockpt parallel --tp 2
"""
import json
import os

import torch

from ..engine import loss_and_grads as single_loss_and_grads
from ..measure import make_batch
from ..params import init_params
from ..parallel import loss_and_grads, under_torchrun
from ..policy import parse_policy
from .common import add_run_args, add_shape_args, config_from_args, device_from_args, fmt_bytes, fmt_flops, table

PHASES = ("forward", "recompute", "backward")


def add_arguments(parser):
    add_shape_args(parser)
    add_run_args(parser)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks t (default 2); t must divide the "
                        "heads, the kv heads, the ffn and the vocabulary")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism: norms, residual adds and dropout "
                        "on T/t tokens per rank (--seq must be a multiple of --tp)")
    parser.add_argument("--policy", default="full", help="recomputation policy, as everywhere (default full); "
                        "budget:SIZE is per rank")
    parser.add_argument("--distribute-saved", action="store_true", help="without --sp: each rank keeps 1/t of "
                        "every checkpoint (Megatron's --distribute-saved-activations), all-gathered to recompute")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait (default 120)")
    parser.add_argument("--port", type=int, help="spawned ranks: the 127.0.0.1 port to meet on (default: a free one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--trace", action="store_true", help="print every rank's engine events, prefixed by rank")


def run(args):
    cfg = config_from_args(args)
    policy = parse_policy(args.policy, cfg)
    device = device_from_args(args)
    params = init_params(cfg, seed=args.seed, device=device)
    input_ids, targets = make_batch(cfg, args.batch, args.seq, device, args.seed)
    torch.manual_seed(args.seed)  # the dropout masks: the same state for both runs
    loss, grads, ranks = loss_and_grads(params, cfg, input_ids, targets, policy.text, args.tp, args.sp,
                                        args.distribute_saved, device=device.type, timeout_s=args.timeout,
                                        port=args.port, trace=args.trace)
    torch.manual_seed(args.seed)
    single_loss, single_grads = single_loss_and_grads(params, cfg, input_ids, targets, policy.text)
    worst = max(_relative(grads[name], single_grads[name]) for name in single_grads)
    if under_torchrun() and os.environ.get("RANK") != "0":  # every torchrun process ran it; one prints
        return
    row = {"tp": args.tp, "sp": args.sp, "distribute_saved": args.distribute_saved, "policy": policy.text,
           "device": str(device), "dtype": cfg.dtype, "layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
           "kv_heads": cfg.kv_heads, "ffn": cfg.ffn, "vocab": cfg.vocab, "batch": args.batch, "seq": args.seq,
           "loss": loss.item(), "single_process_loss": single_loss.item(), "grad_max_rel_diff_vs_single": worst,
           "ranks": ranks}
    if args.json:
        print(json.dumps(row, indent=1))
        return
    _print_table(row)


def _relative(value, reference):
    """max |value - reference| / max |reference| over one tensor (0 when both are 0)."""
    scale = reference.double().abs().max().item()
    diff = (value.double() - reference.double()).abs().max().item()
    return diff / scale if scale else diff


def _print_table(row):
    layout = f"t={row['tp']}" + (", sequence parallel" if row["sp"] else "") + \
        (", distributed saved activations" if row["distribute_saved"] else "")
    print(f"tensor parallel {layout}, policy {row['policy']} on {row['device']}, {row['dtype']}: L={row['layers']} "
          f"h={row['hidden']} H={row['heads']} KV={row['kv_heads']} f={row['ffn']} V={row['vocab']}, "
          f"batch {row['batch']} x {row['seq']} tokens")
    columns = [("rank", lambda r: str(r["rank"])),
               ("stored peak", lambda r: f"{r['peak_activation_bytes']:,} B"),
               ("predicted", lambda r: f"{r['predicted_activation_bytes']:,} B"),
               ("live peak", lambda r: fmt_bytes(r["peak_live_bytes"]))]
    columns += [(f"comm {phase}", lambda r, phase=phase: fmt_bytes(r["comm_bytes"][phase])) for phase in PHASES]
    columns += [(f"{phase}", lambda r, phase=phase: fmt_flops(r["flops"][phase])) for phase in PHASES]
    print(table(row["ranks"], columns))
    exact = all(r["peak_activation_bytes"] == r["predicted_activation_bytes"] and
                r["comm_bytes"] == r["predicted_comm_bytes"] for r in row["ranks"])
    print(f"stored peaks and communication bytes equal their closed forms (picockpt/parallel/inventory.py): "
          f"{'yes' if exact else 'NO'}")
    first = row["ranks"][0]
    added = first["comm_bytes"]["recompute"]
    print(f"recomputation moves {fmt_bytes(added)} per rank again "
          f"({added / first['comm_bytes']['forward']:.0%} of the forward's communication)" if added else
          "recomputation moves nothing between ranks under this policy")
    print(f"loss {row['loss']:.6f} (single process {row['single_process_loss']:.6f}); gradients against the "
          f"single-process engine: max relative difference {row['grad_max_rel_diff_vs_single']:.3g}")

"""python -m picockpt parallel --ep N: one expert-parallel step, measured per rank.

Spawns --ep ranks on 127.0.0.1 (gloo on the CPU, NCCL with one GPU per rank), or runs as one of
torchrun's processes; rank r holds experts r*E/N .. and sequences r*B/N .. (picockpt/parallel/expert_parallel/ep_model.py).
Prints per rank: the experts it holds, the rows they received, the activation store's peak and its
closed form, the peak of live bytes, the bytes its collectives moved in each phase (with their closed
form) and its FLOPs; then what the other recompute choice would cost on the same routing (predicted),
the loss, and how far the gradients are from the single-process engine's.

    python -m picockpt parallel --ep 2 --experts 4 --policy full
    python -m picockpt parallel --ep 2 --experts 4 --policy full --keep-dispatched --json
"""
import json
import torch

from ..routing import step_routing
from ..parallel.expert_parallel.ep_inventory import ep_comm_bytes, ep_peak_bytes
from ..policy import parse_policy
from .common import check_parallel_fits, config_from_args, fmt_bytes, rank_columns, table
from .parallel_run import measured_step, rank_device

def run_expert(args):
    """--ep N (and --keep-dispatched): the expert-parallel step and its report."""
    if args.sp:
        raise ValueError(f"--sp with --ep {args.ep}: sequence parallelism splits a tensor-parallel rank's tokens, and "
                         f"expert parallelism here has no tensor parallelism; leave --sp out")
    cfg = config_from_args(args)
    policy = parse_policy(args.policy, cfg)
    device = rank_device(args)
    check_parallel_fits(args, cfg, parse_policy("none", cfg), device)  # the reference runs none
    measured = measured_step(args, cfg, policy, device, tp=args.tp, sp=False, distribute_saved=args.distribute_saved,
                             pp=args.pp, microbatches=args.microbatches, dp=args.dp, ep=args.ep,
                             keep_dispatched=args.keep_dispatched)
    if measured is None:
        return
    loss, ranks, single_loss, worst, params, input_ids = measured
    torch.manual_seed(args.seed)
    routing = step_routing(params, cfg, input_ids)  # the single process's, as the closed forms take it
    other = not args.keep_dispatched
    shape = (cfg, args.batch, args.seq, policy.text, args.ep)
    row = {"ep": args.ep, "keep_dispatched": args.keep_dispatched, "policy": policy.text, "device": str(device),
           "dtype": cfg.dtype, "layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
           "kv_heads": cfg.kv_heads, "ffn": cfg.ffn, "vocab": cfg.vocab, "experts": cfg.experts,
           "experts_per_token": cfg.experts_per_token, "batch": args.batch, "seq": args.seq, "routing": routing,
           "loss": loss.item(), "single_process_loss": single_loss.item(), "grad_max_rel_diff_vs_single": worst,
           "ranks": ranks,
           "other_choice": {"keep_dispatched": other,  # predicted on the same routing
                            "ranks": [{"rank": r,
                                       "predicted_activation_bytes": ep_peak_bytes(*shape, r, routing, other),
                                       "predicted_comm_bytes": ep_comm_bytes(*shape, r, routing, other)}
                                      for r in range(args.ep)]}}
    if args.json:
        print(json.dumps(row, indent=1))
        return
    _print_table(row)


def _print_table(row):
    choice = "keeping the dispatched rows" if row["keep_dispatched"] else "dispatching again to recompute"
    print(f"expert parallel ep={row['ep']}, {choice}, policy {row['policy']} on {row['device']}, {row['dtype']}: "
          f"L={row['layers']} h={row['hidden']} E={row['experts']} k={row['experts_per_token']} f={row['ffn']} "
          f"V={row['vocab']}, batch {row['batch']} x {row['seq']} tokens")
    print(table(row["ranks"], rank_columns(("experts", lambda r: f"{r['experts'][0]}..{r['experts'][-1]}"),
                                           ("rows in (per layer)", lambda r: " ".join(map(str, r["received_rows"]))))))
    exact = all(r["peak_activation_bytes"] == r["predicted_activation_bytes"] and
                r["comm_bytes"] == r["predicted_comm_bytes"] and r["flops"] == r["predicted_flops"]
                for r in row["ranks"])
    print(f"stored peaks, communication bytes per phase and FLOPs equal their closed forms "
          f"(picockpt/parallel/expert_parallel/ep_inventory.py): {'yes' if exact else 'NO'}")
    for r, o in zip(row["ranks"], row["other_choice"]["ranks"]):
        added, forward = r["comm_bytes"]["recompute"], r["comm_bytes"]["forward"]
        flag = "with" if row["other_choice"]["keep_dispatched"] else "without"
        print(f"rank {r['rank']}: recomputation moves {fmt_bytes(added)} again ({added / forward:.0%} of the "
              f"forward's); {flag} --keep-dispatched it would move {fmt_bytes(o['predicted_comm_bytes']['recompute'])} "
              f"and store {fmt_bytes(o['predicted_activation_bytes'])} at its peak (predicted, same routing)")
    print(f"loss {row['loss']:.6f} (single process {row['single_process_loss']:.6f}); gradients against the "
          f"single-process engine: max relative difference {row['grad_max_rel_diff_vs_single']:.3g}")

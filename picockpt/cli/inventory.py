"""python -m picockpt inventory: one layer's stored tensors, closed form beside measured."""
import torch

from ..device import resolve_device
from ..planning.fit import check_fits
from ..planning.step_forms import head_inventory, layer_inventory, predicted_peak_bytes, total
from ..measurement.measure import make_batch, measured_inventory
from ..model.routing import step_routing
from ..model.params import init_params
from ..recompute.policy import Policy, parse_policy
from .common import add_run_args, add_shape_args, config_from_args, fmt_bytes


def add_arguments(parser):
    add_shape_args(parser, batch=2, seq=64)
    add_run_args(parser)
    parser.add_argument("--policy", default="none", help="op-level drops to apply (e.g. selective, cheap)")
    parser.add_argument("--layer", type=int, default=0, help="which layer to measure (default 0)")


def run(args):
    cfg = config_from_args(args)
    policy = parse_policy(args.policy, cfg)
    if not 0 <= args.layer < cfg.layers:
        raise ValueError(f"--layer={args.layer}: use 0 .. {cfg.layers - 1}")
    B, T = args.batch, args.seq
    device = resolve_device(args.device)
    op_only = Policy(text=policy.op_level or "none", op_level=policy.op_level)  # every layer stored, the same drops
    check_fits(cfg, device, B, T, op_only, advice="use a smaller --batch or --seq",
               note=" (inventory runs one step that stores every layer, to measure what one layer keeps)",
               optimizer=False)
    counts = None
    if cfg.experts:  # tokens per expert of the layer in the step measured_inventory runs (same weights, batch, seed)
        torch.manual_seed(args.seed)  # as measured_inventory does: router jitter draws alike
        input_ids = make_batch(cfg, B, T, device, args.seed)[0]  # (B, T)
        counts = step_routing(init_params(cfg, seed=args.seed, device=device), cfg, input_ids)[args.layer]
    closed = layer_inventory(cfg, B, T, policy.unstored, counts)
    head = head_inventory(cfg, B, T, policy.unstored)
    measured = measured_inventory(cfg, B, T, op_only, device, args.seed)
    print(f"one stored layer, B={B} T={T} h={cfg.hidden} H={cfg.heads} KV={cfg.kv_heads} f={cfg.ffn} "
          f"{cfg.dtype}, policy {policy.text} (op level: {policy.op_level or 'nothing dropped'})")
    if counts is not None:
        print(f"tokens routed to each expert in layer {args.layer} (this step's routing; the closed form takes it): "
              f"{counts}")
    print(f"{'name':<20}{'shape':<22}{'dtype':<10}{'closed form':>14}{'measured':>14}")
    for rows, layer in ((closed, args.layer), (head, None)):
        for name, (shape, dtype, nbytes) in rows.items():
            got = measured.get((layer, name))
            flag = "" if got == nbytes else "   <- differs"
            print(f"{name:<20}{str(shape):<22}{dtype:<10}{nbytes:>14,}{got if got is not None else '-':>14,}{flag}")
        print(f"{'  total':<52}{total(rows):>14,}  ({fmt_bytes(total(rows))})")
    print(f"peak of the store over a step under {policy.text}: "
          f"{fmt_bytes(predicted_peak_bytes(cfg, B, T, policy))}")

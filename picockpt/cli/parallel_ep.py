"""The expert-parallel section of `python -m picockpt parallel` (printed when --ep N ran, beside any other).

Ep rank r holds experts r*E/N .. and its part of each micro-batch's sequences (picockpt/parallel/expert_parallel/
ep_model.py). Per rank: its experts and the rows they received beside rank_columns' bytes and FLOPs; then what the
other recompute choice would cost on the same routing (predicted).

    python -m picockpt parallel --ep 2 --experts 4 --policy full
    python -m picockpt parallel --ep 2 --experts 4 --policy full --keep-dispatched --json
    python -m picockpt parallel --ep 2 --dp 2 --experts 4 --batch 4 --policy full     # 4 ranks
"""
import torch

from ..parallel.report_forms import predicted
from ..parallel.job import ParallelJob
from ..parallel.layout import Layout
from ..model.routing import step_routing
from .common import fmt_bytes, rank_columns, table
from .parallel_run import layout_of


def expert_row(args, cfg, policy, measured):
    """The expert-parallel keys of the command's row: the single process's routing, and what the other recompute
    choice (--keep-dispatched or not) would store and move on the same routing (predicted)."""
    _, ranks, _, _, params, input_ids = measured
    torch.manual_seed(args.seed)
    routing = step_routing(params, cfg, input_ids)  # the single process's, as the closed forms take it
    torch.manual_seed(args.seed)
    by_rows = step_routing(params, cfg, input_ids, ranks=args.dp * args.microbatches * args.ep)
    layout = Layout(**{**layout_of(args), "keep_dispatched": not args.keep_dispatched})  # on the same routing
    other = ParallelJob(params, cfg, input_ids, input_ids, policy, layout, rng_state=torch.get_rng_state())
    return {"routing": routing,
            "other_choice": {"keep_dispatched": layout.keep_dispatched,  # predicted on the same routing
                             "ranks": [{"rank": r["rank"], **{key: forms[key] for key in (
                                 "predicted_activation_bytes", "predicted_comm_bytes")}}
                                 for r in ranks for forms in [predicted(other, r, by_rows)]]}}


def print_expert(row):
    again = "the dispatched rows kept" if row["keep_dispatched"] else "dispatching again to recompute"
    print(f"expert parallel, {again}: E={row['experts']} k={row['experts_per_token']}")
    where = [("stage", lambda r: str(r["stage"]))] if row["pp"] > 1 else []
    where += [("dp", lambda r: str(r["dp_rank"]))] if row["dp"] > 1 else []
    print(table(row["ranks"], rank_columns(*where, ("experts", lambda r: f"{r['experts'][0]}..{r['experts'][-1]}"),
                                           ("rows in (per layer)", lambda r: " ".join(map(str, r["received_rows"]))))))
    exact = all(r["peak_activation_bytes"] == r["predicted_activation_bytes"] and
                r["comm_bytes"] == r["predicted_comm_bytes"] and r["flops"] == r["predicted_flops"]
                for r in row["ranks"])
    print(f"stored peaks, communication bytes per phase and FLOPs equal their closed forms "
          f"(picockpt/parallel/expert_parallel/ep_forms.py): {'yes' if exact else 'NO'}")
    for r, o in zip(row["ranks"], row["other_choice"]["ranks"]):
        added, forward = r["comm_bytes"]["recompute"], r["comm_bytes"]["forward"]
        flag = "with" if row["other_choice"]["keep_dispatched"] else "without"
        print(f"rank {r['rank']}: recomputation moves {fmt_bytes(added)} again ({added / forward:.0%} of the "
              f"forward's); {flag} --keep-dispatched it would move {fmt_bytes(o['predicted_comm_bytes']['recompute'])} "
              f"and store {fmt_bytes(o['predicted_activation_bytes'])} at its peak (predicted, same routing)")

"""python -m picockpt parallel --dp N --zero S: one ZeRO step over N data-parallel ranks, measured per rank.

Spawns --dp ranks on 127.0.0.1 (gloo on the CPU, NCCL with one GPU per rank), or runs as one of torchrun's
processes, and runs one step: forward, backward and AdamW on the shards. Prints per rank the bytes it
holds of parameters, gradients and AdamW state, its activation
store's peak and the gathered parameters' peak, each beside its closed form
(picockpt/parallel/data_parallel/zero_inventory.py), and the bytes its all-gathers and reductions moved per
phase: under stage 3 a recomputed layer's parameters are gathered again, unless --keep-gathered keeps its
recompute's gather for its backward. Then the loss, and the gradients against the single-process engine's.

    python -m picockpt parallel --dp 2 --zero 3 --policy full
    python -m picockpt parallel --dp 2 --zero 3 --policy full --keep-gathered --json
"""
from .common import fmt_bytes, table
from .parallel_run import measured_step, prepared, printed

PHASES = ("forward", "recompute", "backward")


def run_zero(args):
    """--zero (with --dp, --keep-gathered, --no-prefetch): the ZeRO step and its report."""
    cfg, policy, device = prepared(args)  # a step that cannot fit is refused here
    measured = measured_step(args, cfg, policy, device)  # one AdamW step on the shards (optimizer_step)
    if measured is not None:
        printed(args, cfg, policy, device, {}, measured, _print_table)


def _print_table(row):
    choice = ", keeping a recomputed layer's gather for its backward" if row["keep_gathered"] else ""
    print(f"ZeRO stage {row['zero']} over dp={row['dp']}{choice}{'' if row['prefetch'] else ', no prefetch'}, "
          f"policy {row['policy']} on {row['device']}, {row['dtype']}: L={row['layers']} h={row['hidden']} "
          f"V={row['vocab']}, batch {row['batch']} x {row['seq']} tokens")
    print_ranks(row["ranks"])
    first = row["ranks"][0]["comm_bytes"]
    if row["zero"] == 3:
        print(f"recomputation gathers {fmt_bytes(first['recompute'])} of parameters again; the backward gathers "
              f"{fmt_bytes(row['ranks'][0]['comm_bytes_by_kind']['backward'].get('all_gather', 0))}"
              f"{' (a recomputed layer keeps its gather: none again)' if row['keep_gathered'] else ''}")
    print(f"loss {row['loss']:.6f} (single process {row['single_process_loss']:.6f}); gradients against the "
          f"single-process engine: max relative difference {row['grad_max_rel_diff_vs_single']:.3g}")


def print_ranks(ranks):
    """Every rank's model state (parameters, gradients, AdamW state), stored and gathered peaks and bytes moved
    per phase, each beside its closed form where they differ, and whether all of them are equal (also what
    `train --dp --zero` prints after its last step)."""
    columns = [("rank", lambda r: str(r["rank"]))]
    for name, key in (("params", "param_bytes"), ("grads", "grad_bytes"), ("AdamW state", "optimizer_bytes"),
                      ("stored peak", "activation_bytes")):
        measured = "peak_" + key if key == "activation_bytes" else key
        columns.append((name, lambda r, m=measured, k=key: fmt_bytes(r[m]) + (
            "" if r[m] == r["predicted_" + k] else f" (closed form {fmt_bytes(r['predicted_' + k])}, "
                                                   f"{r[m] - r['predicted_' + k]:+,} B)")))
    columns.append(("gathered peak", lambda r: fmt_bytes(max(r["gathered_peak_bytes"].values(), default=0))))
    columns += [(f"moved {phase}", lambda r, phase=phase: fmt_bytes(r["comm_bytes"][phase]))
                for phase in PHASES + ("optimizer",)]
    print(table(ranks, columns))
    exact = all(r[m] == r["predicted_" + k] for r in ranks for k, m in (
        ("param_bytes", "param_bytes"), ("grad_bytes", "grad_bytes"), ("optimizer_bytes", "optimizer_bytes"),
        ("activation_bytes", "peak_activation_bytes"), ("comm_bytes", "comm_bytes"),
        ("gathered_peak_bytes", "gathered_peak_bytes")))
    print(f"model state, stored peaks, gathered peaks and bytes moved per phase equal their closed forms "
          f"(picockpt/parallel/data_parallel/zero_inventory.py): {'yes' if exact else 'NO'}")

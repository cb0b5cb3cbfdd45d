"""What `python -m picockpt parallel --zero S` prints under any layout's own report: ZeRO's table, per rank.

ZeRO runs inside the one rank step (picockpt/parallel/rank.py, data_parallel/zero_shards.py), so --zero stacks on
--dp, --tp, --sp, --pp, --microbatches, --cp and --ep; its shard group is the dp x ep x cp ranks (the experts'
over their dp x cp). Below the layout's table, per rank: the bytes it holds of parameters, gradients and AdamW
state, its activation store's peak and the gathered parameters' peak, and the bytes ZeRO's own all-gathers and
reductions moved per phase, each beside its closed form (picockpt/parallel/data_parallel/zero_forms.py):
under stage 3 a recomputed layer's parameters are gathered again, unless --keep-gathered keeps its recompute's
gather for its backward. The step ends with one AdamW step on the shards.

    python -m picockpt parallel --dp 2 --zero 3 --policy full
    python -m picockpt parallel --dp 2 --zero 3 --policy full --keep-gathered --json
    python -m picockpt parallel --dp 2 --zero 2 --tp 2 --policy full                   # 4 ranks, tp beside
"""
from .common import fmt_bytes, table

PHASES = ("forward", "recompute", "backward", "optimizer")  # ZeRO's collectives: the step's phases and AdamW's
STATE = (("params", "param_bytes", "param_bytes"), ("grads", "grad_bytes", "grad_bytes"),
         ("AdamW state", "optimizer_bytes", "optimizer_bytes"),
         ("stored peak", "peak_activation_bytes", "activation_bytes"))  # (column, measured key, closed form's)


def print_zero(row):
    """ZeRO's part of the command's report: the group it shards over, every rank's table, the gathers."""
    r0 = row["ranks"][0]
    group = " x ".join(f"{name} {row[name]}" for name in ("dp", "ep", "cp") if row[name] > 1)
    choice = {True: ", keeping a recomputed layer's gather for its backward",
              "step": ", every unit gathered once per step"}.get(row["keep_gathered"], "")
    experts = f", the experts' over dp x cp = {row['dp'] * row['cp']}" if row["ep"] > 1 else ""
    print(f"ZeRO stage {row['zero']} over the data-parallel group ({group} = {row['dp'] * row['ep'] * row['cp']} "
          f"ranks{experts}){choice}{'' if row['prefetch'] else ', no prefetch'}, one AdamW step on the shards:")
    print_ranks(row["ranks"])
    if row["zero"] == 3:
        kinds = r0["zero_bytes_by_kind"]
        print(f"rank 0: recomputation gathers {fmt_bytes(kinds['recompute'].get('all_gather', 0))} of parameters "
              f"again; the backward gathers {fmt_bytes(kinds['backward'].get('all_gather', 0))}"
              f"{' (a recomputed layer keeps its gather: none again)' if row['keep_gathered'] else ''}")


def moved(r, phase, predicted=False):
    """Bytes ZeRO's collectives moved on rank r in one phase, every kind together (or their closed form)."""
    return sum(r[("predicted_" if predicted else "") + "zero_bytes_by_kind"][phase].values())


def beside(measured, closed):
    """A count, and its closed form only where the two differ."""
    return fmt_bytes(measured) + ("" if measured == closed else
                                  f" (closed form {fmt_bytes(closed)}, {measured - closed:+,} B)")


def print_ranks(ranks):
    """Every rank's model state (parameters, gradients, AdamW state), stored and gathered peaks and bytes moved
    per phase, each beside its closed form where they differ, and whether all of them are equal (also what
    `train --zero` prints after its last step)."""
    columns = [("rank", lambda r: str(r["rank"]))]
    columns += [(name, lambda r, m=measured, k=key: beside(r[m], r["predicted_" + k])) for name, measured, key in STATE]
    columns.append(("gathered peak", lambda r: beside(max(r["gathered_peak_bytes"].values(), default=0),
                                                      max(r["predicted_gathered_peak_bytes"].values(), default=0))))
    columns += [(f"moved {phase}", lambda r, phase=phase: beside(moved(r, phase), moved(r, phase, True)))
                for phase in PHASES]
    print(table(ranks, columns))
    exact = all(r[measured] == r["predicted_" + key] for r in ranks for _, measured, key in STATE) and \
        all(r[key] == r["predicted_" + key] for r in ranks for key in ("gathered_peak_bytes", "zero_bytes_by_kind",
                                                                       "dp_bytes"))
    print(f"model state, stored peaks, gathered peaks and bytes moved per phase equal their closed forms "
          f"(picockpt/parallel/data_parallel/zero_forms.py): {'yes' if exact else 'NO'}")

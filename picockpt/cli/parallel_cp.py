"""The context-parallel section of `python -m picockpt parallel` (printed when --cp N ran, beside any other).

Rank r holds its chunks of every sequence (zigzag: chunks r and 2N - 1 - r of 2N; contiguous: chunk r of N) and
its share of every activation (picockpt/parallel/context_parallel/). Per rank: its chunks, the K/V bytes its ring
steps or all-gathers moved per phase (under full the recompute phase repeats the forward's, unless --cp-keep-kv
keeps the gathered K/V) and its attention FLOPs (the causal balance), beside rank_columns' stored peak and FLOPs.

    python -m picockpt parallel --cp 2 --attention tiled --policy full
    python -m picockpt parallel --cp 4 --cp-layout contiguous --cp-comm allgather --cp-keep-kv --json
    python -m picockpt parallel --cp 2 --dp 2 --attention tiled --policy full        # beside dp (or --pp 2, --tp 2)
"""
from .common import rank_columns, table


def print_context(row):
    print(f"context parallel, K/V by {row['cp_comm']} ({row['cp_layout']}), {row['attention']} attention:")
    r0 = row["ranks"][0]
    coordinates = (("stage", "stage", "pp"), ("dp rank", "dp_rank", "dp"), ("tp rank", "tp_rank", "tp"))
    where = [(name, lambda r, key=key: str(r[key])) for name, key, size in coordinates if r0[size] > 1]
    print(table(row["ranks"], rank_columns(*where, ("chunks", lambda r: " ".join(map(str, r["chunks"]))),
                                           ("attention FLOPs", lambda r: f"{r['predicted_attention_flops']:,}"))))
    exact = all(r["peak_activation_bytes"] == r["predicted_activation_bytes"] and
                r["comm_bytes"] == r["predicted_comm_bytes"] and r["flops"] == r["predicted_flops"]
                for r in row["ranks"])
    print(f"stored peaks, K/V bytes per phase and FLOPs equal their closed forms "
          f"(picockpt/parallel/context_parallel/cp_forms.py): {'yes' if exact else 'NO'}")
    cp = row["cp"]  # ring or all-gather, one traffic counted one way: what reached the rank
    print(f"K/V bytes count the {cp - 1} block{'s' if cp > 2 else ''} of K/V each rank received from the others "
          f"(ring and all-gather alike; the all-gather's buffer also holds the rank's own block)")
    attention = [r["predicted_attention_flops"] for r in row["ranks"]]  # one matmul per layer, closed form
    print(f"attention FLOPs, busiest rank / mean: {max(attention) * len(attention) / sum(attention):.3f} "
          f"({row['cp_layout']}); recomputation moves {row['ranks'][0]['comm_bytes']['recompute']:,} B of K/V"
          f"{' and tensor-parallel activations' if r0['tp'] > 1 else ''} again per rank")

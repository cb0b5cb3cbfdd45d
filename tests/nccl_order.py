"""The point-to-point order NCCL would run: a check for every pipeline test's recorded groups (Pipe.posted)."""


def nccl_order_completes(posted):
    """Run every rank's posted point-to-point groups as NCCL does: each rank starts its next group only
    when the one before has completed; a group completes when each of its sends has met the matching
    receive on the peer, and each receive the matching send, matched in order per pair of ranks.
    posted: {rank: [[("send" | "recv", peer), ...], ...]}. False if the ranks would hang."""
    at = dict.fromkeys(posted, 0)  # each rank's current group
    done = {rank: set() for rank in posted}  # the (kind, peer, n) ops of its current group that matched
    count = {rank: {} for rank in posted}  # (kind, peer) -> how many such ops this rank has posted so far

    def current(rank):  # the current group's ops, numbered per (kind, peer) in posting order
        seen, ops = dict(count[rank]), []
        for kind, peer in posted[rank][at[rank]] if at[rank] < len(posted[rank]) else []:
            ops.append((kind, peer, seen.get((kind, peer), 0)))
            seen[kind, peer] = seen.get((kind, peer), 0) + 1
        return ops

    moved = True
    while moved:
        moved = False
        for rank in posted:
            for kind, peer, n in current(rank):
                other = "recv" if kind == "send" else "send"
                if (kind, peer, n) not in done[rank] and (other, rank, n) in current(peer):
                    done[rank].add((kind, peer, n))
                    done[peer].add((other, rank, n))
                    moved = True
            if current(rank) and set(current(rank)) <= done[rank]:  # the group completed: the next one starts
                for kind, peer, _ in current(rank):
                    count[rank][kind, peer] = count[rank].get((kind, peer), 0) + 1
                at[rank], done[rank], moved = at[rank] + 1, set(), True
    return all(at[rank] == len(posted[rank]) for rank in posted)

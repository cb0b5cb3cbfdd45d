"""The rank side of lesson 23's all-reduce timing. Spawned ranks import the function they run by name
(picockpt.parallel.run_ranks), so it lives in a module of its own rather than in the lesson's cells."""
import time

import torch
import torch.distributed as dist


def all_reduce_seconds(comm, sizes, repeats):
    """{bytes: [wall seconds of each repeat]} of a sum all-reduce of an fp32 tensor of each size on this rank,
    after one warm-up call; a barrier before each call starts the ranks together."""
    out = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)  # (nbytes / 4,) fp32
        dist.all_reduce(x, group=comm.group)  # warm-up: connections, buffers
        times = []
        for _ in range(repeats):
            dist.barrier(group=comm.group)
            start = time.perf_counter()
            dist.all_reduce(x, group=comm.group)  # x = the sum over ranks, in place
            times.append(time.perf_counter() - start)
        out[nbytes] = times
    return out

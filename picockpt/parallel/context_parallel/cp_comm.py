"""The collectives of context parallelism, as forward/backward pairs (tensor_parallel/tp_comm.py's style). Each rank
holds the keys and values of its own tokens, stacked as one block kv = (k, v): (2, B, KV, n, hd).

    pair          forward                                    backward
    ring          one step of the ring: send kv to rank r+1,  one step back round: kv again and the gradients
                  receive rank r-1's                          summed so far, together, to rank r+1 (kv=None:
                                                              the gradients alone, the last step, home)
    gather_kv     all-gather every rank's kv (Llama 3's       reduce-scatter of the gradients: each rank
                  choice: one collective per layer)           gets the sum over ranks of its own rows'

Why the backward ring goes on forward: at step s rank r uses kv_{r-s}, which came s hops. Instead of sending its
gradient back the s hops it came, the summed gradient rides on with the block the remaining cp-s hops, every rank on
the way adding its own: one message per step, and after the cp-th hop every block's gradient is home.

Every ring step is one batch_isend_irecv, sends first, in the same order on every rank, so each send meets a posted
receive (pipeline_parallel/pp_comm.py says how NCCL hangs otherwise). cp_comm="ring_overlap": ring_post posts the
next hop of kv before the attention of the block held and ring_wait waits after it; the gradient's hop cannot start
early (dkv is still being summed). Bytes are booked as those that reach a rank from the others: "ring_kv" and
"ring_dkv" per step; the all-gather's cp - 1 other blocks, the reduce-scatter's cp - 1 partial gradients (comm.py's
received=True). Gradients travel in the statistics dtype (summed over up to cp ranks), K and V in the activation's.
"""
from collections import namedtuple

import torch
import torch.distributed as dist

from ..comm import all_gather, reduce_scatter

RINGS = ("ring", "ring_overlap")  # the cp_comm values that pass K/V round the ring: one after the other, or overlapped

# a ring step in flight: its works, what it sends (booked as `kinds` when it is done), where it receives
Posted = namedtuple("Posted", "works sent received kinds")


def ring_post(tensors, comm, kinds):
    """Post one ring step, sending each tensor to rank r+1 and receiving as many from rank r-1, as one group;
    returns at once. The sent tensors must not change until ring_wait."""
    W, r = comm.world_size, comm.rank
    if W == 1:  # a ring of one: the block is already home, and nothing moves
        return Posted([], [], list(tensors), kinds)
    to, source = (dist.get_global_rank(comm.group, (r + step) % W) for step in (1, -1))
    sent = [tensor.contiguous() for tensor in tensors]  # no copy for the blocks here: already contiguous
    received = [torch.empty_like(tensor) for tensor in sent]  # filled when the messages land
    ops = [dist.P2POp(dist.isend, tensor, to, comm.group) for tensor in sent]  # sends first, then receives,
    ops += [dist.P2POp(dist.irecv, tensor, source, comm.group) for tensor in received]  # on every rank alike
    return Posted(dist.batch_isend_irecv(ops), sent, received, kinds)


def ring_wait(posted, comm):
    """Wait for a posted ring step and book what it sent: -> the received tensors."""
    for work in posted.works:
        work.wait()
    for tensor, kind in zip(posted.sent, posted.kinds):
        comm.log.record(comm.phase, kind, tensor.nbytes)
    return posted.received


def ring_forward(kv, comm):  # kv (2, B, KV, n, hd) the block held now -> the previous rank's block (2, B, KV, n, hd)
    return ring_wait(ring_post([kv], comm, ["ring_kv"]), comm)[0]


def ring_backward(kv, dkv, comm):
    """dkv, the gradient so far of the block this rank used, rides on with it to rank r+1 (see above): -> (the next
    kv, its gradient so far); kv=None: the gradient alone, the last hop home or the overlapped ring's (ring_post)."""
    if kv is None:
        return ring_wait(ring_post([dkv], comm, ["ring_dkv"]), comm)[0]  # (2, B, KV, n, hd) this rank's own block's
    return tuple(ring_wait(ring_post([kv, dkv], comm, ["ring_kv", "ring_dkv"]), comm))  # (2, B, KV, n, hd) each


def gather_kv_forward(kv, comm):  # kv (2, B, KV, n, hd) this rank's rows -> every rank's in order (2, B, KV, cp*n, hd)
    return all_gather(kv, comm, dim=3, received=True)  # booked: the cp - 1 blocks received


def gather_kv_backward(dkv, comm):
    """Forward was kv_all = cat(kv_0, ..., kv_{cp-1}) along the tokens, the same on every rank, each rank's
    queries reading it. Each rank's gradient of kv_all is partial; kv_r's is slice r of their sum:
        dkv_r = (sum_s dkv_all_s)[slice r]     -> reduce-scatter along the tokens"""
    return reduce_scatter(dkv, comm, dim=3, received=True)  # (2, B, KV, n, hd); booked: cp - 1 partial blocks

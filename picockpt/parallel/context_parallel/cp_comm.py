"""The collectives of context parallelism, as forward/backward pairs (tensor_parallel/tp_comm.py's style).

Each rank holds the keys and values of its own tokens, stacked as one block kv = (k, v): (2, B, KV, n, hd).
Attention needs every earlier token's, so they travel (cp_attention.py says when each is used):

    pair          forward                                    backward
    ring          one step of the ring: send kv to rank r+1,  one step back round: kv again and the gradients
                  receive rank r-1's                          summed so far, together, to rank r+1 (kv=None:
                                                              the gradients alone, the last step, home)
    gather_kv     all-gather every rank's kv (Llama 3's       reduce-scatter of the gradients: each rank
                  choice: one collective per layer)           gets the sum over ranks of its own rows'

Why the backward ring goes on forward. At step s rank r uses kv_{r-s}, which came s hops. Its gradient
belongs to rank r-s; instead of sending each rank's contribution back the s hops it came, the summed
gradient rides on with the block the remaining cp-s hops (r + cp - s = r - s mod cp), every rank on the
way adding its own: one message per step, and after the cp-th hop every block's gradient is home.

NCCL-safe pairing: every ring step is one torch.distributed.batch_isend_irecv, its sends first, then its
receives, in the same order on every rank, so each send meets a posted receive (never a bare send then
recv that only gloo's buffered sockets forgive; pipeline_parallel/pp_comm.py says how NCCL hangs).

Bytes are booked under the tracker's phase (picockpt/parallel/comm.py): "ring_kv" and "ring_dkv", the
bytes this rank passes on per step (it receives as many); the all-gather and reduce-scatter as comm.py
counts them (the gathered output, the full input). Gradients travel in the statistics dtype (fp32 or
wider: summed over up to cp ranks), the keys and values in the activation dtype.
"""
import torch
import torch.distributed as dist

from ..comm import all_gather, reduce_scatter


def _ring_step(tensors, comm, kinds):
    """Send each tensor to rank r+1 and receive as many from rank r-1, as one group."""
    W, r = comm.world_size, comm.rank
    if W == 1:  # a ring of one: the block is already home, and nothing moves
        return list(tensors)
    to, source = (dist.get_global_rank(comm.group, (r + step) % W) for step in (1, -1))
    sent = [tensor.contiguous() for tensor in tensors]  # no copy for the blocks here: already contiguous
    received = [torch.empty_like(tensor) for tensor in sent]  # filled when the messages land
    ops = [dist.P2POp(dist.isend, tensor, to, comm.group) for tensor in sent]  # sends first, then receives,
    ops += [dist.P2POp(dist.irecv, tensor, source, comm.group) for tensor in received]  # on every rank alike
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for tensor, kind in zip(sent, kinds):
        comm.log.record(comm.phase, kind, tensor.nbytes)
    return received


def ring_forward(kv, comm):
    # kv (2, B, KV, n, hd) the block held now -> the previous rank's block (2, B, KV, n, hd)
    return _ring_step([kv], comm, ["ring_kv"])[0]


def ring_backward(kv, dkv, comm):
    """Forward moved kv_{r-1} to rank r; the gradient of the block this rank used (dkv, its sum so far)
    rides on with it to rank r+1 (see above). Returns (the next kv, its gradient so far); kv=None: the
    last step, which brings each block's whole gradient home (returns it alone)."""
    if kv is None:
        return _ring_step([dkv], comm, ["ring_dkv"])[0]  # (2, B, KV, n, hd) this rank's own block's gradient
    kv, dkv = _ring_step([kv, dkv], comm, ["ring_kv", "ring_dkv"])
    return kv, dkv  # (2, B, KV, n, hd) each


def gather_kv_forward(kv, comm):
    # kv (2, B, KV, n, hd) this rank's rows -> every rank's, one after another (2, B, KV, cp*n, hd)
    return all_gather(kv, comm, dim=3)


def gather_kv_backward(dkv, comm):
    """Forward was kv_all = cat(kv_0, ..., kv_{cp-1}) along the tokens, the same on every rank, each rank's
    queries reading it. Each rank's gradient of kv_all is partial; kv_r's is slice r of their sum:
        dkv_r = (sum_s dkv_all_s)[slice r]     -> reduce-scatter along the tokens"""
    return reduce_scatter(dkv, comm, dim=3)  # (2, B, KV, n, hd)

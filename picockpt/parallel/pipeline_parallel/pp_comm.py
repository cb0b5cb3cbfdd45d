"""Point-to-point between pipeline stages: forward/backward pairs (comm.py's style), each backward the adjoint:

    pair                 forward                                 backward
    from_previous_stage  receive x from the previous stage       send dx back to it
    to_next_stage        send y to the next stage                receive dy from it

Why sends are paired: NCCL runs the point-to-point operations between two ranks in the order posted, and a send
completes only once its receive is posted. In 1F1B's steady state stage s sends y_{m+1} then receives dy_m, while stage
s+1 sends dx_m then receives x_{m+1}: posted one by one, each send waits for a receive queued behind the other stage's
send, and both hang (gloo's buffered sockets hide it). So a send is held until the stage's next point-to-point
operation: a receive from the same neighbour goes with it as one group (batch_isend_irecv, as Megatron-LM's
send_forward_recv_backward and send_backward_recv_forward do), both stages posting the send first; anything else posts
it at once. Receives block, but post_receive returns at once: a stage can recompute while its gradient travels
(recompute-early). Bytes per rank and phase, one tensor per call: "send", "receive", "rng_state" (pp_stage.py's
generator state). gloo and NCCL both run isend/irecv; on NCCL every tensor, rng state included, is on the GPU.
"""
import torch
import torch.distributed as dist

from ..comm import Comm, CommLog


class Pipe:
    """This rank's pipeline neighbours (global ranks; None at either end), the log of what it moved, its sends."""

    def __init__(self, previous, next, device, timeline, tracker=None):
        self.previous, self.next, self.log = previous, next, CommLog()
        self.device, self.timeline, self.tracker = torch.device(device), timeline, tracker
        self.in_flight = []  # (work, tensor): a sent tensor lives until its send completes
        self.held = None  # a send not posted yet (a dist.P2POp), paired with the next receive from its peer
        self.pair_with = None  # the peer of this stage's next receive, set by the schedule's loop (parallel/rank.py)
        self.posted = []  # every group in order, [("send" | "recv", peer), ...]: a test can check no order deadlocks

    phase = Comm.phase  # the tracker's phase name, "outside" without one

    def post(self, receive=None):
        """Post the held send and `receive` (P2POp or None), one group if same peer. Returns the receive's work."""
        send, self.held = self.held, None
        if send is not None and (receive is None or receive.peer != send.peer):
            self.group([send])  # not a pair: the send goes on its own
            send = None
        works = self.group([op for op in (send, receive) if op is not None])
        return works[-1] if receive is not None else None

    def group(self, ops):
        if not ops:
            return []
        self.posted.append([("send" if op.op is dist.isend else "recv", op.peer) for op in ops])
        works = dist.batch_isend_irecv(ops)  # one group: NCCL runs its sends and receives together
        self.in_flight = [(work, sent) for work, sent in self.in_flight if not work.is_completed()]  # done ones go
        self.in_flight += [(work, op.tensor) for op, work in zip(ops, works) if op.op is dist.isend]
        return works

    def finish(self):
        """Post the held send, then wait for every send still in flight (the step's last ones)."""
        self.post()
        with self.timeline.span("send"):
            for work, _ in self.in_flight:
                work.wait()
        self.in_flight.clear()


class Receive:
    """A receive started with post_receive; .wait() blocks (a "wait" span) and returns the tensor."""

    def __init__(self, pipe, buffer, work):
        self.pipe, self.buffer, self.work = pipe, buffer, work

    def wait(self):
        with self.pipe.timeline.span("wait"):
            self.work.wait()
        return self.buffer


def _send(x, pipe, to, kind="send"):
    x = x.contiguous()  # (...) no copy for a layer's output or gradient: already contiguous
    pipe.post()  # an earlier held send goes first
    pipe.held = dist.P2POp(dist.isend, x, to)
    if to != pipe.pair_with or kind != "send":  # no receive from `to` comes next: send it now
        pipe.post()
    pipe.log.record(pipe.phase, kind, x.nbytes)


def post_receive(pipe, source, shape, dtype, kind="receive"):
    buffer = torch.empty(shape, dtype=dtype, device=pipe.device)  # (shape) filled when the message lands
    work = pipe.post(dist.P2POp(dist.irecv, buffer, source))  # with the held send to `source`, as one group
    pipe.log.record(pipe.phase, kind, buffer.nbytes)
    return Receive(pipe, buffer, work)


def from_previous_stage_forward(pipe, shape, dtype):
    return post_receive(pipe, pipe.previous, shape, dtype).wait()  # x (shape): the previous stage's y, this one's input


def from_previous_stage_backward(dx, pipe):
    """Forward was x = the previous stage's y, moved here: the identity, so y's gradient is dx, sent back to y."""
    _send(dx, pipe, pipe.previous)


def to_next_stage_forward(y, pipe):
    _send(y, pipe, pipe.next)  # y (shape): this stage's output, the next stage's input


def to_next_stage_backward(pipe, shape, dtype):
    """Forward sent y to the next stage, which computes y's gradient (its from_previous_stage_backward): a Receive."""
    return post_receive(pipe, pipe.next, shape, dtype)


def send_rng_state(state, pipe):
    _send(state.to(pipe.device), pipe, pipe.next, kind="rng_state")  # (n,) uint8


def receive_rng_state(pipe, like):
    return post_receive(pipe, pipe.previous, like.shape, like.dtype, kind="rng_state").wait().cpu()  # (n,) uint8

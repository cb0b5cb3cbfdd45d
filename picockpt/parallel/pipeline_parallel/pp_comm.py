"""Point-to-point between pipeline stages: forward/backward pairs (comm.py's style), each backward the adjoint:

    pair                 forward                                 backward
    from_previous_stage  receive x from the previous stage       send dx back to it
    to_next_stage        send y to the next stage                receive dy from it

Why sends are paired: NCCL runs the point-to-point operations between two ranks in the order posted, and a send
completes only once its receive is posted. In 1F1B's steady state stage s sends y_{m+1} then receives dy_m, while
stage s+1 sends dx_m then receives x_{m+1}: posted one by one, both hang (gloo's buffered sockets hide it). So a
send is held until the stage's next point-to-point operation: a receive from the same neighbour goes with it as one
group (batch_isend_irecv, as Megatron-LM's send_forward_recv_backward does), both stages posting the send first;
anything else posts it at once. post_receive returns at once: a stage can recompute while its gradient travels.

Interleaved, a rank's neighbours are the same two ranks for every chunk, and pairing a send with the next receive no
longer lines the two sides up. There the ranks go step by step as Megatron-LM's interleaved schedule does
(pp_schedules.interleaved_steps): every send of a step is held (stepwise), and at the next step's start one group
posts them with every receive that step will read (exchange).
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
        self.held = []  # sends not posted yet (dist.P2POp): paired with the next receive from their peer
        self.pair_with = None  # the peer of this stage's next receive, set by the schedule's loop (pp_runner.py)
        self.stepwise = False  # interleaved: every send held until the next step's exchange (docstring)
        self.expected = []  # the Receives an exchange posted, in the order the step's actions read them
        self.posted = []  # every group in order, [("send" | "recv", peer), ...]: a test can check no order deadlocks

    phase = Comm.phase  # the tracker's phase name, "outside" without one

    def post(self, receive=None):
        """Post the held sends and `receive` (P2POp or None), one group if same peer. Returns the receive's work."""
        sends, self.held, peer = self.held, [], None if receive is None else receive.peer
        for send in (send for send in sends if send.peer != peer):
            self.group([send])  # not a pair: the send goes on its own
        works = self.group([send for send in sends if send.peer == peer] + ([receive] if receive is not None else []))
        return works[-1] if receive is not None else None

    def exchange(self, receives):
        """Stepwise: one group of every held send and `receives` [(source, shape, dtype, kind)], in order; the
        step's actions take them from `expected` as they read them (post_receive)."""
        buffers = [(source, torch.empty(shape, dtype=dtype, device=self.device), kind)  # filled as messages land
                   for source, shape, dtype, kind in receives]
        held, self.held = self.held, []
        works = self.group(held + [dist.P2POp(dist.irecv, buffer, source) for source, buffer, _ in buffers])
        self.expected += [(source, kind, Receive(self, buffer, work))
                          for (source, buffer, kind), work in zip(buffers, works[len(held):])]

    def group(self, ops):
        if not ops:
            return []
        self.posted.append([("send" if op.op is dist.isend else "recv", op.peer) for op in ops])
        works = dist.batch_isend_irecv(ops)  # one group: NCCL runs its sends and receives together
        self.in_flight = [(work, sent) for work, sent in self.in_flight if not work.is_completed()]  # done ones go
        self.in_flight += [(work, op.tensor) for op, work in zip(ops, works) if op.op is dist.isend]
        return works

    def finish(self):
        self.post()
        with self.timeline.span("send"):  # the step's last sends
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
    if not pipe.stepwise:
        pipe.post()  # an earlier held send goes first
    pipe.held.append(dist.P2POp(dist.isend, x, to))
    if not pipe.stepwise and (to != pipe.pair_with or kind != "send"):  # no receive from `to` next: send it now
        pipe.post()
    pipe.log.record(pipe.phase, kind, x.nbytes)


def post_receive(pipe, source, shape, dtype, kind="receive"):
    if pipe.stepwise:  # posted by the step's exchange
        expected_source, expected_kind, receive = pipe.expected.pop(0)
        assert (expected_source, expected_kind, tuple(receive.buffer.shape)) == (source, kind, tuple(shape)), \
            f"the step expected a {expected_kind} from rank {expected_source}, not a {kind} from rank {source}"
    else:
        buffer = torch.empty(shape, dtype=dtype, device=pipe.device)  # (shape) filled when the message lands
        receive = Receive(pipe, buffer, pipe.post(dist.P2POp(dist.irecv, buffer, source)))  # with a held send to it
    pipe.log.record(pipe.phase, kind, receive.buffer.nbytes)
    return receive


def from_previous_stage_forward(pipe, shape, dtype, kind="receive"):
    return post_receive(pipe, pipe.previous, shape, dtype, kind).wait()  # x (shape): the previous stage's y, its input


def from_previous_stage_backward(dx, pipe):
    """Forward was x = the previous stage's y, moved here: the identity, so y's gradient is dx, sent back to y."""
    _send(dx, pipe, pipe.previous)


def to_next_stage_forward(y, pipe, kind="send"):
    _send(y, pipe, pipe.next, kind)  # y (shape): this stage's output, the next stage's input (or its generator state)


def to_next_stage_backward(pipe, shape, dtype):
    """Forward sent y to the next stage, which computes y's gradient (its from_previous_stage_backward): a Receive."""
    return post_receive(pipe, pipe.next, shape, dtype)


def receives(action, cfg, rng_like, shape):
    """[(kind, shape, dtype)] an action receives, in order (a stepwise exchange posts them): a forward its input,
    micro-batch 0's after the generator state when the model draws random numbers; a backward its output's gradient."""
    state = [("rng_state", tuple(rng_like.shape), rng_like.dtype)] if action.kind == "F" and action.microbatch == 0 \
        and cfg.draws_random else []
    return state + [("receive", shape, cfg.torch_dtype)]

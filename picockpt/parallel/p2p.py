"""Point-to-point between pipeline stages, as forward/backward pairs (picockpt/parallel/comm.py's style).

A stage's forward receives its input from the previous stage and sends its output to the next;
its backward receives the gradient of that output from the next stage and sends the gradient of
its input to the previous one. Each pair's backward is the adjoint of its forward:

    pair                 forward                                 backward
    from_previous_stage  receive x from the previous stage       send dx back to it
    to_next_stage        send y to the next stage                receive dy from it

Sends are non-blocking (torch.distributed.isend): a stage never waits for its neighbour to take
what it sends, so no schedule can deadlock on two stages sending to each other at once (1F1B's
steady state: stage s sends an activation up while stage s+1 sends a gradient down). The tensor
sent is held until its send completes (Pipe.finish waits for the last ones, in a "send" span).
Receives block: the time a stage spends in one is a "wait" span of its Timeline, the bubble as
that stage sees it. post_receive starts a receive and returns at once: a stage can recompute
while the gradient is on its way (recompute-early, picockpt/parallel/pipeline.py).

Bytes are counted per rank under the tracker's phase, one number per call, the tensor's size:
kind "send" for what this rank sends, "receive" for what it receives, "rng_state" for the
generator state the first micro-batch's activation carries when the model draws random numbers
(picockpt/parallel/stage_model.py). NCCL and gloo both run isend/irecv; on NCCL every tensor,
the generator state included, is on the rank's GPU.
"""
import torch
import torch.distributed as dist

from .comm import CommLog, OUTSIDE


class Pipe:
    """This rank's two pipeline neighbours (global ranks; None at either end), the log of what it
    sent and received, and the sends still in flight."""

    def __init__(self, previous, next, device, timeline, tracker=None):
        self.previous, self.next = previous, next
        self.device, self.timeline, self.tracker = torch.device(device), timeline, tracker
        self.log = CommLog()
        self.in_flight = []  # (work, tensor): a sent tensor lives until its send completes

    @property
    def phase(self):
        return getattr(self.tracker, "phase_name", OUTSIDE)

    def finish(self):
        """Wait for every send still in flight (the step's last ones)."""
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
    pipe.in_flight = [(work, sent) for work, sent in pipe.in_flight if not work.is_completed()]  # drop the sent ones
    pipe.in_flight.append((dist.isend(x, dst=to), x))
    pipe.log.record(pipe.phase, kind, x.nbytes)


def post_receive(pipe, source, shape, dtype, kind="receive"):
    buffer = torch.empty(shape, dtype=dtype, device=pipe.device)  # (shape) filled when the message lands
    work = dist.irecv(buffer, src=source)
    pipe.log.record(pipe.phase, kind, buffer.nbytes)
    return Receive(pipe, buffer, work)


# -- entering a stage ------------------------------------------------------------------------------
def from_previous_stage_forward(pipe, shape, dtype):
    # x (shape): the previous stage's output is this stage's input (its embedding, on the first stage)
    return post_receive(pipe, pipe.previous, shape, dtype).wait()  # (shape)


def from_previous_stage_backward(dx, pipe):
    """Forward was x = the previous stage's y, moved here. Moving is the identity, so the gradient of
    y is dx itself, and it goes back to where y is: send dx to the previous stage."""
    _send(dx, pipe, pipe.previous)


# -- leaving a stage -------------------------------------------------------------------------------
def to_next_stage_forward(y, pipe):
    # y (shape): this stage's output, the next stage's input
    _send(y, pipe, pipe.next)


def to_next_stage_backward(pipe, shape, dtype):
    """Forward sent y to the next stage, which used it; the gradient of the loss with respect to y
    is computed there (its from_previous_stage_backward): receive it. Returns a Receive to wait on."""
    return post_receive(pipe, pipe.next, shape, dtype)


# -- the generator state the first micro-batch's activation carries --------------------------------
def send_rng_state(state, pipe):
    _send(state.to(pipe.device), pipe, pipe.next, kind="rng_state")  # (n,) uint8


def receive_rng_state(pipe, like):
    return post_receive(pipe, pipe.previous, like.shape, like.dtype, kind="rng_state").wait().cpu()  # (n,) uint8

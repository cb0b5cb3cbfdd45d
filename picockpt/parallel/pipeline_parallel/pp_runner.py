"""A rank's actions run in its schedule's order (pp_schedules.py: actions), each one the engine's own loop on one
micro-batch of one chunk of the stage (pp_stage.py): F a Step's forward, B its backward (ZB-H1: the input gradient
only), W ZB-H1's weight gradients its B left. Sends pair with the next receive from the same peer (pp_comm.py).
"""
from itertools import accumulate

from ...recompute.engine import Step, device_generator
from ...recompute.store import ActivationStore
from ..timeline import MicroBatchTracker
from .pp_comm import receives
from .pp_schedules import interleaved_steps
from .pp_stage import StageModel


def run_actions(order, chunks, forms, pipe, rows, memory, say, forward_done):
    """Every action of `order` on this rank's chunks (PipelineStage each; forms: their ChunkForms, whose schedule
    and op-level drops each Step follows). rows(m): micro-batch m's (input_ids, targets) on this rank; memory: the
    stage's stores (timeline.py: StageMemory); forward_done(m, c, step, model) after each forward. Returns this
    rank's share of the loss (the last stage's micro-batches summed), None on earlier stages."""
    steps, loss = {}, None  # (micro-batch, chunk) -> its Step until its B (ZB-H1: until its W)
    rng_like = device_generator(pipe.device).get_state()  # what a generator state sent between stages looks like
    talking = [action for action in order if action.kind != "W"]  # the actions that send and receive
    pipe.stepwise = len(chunks) > 1  # interleaved: Megatron-LM's steps (pp_comm.py)
    grouped = interleaved_steps(order) if pipe.stepwise else []
    starts = dict(zip(accumulate(map(len, grouped), initial=0), grouped))  # {a step's first index: its actions}
    for index, action in enumerate(order):
        m, c, stage = action.microbatch, action.chunk, chunks[action.chunk]
        if index in starts:  # the previous step's sends and every receive this step reads, one group
            pipe.exchange([(source, shape, dtype, kind) for a in starts[index]
                           if (source := receives_from(a, chunks, pipe)) is not None
                           for kind, shape, dtype in receives(a, stage.cfg, rng_like, stage.activation_shape)])
        if action.kind == "W":  # ZB-H1: the weight gradients its B left
            steps.pop((m, c)).model.weight_backward()
            continue
        talking.pop(0)  # a send just before the next action's receive from the same peer: one group
        pipe.pair_with = receives_from(talking[0], chunks, pipe) if talking else None
        if action.kind == "F":
            w_store = ActivationStore(MicroBatchTracker(memory, m, (c, "W"))) if stage.split_backward else None
            model = StageModel(stage, m, stage.model_for_rows(*rows(m)), w_store)  # micro-batch m of the chunk
            tracker = MicroBatchTracker(memory, m, c)
            step = model.step = Step(model, forms[c].schedule, forms[c].policy.unstored, tracker, say)
            model.rank_model.store = step.store  # where an ep layer keeps its routing, whatever its mode
            part = step.forward()  # this micro-batch's share of the whole batch's mean (last stage)
            loss = part if loss is None else loss + part
            forward_done(m, c, step, model)
            steps[m, c] = step
        else:  # ZB-H1: the Step kept for its W
            (steps[m, c] if stage.split_backward else steps.pop((m, c))).backward()
    return loss


def receives_from(action, chunks, pipe):
    """The neighbour this action receives from (its input or its gradient), or None (a W; the first chunk's F, the
    last chunk's B)."""
    chunk = chunks[action.chunk]
    if action.kind == "W" or (chunk.first if action.kind == "F" else chunk.last):
        return None
    return pipe.previous if action.kind == "F" else pipe.next

"""Pipeline schedules: which layers each stage runs, and the order of its micro-batches' forwards and backwards.

    stage_layers(L=8, P=3)               [range(0, 3), range(3, 6), range(6, 8)]
    actions("1f1b", P=4, M=6, stage=1)   [F0, F1, F2, B0, F3, B1, F4, B2, F5, B3, B4, B5]
    in_flight("1f1b", P=4, M=6, stage=1) 3
    actions("zb-h1", P=2, M=3, stage=1)  [F0, B0, F1, B1, W0, F2, B2, W1, W2]
    actions("interleaved", P=2, M=2, stage=0, virtual=2)   [F0.0, F1.0, F0.1, F1.1, B0.1, B1.1, B0.0, B1.0]

AFAB (GPipe: Huang et al. 2019; Picotron's train_step_pipeline_afab): every stage runs its M forwards, then its M
backwards, holding M micro-batches. 1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM, Picotron): stage s
runs min(P - s - 1, M) warm-up forwards, alternates one forward and one backward, then runs the backwards left. A
backward starts as soon as its gradient can come back, so stage s holds at most min(P - s, M) micro-batches: stage 0
the most (P, about L layers' activations whatever P is: Korthikanti et al. 2022, sec. 4.2.3). Both have the bubble
(P - 1) / (M + P - 1) with equal stage times (Narayanan et al. 2021, sec. 2.2); 1F1B's smaller memory costs nothing.

Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2; Megatron-LM's forward_backward_pipelining_with_interleaving): each
rank holds V chunks of layers, chunk c of rank s being virtual stage c P + s. Rank s warms up with (P - s - 1) 2 +
(V - 1) P forwards (M a multiple of P); forward k is micro-batch (k // (P V)) P + k % P of chunk (k // P) % V,
backward k the same micro-batch of chunk V - 1 - (k // P) % V. The bubble shrinks to (P - 1) / (V M + P - 1).

ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3; sail-sg/zero-bubble-pipeline-parallelism's
ZeroBubbleH1Pipeline): the backward split into B (the input gradient, which the previous stage waits for) and W (the
weight gradients, which nobody waits for). Rank s runs 1F1B's warm-up, then s pairs F, B whose W waits, then F, B, W
while forwards remain, B, W while backwards remain, and the waiting W's last: with equal F, B, W times the bubble
falls from 1F1B's (P - 1)(F + B + W) to (P - 1)(F + B - W), a third of it.
"""
import functools
import re
from collections import namedtuple
from itertools import accumulate, count

SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1")
EXPLAINED = {"afab": "all forward then all backward", "1f1b": "one forward one backward",
             "interleaved": "1F1B over virtual_stages chunks a rank", "zb-h1": "1F1B with weight gradients deferred"}

# kind "F" (forward), "B" (backward: the whole of it, or under ZB-H1 the input gradient only) or "W" (ZB-H1's
# weight gradients); chunk: which of the rank's virtual stages (0 but under interleaving)
Action = namedtuple("Action", "kind microbatch chunk", defaults=(0,))


def check_schedule(schedule, virtual=1, stages=None):
    """ValueError naming the value unless the schedule is known, its virtual stages fit it, and (stages given) a
    schedule of a pipeline's stages has more than one stage to order."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {', '.join(f'{s!r} ({EXPLAINED[s]})' for s in SCHEDULES)}")
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"virtual_stages={virtual!r}: give a whole number of layer chunks per rank, 1 or more")
    if (virtual > 1) != (schedule == "interleaved"):
        fix = ("use virtual_stages >= 2 with it, or another schedule such as schedule='1f1b'" if virtual == 1 else
               "use schedule='interleaved' with them, or virtual_stages=1")
        raise ValueError(f"virtual_stages={virtual} with schedule={schedule!r}: virtual stages are interleaving's "
                         f"chunks; {fix}")
    if stages == 1 and schedule in ("interleaved", "zb-h1"):  # afab and 1f1b order one stage's micro-batches too
        raise ValueError(f"schedule={schedule!r} with pp=1: {EXPLAINED[schedule]} orders the stages of a pipeline, "
                         f"and there is one stage; use pp >= 2, or schedule='1f1b'")


def check_interleaving(stages, microbatches, virtual, layers=None):
    """ValueError naming the value unless interleaving can run: whole numbers, M a multiple of P, a layer for each
    of the P V chunks (of `layers`, where given)."""
    for name, value in (("pp", stages), ("microbatches", microbatches), ("virtual_stages", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: give a whole number, 1 or more")
    if microbatches % stages:
        raise ValueError(f"microbatches={microbatches} with pp={stages} and virtual_stages={virtual}: interleaving "
                         f"runs micro-batches in groups of pp (Megatron-LM requires M % pp == 0); use a multiple of "
                         f"{stages}, e.g. {stages * max(1, microbatches // stages)}")
    if layers is not None and stages * virtual > layers:
        raise ValueError(f"pp={stages} x virtual_stages={virtual} = {stages * virtual} chunks for {layers} layers: "
                         f"every chunk needs a layer; use pp x virtual_stages <= {layers}")


def stage_layers(layers, stages):
    """The range of layers each of P stages runs: L // P each, one more for the first L mod P (as Picotron does); the
    first stage also runs the embedding, the last the final norm, LM head and loss."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pp={stages!r}: use a whole number of pipeline stages, 1 or more")
    if stages > layers:
        raise ValueError(f"pp={stages} is larger than the number of layers L={layers}: every stage needs at least "
                         f"one layer; use pp <= {layers}")
    starts = [s * (layers // stages) + min(s, layers % stages) for s in range(stages + 1)]  # stage s's first layer
    return [range(start, end) for start, end in zip(starts, starts[1:])]


def check_segment(segment, text, layers, stages, virtual=1):
    """every:C splits each stage's chunk of layers into segments of C (the single process's every:C on the chunk):
    a C longer than every chunk would silently be the chunk's length, as the single process refuses C > L."""
    longest = max(len(chunk) for chunk in stage_layers(layers, stages * virtual))
    if segment is not None and stages * virtual > 1 and segment > longest:
        chunks = f"pp={stages} x virtual_stages={virtual} chunks" if virtual > 1 else f"pp={stages} stages"
        raise ValueError(f"policy {text!r}: C={segment} is longer than the {longest} layers of the longest of {chunks} "
                         f"(of L={layers}), so each would run every:{longest}; use every:C with C <= {longest}")


def rank_layers(layers, stages, stage, virtual=1):
    """The layer ranges rank `stage` runs, one per chunk: virtual stages stage, P + stage, .. of P V (interleaved)."""
    return stage_layers(layers, stages * virtual)[stage::stages]


def actions(schedule, stages, microbatches, stage, virtual=1):
    """The forwards (F), backwards (B) and weight gradients (W, ZB-H1) stage `stage` runs, in order, one Action
    each; virtual: interleaving's chunks per rank."""
    return list(_actions(schedule, stages, microbatches, stage, virtual))


@functools.lru_cache(maxsize=256)  # predict walks each order once per policy and schedule compared: made once
def _actions(schedule, stages, microbatches, stage, virtual):
    check_schedule(schedule, virtual)
    if schedule == "interleaved":
        return interleaved_actions(stages, microbatches, virtual, stage)
    if schedule == "zb-h1":
        return zb_h1_actions(stages, microbatches, stage)
    M, warmup = microbatches, microbatches if schedule == "afab" else min(stages - stage - 1, microbatches)
    return phase_actions(("F", warmup), ("FB", M - warmup), ("B", warmup))  # warm-up, steady state, cool-down


def phase_actions(*phases, action=Action):
    """The Actions of phases (kinds, times), each running its kinds in turn `times` times, each kind on its next
    micro-batch: action(kind, k) the kind's k-th (Action(kind, k) but under interleaving)."""
    n = {"F": count(), "B": count(), "W": count()}  # each kind's next number
    return [action(kind, next(n[kind])) for kinds, times in phases for kind in kinds * times]


def interleaved_actions(stages, microbatches, virtual, stage):
    """Rank `stage`'s Actions under interleaved 1F1B with `virtual` chunks a rank."""
    check_interleaving(stages, microbatches, virtual)
    P, total = stages, microbatches * virtual

    def action(kind, k):  # forward (backward) k: its micro-batch and chunk (backwards from the last chunk)
        chunk = (k // P) % virtual
        return Action(kind, (k // (P * virtual)) * P + k % P, virtual - 1 - chunk if kind == "B" else chunk)

    warmup = total if microbatches == P else min(total, (P - stage - 1) * 2 + (virtual - 1) * P)
    return phase_actions(("F", warmup), ("FB", total - warmup), ("B", warmup), action=action)


def zb_h1_actions(stages, microbatches, stage):
    """Rank `stage`'s Actions under ZB-H1 (phases as the module docstring says: `stage` pairs F, B whose W waits)."""
    M, warmup = microbatches, min(stages - stage - 1, microbatches)
    pairs = min(stage, M - warmup)
    return phase_actions(("F", warmup), ("FB", pairs), ("FBW", M - warmup - pairs), ("BW", warmup), ("W", pairs))


def interleaved_steps(order):
    """The order as Megatron-LM's interleaved loop runs it, [[Action, ...], ...]: a forward followed by a backward
    is one step (the steady state), any other action a step of its own (warm-up forwards, cool-down backwards).
    With M = P every forward is a warm-up one (Megatron's all_warmup_microbatches): no steady state, no pair."""
    kinds = "".join(action.kind for action in order)
    steady = kinds != "F" * kinds.count("F") + "B" * kinds.count("B")
    sizes = [len(step) for step in re.findall("FB|." if steady else ".", kinds)]
    return [order[start:start + n] for start, n in zip(accumulate(sizes, initial=0), sizes)]


@functools.lru_cache(maxsize=256)
def in_flight(schedule, stages, microbatches, stage, virtual=1):
    """The most micro-batches (micro-batch-chunks, interleaved) whose activations stage `stage` stores at once,
    from a forward to its backward (read off its actions; ZB-H1's W holds what it needs apart: pp_forms.py)."""
    change = {"F": 1, "B": -1, "W": 0}  # what each action does to the count held
    return max(accumulate((change[a.kind] for a in actions(schedule, stages, microbatches, stage, virtual)), initial=0))


def bubble_fraction(stages, microbatches):
    """(P - 1) / (M + P - 1): each stage's idle share with equal stage times. Narayanan et al. 2021 (sec. 2.2.1) and
    the Ultra-Scale Playbook's bubble is over ideal compute time, b = (P - 1) / M: idle = b / (1 + b) (lesson 16)."""
    return (stages - 1) / (microbatches + stages - 1)


def unequal_bubble(compute_seconds, microbatches):
    """Each stage's idle share with unequal stage times, t_s = compute_seconds[s] / M per micro-batch: the slowest stage
    k sets the pace, the step lasting about sum(t_s) + (M - 1) * t_k (one micro-batch through every stage, the other
    M - 1 at k's rate; sends and Python not counted), of which stage s computes M * t_s (equal t_s: bubble_fraction)."""
    per_microbatch = [seconds / microbatches for seconds in compute_seconds]
    step = sum(per_microbatch) + (microbatches - 1) * max(per_microbatch)
    return [1.0 - microbatches * t / step for t in per_microbatch]

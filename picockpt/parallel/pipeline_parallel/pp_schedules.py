"""Pipeline schedules: which layers each stage runs, and the order of its micro-batches' forwards and backwards.

    stage_layers(L=8, P=3)               [range(0, 3), range(3, 6), range(6, 8)]
    actions("1f1b", P=4, M=6, stage=1)   [F0, F1, F2, B0, F3, B1, F4, B2, F5, B3, B4, B5]
    in_flight("1f1b", P=4, M=6, stage=1) 3

AFAB ("all forward, all backward", GPipe: Huang et al. 2019; Picotron's train_step_pipeline_afab): every stage runs its
M forwards, then its M backwards in the same order, holding M micro-batches. 1F1B (PipeDream-Flush, Narayanan et al.
2021; Megatron-LM, Picotron's train_step_pipeline_1f1b): stage s runs min(P - s - 1, M) warm-up forwards, alternates one
forward and one backward, then runs the backwards left (the cool-down). A backward starts as soon as its gradient can
come back, so stage s holds at most min(P - s, M) micro-batches (its warm-up ones and the one just forwarded): stage 0
the most (P, about L layers' activations whatever P is: Korthikanti et al. 2022, sec. 4.2.3), the last stage one.

Both have the bubble (P - 1) / (M + P - 1) with equal stage times: each stage waits P - 1 of the M + P - 1 forward slots
and as many backward ones (Narayanan et al. 2021, sec. 2.2). 1F1B's smaller memory costs nothing; AFAB reads simpler.
"""
from collections import namedtuple

SCHEDULES = ("afab", "1f1b")

Action = namedtuple("Action", "kind microbatch")  # kind "F" (forward) or "B" (backward)


def check_schedule(schedule):
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {', '.join(repr(s) for s in SCHEDULES)} "
                         f"(all forward then all backward, or one forward one backward)")
    return schedule


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


def actions(schedule, stages, microbatches, stage):
    """The forwards (F) and backwards (B) stage `stage` runs, in order, one Action each."""
    check_schedule(schedule)
    M = microbatches
    if schedule == "afab":
        return [Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)]
    warmup = min(stages - stage - 1, M)
    order = [Action("F", m) for m in range(warmup)]
    for m in range(M - warmup):  # steady state: the next forward, then the oldest backward
        order += [Action("F", warmup + m), Action("B", m)]
    return order + [Action("B", m) for m in range(M - warmup, M)]  # cool-down


def in_flight(schedule, stages, microbatches, stage):
    """The most micro-batches whose activations stage `stage` stores at once (read off its actions)."""
    held = most = 0
    for action in actions(schedule, stages, microbatches, stage):
        held += 1 if action.kind == "F" else -1
        most = max(most, held)
    return most


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

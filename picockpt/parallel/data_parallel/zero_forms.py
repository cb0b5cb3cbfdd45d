"""ZeRO's per-rank bytes in closed form: model state per stage, the gathered parameters in flight, and the all-gathers
and reduce-scatters of each phase, for a policy's recomputation.

Rajbhandari et al. 2020 (ZeRO, sec. 5, Figure 1) count the model state of Psi parameters trained with Adam in mixed
precision as 2 Psi bytes of fp16 parameters, 2 Psi of fp16 gradients and K Psi of optimizer state (K = 12). Over N_d
data-parallel ranks each rank holds

    stage 0 (plain data parallel)      (2 + 2 + K) Psi
    stage 1 (optimizer state sharded)  2 Psi + 2 Psi + K Psi / N_d
    stage 2 (and the gradients)        2 Psi + (2 + K) Psi / N_d
    stage 3 (and the parameters)       (2 + 2 + K) Psi / N_d

(zero_paper_bytes; their 7.5B example at N_d = 64: 120, 31.4, 16.6 and 1.9 GB.) picockpt's exact form
(unit_state_bytes) counts what it holds, in its own dtypes: parameters and gradients in Config.param_dtype (p bytes,
fp32 or fp64: no 16-bit copy), and torch's AdamW state: exp_avg and exp_avg_sq of every element of the rank's shards
(2p), plus one "step" scalar per unit. In fp32 that is the paper's form with 2 + 2 + K read as 4 + 4 + 8, every Psi
rounded up to whole shards, plus 4 bytes per unit. The gathers and reductions follow zero_shards.py's rules use by
use (stage_uses, gather_forms), so the forms hold on any layout.
"""
import torch

from ...model.params import param_shapes
from ..pipeline_parallel.pp_schedules import Action
from .zero_params import FlatUnit, unit_names

STAGES = (1, 2, 3)


def zero_paper_parts(psi, stage, K=12, N_d=64):
    """{param_bytes, grad_bytes, optimizer_bytes} per rank under `stage` (0..3), as the ZeRO paper counts (above)."""
    return {"param_bytes": 2 * psi / (N_d if stage >= 3 else 1), "grad_bytes": 2 * psi / (N_d if stage >= 2 else 1),
            "optimizer_bytes": K * psi / (N_d if stage >= 1 else 1)}


def zero_paper_bytes(psi, K=12, N_d=64):
    """Bytes of model state per rank under stages 0..3, as the ZeRO paper counts them (zero_paper_parts, summed)."""
    return {stage: sum(zero_paper_parts(psi, stage, K, N_d).values()) for stage in (0, 1, 2, 3)}


def unit_state_bytes(units, stage, p):
    """{param_bytes, grad_bytes, optimizer_bytes} one rank holds under `stage`; units: [FlatUnit], each over its
    group (a unit of world_size 1 is held whole); p: the master dtype's bytes."""
    step = torch.tensor(0.0).element_size()  # AdamW's step count: a scalar tensor of the default dtype
    padded, shards = sum(u.padded for u in units), sum(u.shard_numel for u in units)
    return {"param_bytes": (padded if stage < 3 else shards) * p,
            "grad_bytes": (padded if stage < 2 else shards) * p,
            "optimizer_bytes": 2 * shards * p + step * len(units)}


def model_state_bytes(cfg, stage, world_size):
    """{param_bytes, grad_bytes, optimizer_bytes} one rank holds under `stage`, every unit over the dp ranks."""
    shapes = param_shapes(cfg)
    units = unit_names(list(shapes), range(cfg.layers), True, True)  # the whole model's: embedding, layers, head
    return unit_state_bytes([FlatUnit(names, shapes, world_size) for names in units.values()], stage,
                            cfg.param_dtype.itemsize)


def stage_uses(order, layers, first, last, schedule):
    """[(phase, unit)]: every use of a unit's gathered weights in one step of a stage, in order (stage 3): each
    action of its schedule (pp_schedules.actions) walks its micro-batch's forward or backward; schedule: the
    stage's own (its layers numbered from 0), whose sweeps say which layers a backward recomputes."""
    sweep_to = {layers[0] + last_k: layers[0] + first_k for first_k, last_k in schedule.sweeps(len(layers))}
    uses = []
    for action in order:
        if action.kind == "F":
            uses += [("forward", "embed")] * first + [("forward", k) for k in layers] + [("forward", "head")] * last
        elif action.kind == "B":  # not "W": ZB-H1's weight gradients read no weights (dW = dy.T x)
            uses += [("backward", "head")] * last  # the embedding's backward needs its shape only
            for i in reversed(layers):
                uses += [("recompute", k) for k in range(sweep_to.get(i, i + 1), i + 1)]  # none unless i ends a sweep
                uses.append(("backward", i))
    return uses


def gather_uses(cfg, schedule):
    """[(phase, unit)]: every use of a unit's gathered weights in one step of the whole model (stage 3)."""
    return stage_uses([Action("F", 0), Action("B", 0)], range(cfg.layers), True, True, schedule)


def kept_after(uses, n, keep_gathered):
    """Does use n's unit stay gathered after it? The head from its forward to its backward; keep_gathered=True: a
    recomputed layer until its backward; "step": every unit until its last use of the step (torchtitan's default
    beside pp, with torch.distributed.pipelining resharding after the last backward only)."""
    phase, unit = uses[n]
    if keep_gathered == "step":
        return any(other == unit for _, other in uses[n + 1:])
    return (unit == "head" and phase == "forward") or (keep_gathered and phase == "recompute")


def gather_forms(uses, sizes, keep_gathered=False, prefetch=True):
    """({phase: bytes all-gathered}, {phase: the most gathered bytes alive during a use}) of a stage 3 step: the
    units in use or kept, and with prefetch the next use's unit, gathering while this one computes (unless it is
    the unit in use: a second copy would be gathered; it is gathered again after the release). sizes: {unit:
    its gathered bytes}; a gather is booked under the phase of the use it serves."""
    moved = dict.fromkeys(("forward", "recompute", "backward"), 0)
    peaks, live = dict(moved), set()
    for n, (phase, unit) in enumerate(uses):
        for use_phase, key in uses[n:n + 1 + bool(prefetch)]:  # this use's unit, and with prefetch the next's
            if key not in live:
                live.add(key)
                moved[use_phase] += sizes[key]
        peaks[phase] = max(peaks[phase], sum(sizes[u] for u in live))
        if not kept_after(uses, n, keep_gathered):
            live.discard(unit)
    return moved, peaks


def reduce_bytes_by_kind(units, stage, p, optimizer=True):
    """{phase: {kind: bytes}} of the gradients' reductions and (optimizer=True, stages 1, 2) the optimizer's
    gather of the updated shards, over every unit of a group of more than one rank."""
    padded = sum(u.padded for u in units if u.world_size > 1) * p
    out = {"backward": {"all_reduce" if stage == 1 else "reduce_scatter": padded}}
    if stage < 3 and optimizer:
        out["optimizer"] = {"all_gather": padded}
    return out

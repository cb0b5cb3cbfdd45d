"""ZeRO's per-rank bytes in closed form: model state per stage, the gathered parameters in flight, and
the all-gathers and reduce-scatters of each phase, for a policy's recomputation.

Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 5,
Figure 1) count the model state of Psi parameters trained with Adam in mixed precision as 2 Psi bytes of
fp16 parameters, 2 Psi of fp16 gradients and K Psi of optimizer state (K = 12: an fp32 copy of the
parameters, the momentum and the variance). Over N_d data-parallel ranks each rank holds

    stage 0 (plain data parallel)      (2 + 2 + K) Psi
    stage 1 (optimizer state sharded)  2 Psi + 2 Psi + K Psi / N_d
    stage 2 (and the gradients)        2 Psi + (2 + K) Psi / N_d
    stage 3 (and the parameters)       (2 + 2 + K) Psi / N_d

(zero_paper_bytes; their 7.5B example at N_d = 64: 120, 31.4, 16.6 and 1.9 GB.) picockpt's exact form
(model_state_bytes) counts what it holds, in its own dtypes: parameters in Config.param_dtype (p bytes;
fp32 or fp64 here: no 16-bit copy), gradients in the same dtype, and torch's AdamW state: exp_avg and
exp_avg_sq of every element of the rank's shards (2p), plus one "step" scalar per unit (4 bytes: torch
keeps the step count as a tensor of the default dtype). In fp32 that is the paper's form with 2 + 2 + K
read as 4 + 4 + 8, every Psi rounded up to whole shards (flat units padded to a multiple of N_d,
zero_params.py), plus 4 bytes per unit.

Gathers under stage 3, per rank (bytes as comm.py counts an all-gather: the gathered output, each unit's
padded numel times the compute dtype's bytes):
    forward     every unit once: the embedding, each layer, the head
    recompute   each layer a recompute sweep runs (Schedule.sweeps), once per sweep it appears in;
                keep_gathered: once per layer, the first time (it stays gathered until its backward)
    backward    each layer again (keep_gathered: only those never recomputed); the head is kept
                gathered from its forward to its backward (torchtitan's apply_fsdp_to_decoder leaves the final
                norm and output unsharded after the forward), and the embedding's backward needs only
                its shape, so neither is gathered again
and one reduce-scatter of every unit's gradient in the backward (its padded numel times p), which under
stages 1 and 2 are an all-reduce and a reduce-scatter; those stages then all-gather every unit's updated
shards in the optimizer phase (padded numel times p).
"""
import torch

from ...inventory import predicted_peak_bytes
from ...policy import parse_policy
from .zero_params import flat_units

STAGES = (1, 2, 3)
PHASES = ("forward", "recompute", "backward", "optimizer")


def zero_paper_parts(psi, stage, K=12, N_d=64):
    """{param_bytes, grad_bytes, optimizer_bytes} per rank under `stage` (0..3), as the ZeRO paper counts them:
    2 Psi fp16 parameters, 2 Psi fp16 gradients, K Psi optimizer state, each over N_d from its stage on."""
    return {"param_bytes": 2 * psi / (N_d if stage >= 3 else 1), "grad_bytes": 2 * psi / (N_d if stage >= 2 else 1),
            "optimizer_bytes": K * psi / (N_d if stage >= 1 else 1)}


def zero_paper_bytes(psi, K=12, N_d=64):
    """Bytes of model state per rank under stages 0..3, as the ZeRO paper counts them (zero_paper_parts, summed)."""
    return {stage: sum(zero_paper_parts(psi, stage, K, N_d).values()) for stage in (0, 1, 2, 3)}


def model_state_bytes(cfg, stage, world_size):
    """{param_bytes, grad_bytes, optimizer_bytes} one rank holds under `stage`."""
    p = torch.empty((), dtype=cfg.param_dtype).element_size()
    step = torch.tensor(0.0).element_size()  # AdamW's step count: a scalar tensor of the default dtype
    units = flat_units(cfg, world_size)
    padded, shards = sum(u.padded for u in units), sum(u.shard_numel for u in units)
    return {"param_bytes": (padded if stage < 3 else shards) * p,
            "grad_bytes": (padded if stage < 2 else shards) * p,
            "optimizer_bytes": 2 * shards * p + step * len(units)}


def gather_uses(cfg, schedule):
    """[(phase, unit)]: every use of a unit's gathered weights in one step, in order (stage 3)."""
    L = cfg.layers
    uses = [("forward", "embed")] + [("forward", k) for k in range(L)] + [("forward", "head"), ("backward", "head")]
    sweep_to = {last: first for first, last in schedule.sweeps(L)}  # the sweep that runs before layer i's backward
    for i in reversed(range(L)):
        if i in sweep_to:
            uses += [("recompute", k) for k in range(sweep_to[i], i + 1)]
        uses.append(("backward", i))
    return uses


def kept_after(phase, unit, keep_gathered):
    """Does a unit stay gathered after this use? The head from its forward to its backward; a
    recomputed layer until its backward, with keep_gathered."""
    return (unit == "head" and phase == "forward") or (keep_gathered and phase == "recompute")


def gathered_peak_bytes(cfg, batch, seq, policy, world_size, keep_gathered=False, prefetch=True):
    """{phase: the most gathered parameter bytes alive during a use of that phase}, stage 3: the units
    in use or kept, and with prefetch the next use's unit, gathering while this one computes (unless
    it is the unit in use: a second copy would be gathered; it is gathered again after the release)."""
    schedule = _schedule(cfg, batch, seq, policy, world_size)
    element = torch.empty((), dtype=cfg.torch_dtype).element_size()
    sizes = {u.key: u.padded * element for u in flat_units(cfg, world_size)}
    uses, live, peaks = gather_uses(cfg, schedule), set(), dict.fromkeys(("forward", "recompute", "backward"), 0)
    for n, (phase, unit) in enumerate(uses):
        live.add(unit)
        peaks[phase] = max(peaks[phase], sum(sizes[u] for u in live))
        if prefetch and n + 1 < len(uses) and uses[n + 1][1] not in live:
            live.add(uses[n + 1][1])  # launched now, for the next use
            peaks[phase] = max(peaks[phase], sum(sizes[u] for u in live))
        if not kept_after(phase, unit, keep_gathered):
            live.discard(unit)
    return peaks


def zero_comm_bytes(cfg, batch, seq, policy, stage, world_size, keep_gathered=False, optimizer=True):
    """{phase: {kind: bytes}} one rank's collectives move in one step under `stage` (ZeRO's own: the
    gathers, the gradient reductions, the optimizer's gather of updated shards; optimizer=False: a step
    without the optimizer's, forward and backward only)."""
    units = flat_units(cfg, world_size)
    p = torch.empty((), dtype=cfg.param_dtype).element_size()
    c = torch.empty((), dtype=cfg.torch_dtype).element_size()
    padded = sum(u.padded for u in units)
    out = {phase: {} for phase in PHASES}
    if stage < 3:
        out["backward"]["all_reduce" if stage == 1 else "reduce_scatter"] = padded * p
        out["optimizer"]["all_gather"] = padded * p if optimizer else 0
        return _drop_zeros(out)
    layer = units[1].padded * c  # every layer's unit has the same size
    recomputed = [k for first, last in _schedule(cfg, batch, seq, policy, world_size).sweeps(cfg.layers)
                  for k in range(first, last + 1)]
    distinct = len(set(recomputed))
    out["forward"]["all_gather"] = padded * c
    out["recompute"]["all_gather"] = (distinct if keep_gathered else len(recomputed)) * layer
    out["backward"]["all_gather"] = (cfg.layers - (distinct if keep_gathered else 0)) * layer
    out["backward"]["reduce_scatter"] = padded * p
    return _drop_zeros(out)


def zero_predictions(cfg, batch, seq, policy, stage, world_size, keep_gathered=False, prefetch=True, optimizer=True):
    """Every predicted_* entry of a rank's report (picockpt/parallel/data_parallel/zero_step.py)."""
    by_kind = zero_comm_bytes(cfg, batch, seq, policy, stage, world_size, keep_gathered, optimizer)
    gathered = gathered_peak_bytes(cfg, batch, seq, policy, world_size, keep_gathered, prefetch) if stage == 3 \
        else dict.fromkeys(("forward", "recompute", "backward"), 0)
    state = model_state_bytes(cfg, stage, world_size)
    if not optimizer:  # AdamW's moments exist from its first step on
        state["optimizer_bytes"] = 0
    return {**{f"predicted_{key}": value for key, value in state.items()},
            "predicted_activation_bytes": predicted_peak_bytes(cfg, batch // world_size, seq, policy),
            "predicted_comm_bytes_by_kind": by_kind,
            "predicted_comm_bytes": {phase: sum(kinds.values()) for phase, kinds in by_kind.items()},
            "predicted_gathered_peak_bytes": gathered}


def _schedule(cfg, batch, seq, policy, world_size):
    return parse_policy(policy, cfg).schedule(cfg, batch // world_size, seq)  # the rank's rows: b = B / N_d


def _drop_zeros(table):
    return {phase: {kind: n for kind, n in kinds.items() if n} for phase, kinds in table.items()}

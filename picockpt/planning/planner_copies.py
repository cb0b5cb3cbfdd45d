"""Keep the 16-bit weight copies for the step, or cast each layer's at its use: one more keep-or-recompute
choice, priced by the planner.

Under mixed precision the step computes with 16-bit copies of the fp32 master weights (params.compute_weights).
Kept, every layer's copy lives from the first forward to the end of the backward: 2 bytes a layer parameter,
cast once. Recast (the policy's +recast), only the layer that runs holds one: it is cast again in every
forward, every recomputation and every backward of that layer, reading 4 bytes and writing 2 a parameter.
The casts are pointwise: no FLOPs, only bytes over the device's memory bandwidth.

So for one total of bytes (the activation store plus the copies), the choice is a trade like any other here:
keeping the copies leaves the store copy_bytes(keep) - copy_bytes(recast) bytes less room, and a smaller room
means more recomputed layers (FLOPs at the compute rate); recasting buys that room for the casts' bytes.

    chosen, options = plan_copies(cfg, batch=4, seq=1024, budget=8 * 2**30)
    chosen.policy      # 'budget:...' or 'budget:...+recast': the policy to run, its store's room spelled out

Each option's modelled seconds count only what differs between them: its recompute FLOPs over `rate` and
its casts' bytes over `bandwidth` (the forward, the backward and the model's own copies are the same in both).
"""
import math
from dataclasses import dataclass

from .hardware import H200_SXM_HBM
from .host_walk import DEFAULT_COMPUTE_RATE
from ..model.params import copy_bytes, layer_shapes
from .planner import least_budget, model_chain, plan_model

CAST_BYTES = 4 + 2  # a layer parameter's cast: its fp32 master read, its 16-bit copy written
DEFAULT_BANDWIDTH = H200_SXM_HBM  # bytes/s the casts stream at (hardware.py: NVIDIA's H200 datasheet)


@dataclass(frozen=True)
class CopiesOption:
    recast: bool
    copy_bytes: int      # the 16-bit copies live at once (params.copy_bytes)
    store_budget: int    # what the activation store may hold: the total less the copies
    plan: object         # planner.Plan of the store within store_budget; None when it does not fit
    casts: int           # layer casts in one step (forward, recompute sweeps, backward)
    cast_bytes: int      # the bytes those casts move
    seconds: float       # modelled: recompute FLOPs / rate + cast bytes / bandwidth; inf when it does not fit
    policy: str          # the policy that runs it


def layer_casts(schedule, layers, recast):
    """Layer casts in one step: kept, each layer once (at the step's start); recast, each time a layer runs:
    its forward, each recomputation (every sweep forwards its layers first..target) and its backward."""
    if not recast:
        return layers
    return 2 * layers + sum(last - first + 1 for first, last in schedule.sweeps(layers))


def layer_params(cfg):
    return sum(math.prod(shape) for shape in layer_shapes(cfg).values())


def options(cfg, batch, seq, budget, unstored=frozenset(), op_text="", rate=DEFAULT_COMPUTE_RATE,
            bandwidth=DEFAULT_BANDWIDTH):
    """Both choices within `budget` bytes for the store plus the copies, each planned and priced."""
    least = least_budget(model_chain(cfg, batch, seq, unstored))
    out = []
    for recast in (False, True):
        copies = copy_bytes(cfg, recast)
        room = budget - copies
        plan = plan_model(cfg, batch, seq, room, unstored) if room >= least else None
        casts = layer_casts(plan.schedule, cfg.layers, recast) if plan is not None else 0
        moved = casts * CAST_BYTES * layer_params(cfg)
        seconds = plan.recompute_flops / rate + moved / bandwidth if plan is not None else math.inf
        text = f"budget:{max(room, 0)}{op_text}" + ("+recast" if recast else "")
        out.append(CopiesOption(recast, copies, room, plan, casts, moved, seconds, text))
    return out


def plan_copies(cfg, batch, seq, budget, unstored=frozenset(), op_text="", rate=DEFAULT_COMPUTE_RATE,
                bandwidth=DEFAULT_BANDWIDTH):
    """(the cheaper option, both options): the one of least modelled seconds; keeping on a tie (no casts to
    repeat). A ValueError, with the least total that fits, when neither does."""
    if cfg.torch_dtype == cfg.param_dtype:
        raise ValueError(f"dtype={cfg.dtype}: the step computes with the master weights themselves, so there are "
                         f"no 16-bit copies to keep or recast; use dtype bf16 or fp16")
    for name, value in (("rate", rate), ("bandwidth", bandwidth)):
        if not 0 < value < math.inf:
            raise ValueError(f"{name}={value!r}: a positive, finite number (FLOP/s, bytes/s)")
    both = options(cfg, batch, seq, budget, unstored, op_text, rate, bandwidth)
    if all(option.plan is None for option in both):
        least = least_budget(model_chain(cfg, batch, seq, unstored)) + copy_bytes(cfg, True)
        raise ValueError(f"budget={budget:,} bytes for the store and the 16-bit weight copies: even recasting "
                         f"(copies {copy_bytes(cfg, True):,} B) leaves less than the store's least, so give at least "
                         f"{least:,} bytes ({least / 2**20:.2f} MiB)")
    return min(both, key=lambda option: (option.seconds, option.recast)), both

"""Recomputation policies: what the forward keeps, written as short strings.

Layer level (at most one):
    none          keep every layer's activations (the baseline)
    full          keep only each layer's input; recompute a layer before its backward (= every:1)
    every:C       keep only the input of every C-th layer (segments of C layers); the backward
                  of a segment recomputes its C layers from that input, then drops them
    budget:SIZE   the cheapest schedule whose stored bytes fit SIZE (e.g. 48MiB, 1.5GiB, 1000000),
                  planned by picockpt/planning/planner.py
Op level (inside every layer that is kept; at most one of each line):
    selective     drop the attention probabilities (the T x T tensors); rebuild them from q, k.
                  Under tiled or fused attention (Config.attention) nothing is left to drop: those
                  never store the probabilities, they recompute them inside the op
    cheap         selective, and also the tensors rebuilt elementwise: norm outputs, the SwiGLU
                  products (the MLP's, or every expert's) (with tiled or fused attention, those alone)
  mixture-of-experts layers only (Config.experts > 0; named after Megatron-LM's --recompute-modules):
    moe_act       drop the experts' SwiGLU products; rebuild each from its kept gate and up projections
    moe           drop all the experts keep (gate/up projections and products): keep only the router
                  output and the routing decision, and run each expert's gate/up projection again
    router        drop the router's output, the E probabilities of every token; run the router's
                  linear and softmax again in the backward. Small either way: 32 bytes a token for
                  Mixtral's 8 experts in fp32, for 2hE FLOPs (against k*3f activations a token,
                  172,032 bytes for Mixtral 8x7B in bf16, that moe_act and moe act on)
  with a shared expert (Config.shared_expert_ffn > 0):
    shared_experts  drop the shared expert's projections and product; project again in the backward
Host memory (picockpt/recompute/offload.py: moved off the device in the forward, prefetched back for the backward):
    offload       what the layer level stores in each layer's first forward goes to host memory:
                  alone (= full+offload) and with every:C the checkpoints (layer inputs); with none
                  every layer's whole set; with budget:SIZE the planner chooses per layer among
                  keeping, recomputing and offloading (picockpt/planning/planner_offload.py)
    offload:NAMES only the named tensors, comma separated (e.g. offload:mlp.gate,mlp.up), of the layers
                  the first forward stores whole (none, unless a layer level is given)
The 16-bit weight copies (mixed precision: Config.dtype bfloat16 or float16 over fp32 master weights):
    recast        cast a layer's weights to 16 bits when it runs (forward, recompute, backward) and drop
                  them after, instead of casting every weight once at the start of the step and keeping the
                  copies until it ends (torch.autocast keeps its casts until the forward's autocast region
                  exits, and casts again in a checkpoint's recompute: lesson 21 counts both). Live copies: the embedding's, final norm's
                  and head's, plus one layer's, instead of 2 bytes for every parameter; the price is a
                  cast (a pass over 4 + 2 bytes a parameter) per layer in each recompute and backward.
                  Refused in float32/float64, which have no copies to drop
Combine with '+':  every:2+selective,  full+cheap,  budget:64MiB+selective,  selective+moe,  full+recast,
                   cheap+moe+shared_experts+router.
The routing decision (which experts each token went to) stays stored whatever the policy: an op-level rebuild inside the
backward reuses it, never routes again. A layer recomputed whole (full, every:C) runs its router again in one process,
with the random generator replayed (RNG replay: the same jitter, so the same experts); an expert-parallel layer keeps
its top-k indices and never routes again (lessons 15 and 17; Megatron-LM's routing replay differs: its RECORD mode only
records the indices, and a replay takes indices set from outside, while the router still computes its scores).

What the engine runs (layer modes, the Schedule) and the op levels' names are in picockpt/recompute/schedule.py.
A policy is parsed once, where its text comes in (parse_policy(text, cfg): a command's --policy, a parallel job's
checks), and the Policy is what travels on; a function that also takes the text reads it through as_policy.
"""
import re
from dataclasses import dataclass

from .schedule import CHEAP, MOE, MOE_ACT, ROUTER, SELECTIVE, SHARED_EXPERTS  # noqa: F401 (the op levels)
from .schedule import CHOICES, MOE_CHOICES, OP_LEVEL, Schedule

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

EXAMPLES = ("none, full, every:4, selective, cheap, every:2+selective, budget:48MiB, offload, none+offload, "
            "offload:mlp.gate,mlp.up, full+recast (16-bit), selective+moe (with experts)")
POLICY_HELP = ("recomputation policy (default none), e.g. full, every:4+selective, budget:48MiB, full+recast "
               "(16-bit weight copies cast at each layer's use, with --dtype bf16)")
RECAST = "recast"  # the 16-bit weight copies cast at each use instead of kept for the step


@dataclass(frozen=True)
class Policy:
    text: str                    # the canonical spelling, e.g. "every:2+selective"
    segment: int = None          # C of every:C (full = 1); None keeps every layer
    budget: int = None           # bytes, for budget:SIZE
    op_level: str = None         # None or a key of OP_LEVEL: "selective", "cheap", "moe", "cheap+moe_act" ...
    offload: frozenset = None    # names whose first-forward puts go to the host ("*": all); None: none do
    recast: bool = False         # 16-bit weight copies cast at each layer's use (True) or kept for the step

    @property
    def unstored(self):
        return OP_LEVEL.get(self.op_level, frozenset())

    def check(self, cfg):
        if self.segment is not None and self.segment > cfg.layers:
            raise ValueError(f"policy {self.text!r}: C={self.segment} is larger than the number of layers "
                             f"L={cfg.layers}; use every:C with 1 <= C <= {cfg.layers}")
        chosen = (self.op_level or "").split("+")
        for name in MOE_CHOICES:
            if name in chosen and cfg.experts == 0:
                raise ValueError(f"policy {self.text!r}: {name} recomputes parts of a mixture of experts, and this "
                                 f"model's MLP is dense (Config.experts=0); use selective or cheap, or set experts > 0")
        if "shared_experts" in chosen and cfg.shared_expert_ffn == 0:
            raise ValueError(f"policy {self.text!r}: shared_experts recomputes the shared expert's MLP, and this "
                             f"model has none (Config.shared_expert_ffn=0); leave out shared_experts or set "
                             f"shared_expert_ffn > 0")
        if self.offload is not None:
            self._check_offload(cfg)
        if self.recast and cfg.torch_dtype == cfg.param_dtype:
            raise ValueError(f"policy {self.text!r}: recast drops the 16-bit copies of the weights, and with "
                             f"dtype={cfg.dtype!r} the step computes with the {cfg.dtype} weights themselves "
                             f"(no copies); leave out recast, or use dtype='bfloat16' or 'float16'")
        return self

    def refuse_offload(self, layout):
        """For the layouts that have no host tier (the parallel ones): a ValueError if this policy offloads."""
        if self.offload is not None:
            without = self.text.rsplit("+", 1)[0]  # the canonical text ends with the offload part
            raise ValueError(f"policy {self.text!r}: offloading to host memory runs in one process only; {layout} "
                             f"has no host tier: leave out offload (e.g. policy {without!r})")
        return self

    def refuse_recast(self, layout):
        """For the layouts that build their own weights (the parallel ones): a ValueError if this policy recasts."""
        if self.recast:
            without = "+".join(part for part in self.text.split("+") if part != RECAST) or "none"
            raise ValueError(f"policy {self.text!r}: recast (16-bit weight copies cast at each layer's use) runs in "
                             f"one process only; {layout} keeps its copies for the step: leave out recast "
                             f"(e.g. policy {without!r})")
        return self

    def _check_offload(self, cfg):
        """offload:NAMES must name tensors this model stores, and something must be left to move."""
        from ..planning.layer_forms import layer_inventory  # (layer_forms imports nothing of this module)
        stored = {name.partition("[")[0] for name in layer_inventory(cfg, 1, 1)}
        unknown = sorted(self.offload - stored - {"*"})
        if unknown:
            raise ValueError(f"policy {self.text!r}: offload names {', '.join(unknown)}, which a layer of this model "
                             f"never stores ({cfg.attention} attention); name some of: {', '.join(sorted(stored))}")
        kept = stored - self.unstored if self.segment is None else {"input"}  # what the first forward stores
        if self.budget is None and "*" not in self.offload and not self.offload & kept:
            where = (f"every:{self.segment} stores only its checkpoints (input) in the first forward"
                     if self.segment is not None else f"{self.op_level} drops them")
            raise ValueError(f"policy {self.text!r}: nowhere to offload: {where}, so no tensor of "
                             f"{', '.join(sorted(self.offload))} is on the device to move; offload input, "
                             f"or drop the layer level or op level that removes them")

    def schedule(self, cfg, batch, seq):
        L = cfg.layers
        if self.budget is not None and self.offload is not None:
            from ..planning.planner_offload import plan_offload  # keep, recompute or offload, per layer
            return plan_offload(cfg, batch, seq, self.budget, self.unstored, names=self.offload).schedule
        if self.budget is not None:
            from ..planning.planner import plan_model  # the planner turns a byte budget into a schedule
            return plan_model(cfg, batch, seq, self.budget, self.unstored).schedule
        host = None if self.offload is None else (self.offload,) * L
        if self.segment is None:
            return Schedule(forward=("all",) * L, host=host)
        C = self.segment
        forward = tuple("input" if i % C == 0 else "none" for i in range(L))
        if host is not None:  # only the checkpoints are stored: they are what moves
            host = tuple(frozenset({"input"}) if mode == "input" else frozenset() for mode in forward)
        return Schedule(forward=forward, host=host)


def parse_size(text):
    """'48MiB' -> 50331648, '1.5GiB', '2GB', '1000000' -> bytes (int)."""
    match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in UNITS:
        raise ValueError(f"size {text!r} is not understood: write a number with an optional unit "
                         f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 48MiB or 1.5GiB")
    value = float(match.group(1)) * UNITS[unit]
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive: give a number of bytes above 0, e.g. 48MiB")
    if value < 1:  # int() would make it 0 bytes
        raise ValueError(f"size {text!r} is {value:g} bytes, less than one byte: give a unit (e.g. {text.strip()}MiB) "
                         f"or a whole number of bytes")
    if not value < 2**63:  # also inf, from e.g. 1e999
        raise ValueError(f"size {text!r} is too large to be a number of bytes (the limit is 2**63): "
                         f"give e.g. 1.5GiB or 2TiB")
    if UNITS[unit] == 1 and value != int(value):  # '1.5' would silently be 1 byte
        raise ValueError(f"size {text!r} is {value:g} bytes, not a whole number of bytes: give a unit (e.g. "
                         f"{match.group(1)}MiB) or a whole number of bytes")
    return int(value)


def parse_policy(text, cfg=None):
    """Parse a policy string; with a Config, also check it fits the model."""
    if isinstance(text, Policy):
        return text.check(cfg) if cfg is not None else text
    if not isinstance(text, str):
        raise ValueError(f"policy {text!r} ({type(text).__name__}) is not a policy string: use one of {EXAMPLES}")
    if not text.strip():
        raise ValueError(f"policy {text!r} is empty: use one of {EXAMPLES}")
    segment = budget = offload = None
    recast = False
    op_parts = [None] * len(CHOICES)  # the op-level choice of each group
    layer_level = None
    for original in text.strip().split("+"):
        original = original.strip()
        part = original.lower()
        if not part:
            raise ValueError(f"policy {text!r}: an empty part beside a '+'; join the choices with one '+' between "
                             f"each two, e.g. full+selective")
        if part == "offload" or part.startswith("offload:"):
            if offload is not None:
                raise ValueError(f"policy {text!r}: offload is given twice; name it once "
                                 f"(offload:a,b for several names)")
            offload = _offload_names(text, original)
            continue
        if part == RECAST:
            if recast:
                raise ValueError(f"policy {text!r}: recast is given twice; name it once")
            recast = True
            continue
        group = next((g for g, names in enumerate(CHOICES) if part in names), None)
        if group is not None:
            if op_parts[group] is not None:
                if len(CHOICES[group]) == 1 or part == op_parts[group]:
                    raise ValueError(f"policy {text!r}: {part} is given twice; name it once")
                first, second = CHOICES[group]
                raise ValueError(f"policy {text!r}: choose one of {first} or {second} ({second} includes {first})")
            op_parts[group] = part
            continue
        if layer_level is not None:
            raise ValueError(f"policy {text!r}: '{layer_level}' and '{part}' are both layer-level choices; "
                             f"combine one of none/full/every:C/budget:SIZE with selective or cheap")
        layer_level = part
        if part == "full":
            segment = 1
        elif part.startswith("every:"):
            value = part[len("every:"):]
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"policy {text!r}: every:C needs a whole number of layers C >= 1 "
                                 f"(every:1 is full recomputation), got {value!r}")
            segment = int(value)
        elif part.startswith("budget:"):
            try:
                budget = parse_size(original[len("budget:"):])
            except ValueError as error:
                raise ValueError(f"policy {text!r}: in budget:SIZE, {error}") from None
            layer_level = "budget:" + original[len("budget:"):].strip()  # the size as the user wrote it
        elif part != "none":
            raise ValueError(f"policy {text!r}: unknown part {part!r}; use one of {EXAMPLES}")
    op_level = "+".join(p for p in op_parts if p) or None
    if offload is not None and layer_level is None and "*" in offload:
        segment = 1  # offload alone: full's checkpoints, on the host
    offload_text = None if offload is None else "offload" + ("" if "*" in offload else ":" + ",".join(sorted(offload)))
    if segment is not None:
        layer_level = "full" if segment == 1 else f"every:{segment}"
    elif budget is None:  # none+offload, offload:NAMES: "none" said, as the layer level is not the default here
        layer_level = None if offload is None else "none"
    recast_text = RECAST if recast else None  # before offload: refuse_offload reads the offload part last
    canonical = "+".join(p for p in (layer_level, op_level, recast_text, offload_text) if p) or "none"
    policy = Policy(text=canonical, segment=segment, budget=budget, op_level=op_level, offload=offload,
                    recast=recast)
    return policy.check(cfg) if cfg is not None else policy


def as_policy(policy, cfg=None):
    """The Policy a function was given, checked against cfg (a few comparisons, no parsing: a Policy parsed without a
    model is still refused where it does not fit one); a policy string parsed and checked."""
    return parse_policy(policy, cfg)


def _offload_names(text, part):
    """'offload' -> {"*"} (whatever is stored); 'offload:mlp.gate,mlp.up' -> those names."""
    if part.lower() == "offload":
        return frozenset({"*"})
    names = [name.strip() for name in part[len("offload:"):].split(",")]
    if not all(names):
        raise ValueError(f"policy {text!r}: offload:NAMES needs names separated by commas, e.g. "
                         f"offload:mlp.gate,mlp.up (or offload alone, for what the layer level stores)")
    return frozenset(names)

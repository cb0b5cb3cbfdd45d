"""What the engine runs: a Schedule of layer modes, and the op levels a mode can name.

A layer is forwarded in one of three modes, each parsed once into a Mode (a str, so it prints and compares as written):
    "all"    store its input and its activations (minus the op-level drops); a schedule
             may also say "all:selective" or "all:cheap" to give one layer its own op level
    "input"  store only its input: a checkpoint to recompute from
    "none"   store nothing; its output only carries the residual stream forward

    mode = Mode("all:cheap")
    mode.stored       True: the layer's activations are stored (its backward finds them)
    mode.keeps_input  True: its input is a checkpoint ("all" and "input")
    mode.unstored(policy_unstored)  the names it drops: its own op level's, or the policy's
"""
from dataclasses import dataclass

# op level: the names each choice drops (the layer's backward has a rebuild recipe for each). An
# expert's tensor, "moe.act[3]", is dropped with its kind, "moe.act" (picockpt/model/moe.py).
SELECTIVE = frozenset({"attn.probs", "attn.probs_dropped"})
CHEAP = SELECTIVE | {"attn_norm.output", "mlp_norm.output", "mlp.act", "final_norm.output", "moe.act",
                     "moe.shared_act"}
MOE_ACT = frozenset({"moe.act"})
MOE = MOE_ACT | {"moe.gate_up"}
SHARED_EXPERTS = frozenset({"moe.shared_gate", "moe.shared_up", "moe.shared_act"})
ROUTER = frozenset({"moe.router_probs"})
CHOICES = ({"selective": SELECTIVE, "cheap": CHEAP},  # at most one of each group, in this order
           {"moe_act": MOE_ACT, "moe": MOE},
           {"shared_experts": SHARED_EXPERTS},
           {"router": ROUTER})
MOE_CHOICES = ("moe_act", "moe", "shared_experts", "router")  # only for mixture-of-experts layers


def _combinations():
    """Every op level a policy can name, e.g. "selective+moe", -> the union of the names it drops."""
    levels = {(): frozenset()}
    for group in CHOICES:
        levels.update({key + (name,): unstored | names for key, unstored in list(levels.items())
                       for name, names in group.items()})
    return {"+".join(key): unstored for key, unstored in levels.items() if key}


OP_LEVEL = _combinations()  # "selective", "cheap", "moe", "selective+moe_act", ... -> names dropped


class Mode(str):
    """A layer mode, parsed once: "all", "all:LEVEL", "input" or "none". LEVEL names an op level (a key of
    OP_LEVEL when the engine runs it; the planner's tests give their chains' variants other names)."""

    def __new__(cls, text):
        mode = super().__new__(cls, text)
        kind, _, level = text.partition(":")
        if kind not in ("all", "input", "none") or (level and kind != "all"):
            raise ValueError(f"layer mode {text!r}: use all, all:LEVEL (an op level, e.g. all:cheap), input or none")
        mode.stored = kind == "all"  # its activations are kept
        mode.keeps_input = kind != "none"  # its input is a checkpoint
        mode.level = level or None  # its own op level; None: the policy's
        return mode

    def unstored(self, policy_unstored):
        """The names this layer drops: its own op level's, or else the policy's."""
        return OP_LEVEL[self.level] if self.level else policy_unstored


ALL = Mode("all")


@dataclass(frozen=True)
class Schedule:
    """The layer modes of one step. forward[i]: mode in the first forward.
    sweep(k, target): mode of layer k when a backward sweep recomputes up to `target`.
    host[k]: the names of layer k's first forward whose puts go to host memory (picockpt/recompute/offload.py;
    "*": all it stores); recomputed layers stay on the device. None: nothing is offloaded."""
    forward: tuple
    sweep_modes: dict = None      # target -> {k: mode}; None means "all" for every layer
    head: str = "all"             # the model head's op level: "all" (the policy's) or "all:cheap"
    stop_early: bool = False      # a recompute sweep skips its last layer's tail (picockpt/model/block_tail.py)
    host: tuple = None            # per layer, a frozenset of names offloaded in the first forward

    def __post_init__(self):  # every mode parsed once, here
        object.__setattr__(self, "forward", tuple(Mode(mode) for mode in self.forward))
        if self.host is not None:
            object.__setattr__(self, "host", tuple(frozenset(names) for names in self.host))
            if len(self.host) != len(self.forward):
                raise ValueError(f"Schedule.host has {len(self.host)} entries: give one set of names per layer "
                                 f"({len(self.forward)})")
        object.__setattr__(self, "head", Mode(self.head))
        if self.sweep_modes is not None:
            object.__setattr__(self, "sweep_modes", {target: {k: Mode(mode) for k, mode in modes.items()}
                                                     for target, modes in self.sweep_modes.items()})

    def sweep(self, k, target):
        return ALL if self.sweep_modes is None else self.sweep_modes[target][k]

    def sweeps(self, layers):
        """[(first, last)] of every recompute sweep a step over `layers` layers runs, in the backward's
        order: the engine's walk (picockpt/recompute/engine.py: Step.backward) over the modes alone. The one walk:
        the planner's replay and every per-rank closed form take their sweeps from here."""
        inputs = {k for k in range(layers) if self.forward[k].keeps_input}  # checkpoints stored
        whole = {k for k in range(layers) if self.forward[k].stored}  # layers stored whole
        out = []
        for i in reversed(range(layers)):
            if i not in whole:  # gone: recomputed from the nearest checkpoint below it
                j = max(k for k in inputs if k <= i)
                out.append((j, i))
                inputs.update(k for k in range(j, i + 1) if self.sweep(k, i).keeps_input)
                whole.update(k for k in range(j, i + 1) if self.sweep(k, i).stored)
            whole.discard(i)  # its backward pops it all
            inputs.discard(i)
        return out

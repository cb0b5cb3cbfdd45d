"""ZeRO inside the one rank step (rank.py): what a rank holds of its stage's weights, their gathers around each use,
and their gradients reduced as soon as they are final. It takes the place of the stage's data-parallel buckets and
whole weights (dp_model.py); everything else of the step is unchanged, so ZeRO stacks on every other parallelism.

What is sharded is whatever the rank holds (its stage's units, of its tp slices, its experts). A unit
(zero_params.py) is sharded over the group its gradients are summed over (layout.py): every weight but the experts'
over the dp x ep x cp ranks (torchtitan's dp_shard_cp mesh under cp), an expert's over its dp x cp ranks.

Weights: under stages 1 and 2 every unit whole; under stage 3 the rank's shard, all-gathered before each use and
freed after it. The head stays gathered from its forward to its backward (as torchtitan's apply_fsdp_to_decoder);
keep_gathered=True keeps a layer a recompute sweep gathered until its backward (FSDP2 gathers a recomputed block once
in the backward: fsdp_peer.py), "step" every unit from its first use to its last (zero_forms.kept_after).
prefetch=True starts the next use's gather before this use computes, as FSDP's does. Gradients accumulate whole over
the stage's micro-batches and are reduced once final: stage 1 all-reduces a unit's flat gradient, stages 2 and 3
reduce-scatter it. Optimizer (steps > 0): picockpt/measurement/train.py's AdamW on the rank's shards only
(elementwise: bit for bit the whole tensor's update of those elements); stages 1 and 2 then all-gather them.
"""
import contextlib

import torch

from ...measurement.train import make_optimizer
from ..comm import all_reduce, reduce_scatter
from ..expert_parallel.ep_shard import is_expert
from .zero_forms import kept_after
from .zero_params import FlatUnit, gather_flat, unit_names


def stage_units(shapes, layers, first, last, sizes, split=None):
    """{key: [FlatUnit]}: a key's parameters over the group of size sizes[False], those split(name) marks
    (the experts) apart, over the group of size sizes[True]."""
    units = {}
    for key, names in unit_names(list(shapes), layers, first, last).items():
        parts = {False: [n for n in names if not (split and split(n))], True: [n for n in names if split and split(n)]}
        units[key] = [FlatUnit(members, shapes, sizes[part]) for part, members in parts.items() if members]
    return units


class Sharded:
    """One unit on this rank over its group (comm None: a group of one): the flat weights whole (stages 1, 2) or
    its shard, and after the backward the gradient of its shard."""

    def __init__(self, unit, comm, params, stage, dtype):
        self.unit, self.comm, self.rank = unit, comm, comm.rank if comm is not None else 0
        flat = unit.flatten(params, dtype)  # (padded,)
        self.params = flat if stage < 3 or comm is None else unit.shard(flat, self.rank).clone()  # (padded,) | (s,)
        self.shard = self.params if self.params.numel() == unit.shard_numel else unit.shard(self.params, self.rank)
        self.grad = None  # (padded,) accumulating, then the reduced shard (s,)

    def whole(self):
        return self.params.numel() == self.unit.padded  # held whole: nothing to gather


class ZeroShards:
    """A rank's ZeRO state for its stage, and the stage's data part as dp_model.py's Replicated is (weights, use, add,
    ready, finish). params: the rank's tensors under the full names; layout: the job's Layout (its zero stage,
    keep_gathered, prefetch; under ep the experts apart); forms: the stage's ChunkForms (its layers, first, last);
    comms: {False: dense group, True: experts' group} (a Comm or None); uses: [(phase, key)] of every gathered use
    (stage 3)."""

    def __init__(self, params, cfg, layout, forms, comms, uses=None, lr=3e-3, weight_decay=0.0):
        stage, split = layout.zero, is_expert if layout.ep > 1 else None
        self.cfg, self.stage, self.prefetch = cfg, stage, layout.prefetch
        sizes = {part: comm.world_size if comm is not None else 1 for part, comm in comms.items()}
        shapes = {name: tensor.shape for name, tensor in params.items()}
        units = stage_units(shapes, forms.layers, forms.first, forms.last, sizes, split)
        self.units = {key: [Sharded(unit, comms[bool(split and split(unit.names[0]))], params, stage, cfg.param_dtype)
                            for unit in group] for key, group in units.items()}
        self.optimizer = make_optimizer({f"{key}.{n}": part.shard for key, parts in self.units.items()
                                         for n, part in enumerate(parts)}, lr, weight_decay)
        self.parts = [part for parts in self.units.values() for part in parts]  # every unit's, in order
        self.owner = {name: part for part in self.parts for name in part.unit.names}
        self.uses, self.next_use, self.tracker = uses, 0, None
        self.kept = [kept_after(uses, n, layout.keep_gathered) for n in range(len(uses or ()))]  # stays gathered?
        self.gathered = {}  # key -> [(work, flat)]: in use, kept, or prefetched (maybe still under way)
        self.gathered_peak = dict.fromkeys(("forward", "recompute", "backward"), 0)  # bytes, as measured

    def weights(self):
        """{name: weight} the stage starts from: whole units as views of their flat buffers; a gathered unit's
        as views of a meta buffer (read for the shape only, replaced by gathered views during each use)."""
        return {name: view for part in self.parts for name, view in part.unit.views(
            part.params if part.whole() else torch.empty(part.unit.padded, device="meta")).items()}

    def begin(self, tracker):
        """A step starts: the first use again (stage 3), the tracker its gathers are marked in, no gradients."""
        self.tracker, self.next_use = tracker, 0
        for part in self.parts:
            part.grad = None

    @contextlib.contextmanager
    def use(self, key):
        """{name: weight} of unit `key` for one use: whole, or gathered for it (stage 3)."""
        parts = [part for part in self.units[key] if not part.whole()]  # a whole one is in the stage's weights
        if not parts:
            yield {}
            return
        phase, n = self.tracker.phase_name, self.next_use
        if self.uses[n] != (phase, key):
            raise RuntimeError(f"ZeRO-3 use {n}: the loop asked for ({phase!r}, {key!r}), the schedule "
                               f"for {self.uses[n]}: the prefetch order no longer matches the engine's walk")
        self.next_use += 1
        if key not in self.gathered:  # else kept, or prefetched (its gather maybe still under way)
            self.gathered[key] = self.gather(key, phase)
        for work, _ in self.gathered[key]:
            work.wait()  # returns at once if done
        if self.prefetch and n + 1 < len(self.uses):  # the next use's gather, under way while this one computes
            next_phase, upcoming = self.uses[n + 1]
            if upcoming not in self.gathered:  # the unit in use: no second copy
                self.gathered[upcoming] = self.gather(upcoming, next_phase)
        live = sum(flat.nbytes for gathered in self.gathered.values() for _, flat in gathered)
        self.gathered_peak[phase] = max(self.gathered_peak[phase], live)
        yield {name: view for part, (_, flat) in zip(parts, self.gathered[key])
               for name, view in part.unit.views(flat).items()}  # views into the gathered buffers
        if not self.kept[n]:
            del self.gathered[key]  # freed (the views die with the caller's)

    def gather(self, key, phase):
        out = []
        for part in (part for part in self.units[key] if not part.whole()):
            shard = part.params.to(self.cfg.torch_dtype)  # (s,) in the compute dtype (a no-op in fp32)
            work, flat = gather_flat(shard, part.comm, phase, part.unit.padded, async_op=True)  # under the use's phase
            self.tracker.mark(flat, "weights")
            out.append((work, flat))
        return out

    def add(self, name, grad):
        part = self.owner[name]
        if part.grad is None:  # the unit's first gradient this step: its flat buffer, accumulated into
            part.grad = torch.zeros(part.unit.padded, dtype=self.cfg.param_dtype, device=grad.device)  # (padded,)
            self.tracker.mark(part.grad, "gradients")
        part.unit.views(part.grad)[name].add_(grad.to(part.grad.dtype))

    def ready(self, bucket):
        """The bucket's gradients are final: reduce each of its units (a stage's bucket "embedding": unit "embed")."""
        for part in self.units["embed" if bucket == "embedding" else bucket]:
            if part.comm is not None and self.stage == 1:
                part.grad = all_reduce(part.grad, part.comm)  # (padded,) every rank's sum, in place
            elif part.comm is not None:
                part.grad = reduce_scatter(part.grad, part.comm, dim=0)  # (s,) its shard's sum; the whole is freed
                self.tracker.mark(part.grad, "gradients")

    def finish(self):
        pass  # every reduction ran in ready(): ZeRO's are blocking here

    events = ()  # no overlapped buckets to draw on the timeline

    def step(self, tracker):
        """One AdamW step on the rank's shards, then (stages 1, 2) every unit whole again."""
        for part in self.parts:
            part.shard.grad = part.grad if part.grad.numel() == part.shard.numel() else \
                part.unit.shard(part.grad, part.rank)  # (s,)
        self.optimizer.step()
        for value in self.optimizer_tensors():
            tracker.mark(value, "optimizer")
        for part in self.parts:
            part.shard.grad = None  # part.grad, the step's reduced gradient, lives until the next step begins
            if self.stage < 3 and part.comm is not None:
                part.params.copy_(gather_flat(part.shard, part.comm, "optimizer", part.unit.padded))  # (padded,)

    def optimizer_tensors(self):
        return [value for state in self.optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor)]

    def bytes(self):
        """{param_bytes, grad_bytes, optimizer_bytes} this rank holds now."""
        return {"param_bytes": sum(p.params.nbytes for p in self.parts),
                "grad_bytes": sum(p.grad.nbytes for p in self.parts if p.grad is not None),
                "optimizer_bytes": sum(value.nbytes for value in self.optimizer_tensors())}

    def whole_tensors(self, grads=False):
        """{name: tensor} the rank's whole parameters (or gradients), its group's shards gathered (uncounted):
        what the caller compares with the single process, put together like plain data parallelism's."""
        out = {}
        for part in self.parts:
            flat = part.grad if grads else part.params
            if flat.numel() != part.unit.padded:  # booked as "check", after the report was made
                flat = gather_flat(flat, part.comm, "check", part.unit.padded)  # (padded,)
            out.update({name: view.clone() for name, view in part.unit.views(flat).items()})
        return out

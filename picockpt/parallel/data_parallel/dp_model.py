"""Data parallelism as a wrap of a rank's stage, as ZeRO is (zero_shards.py): what the stage reads its weights from and
where it puts its gradients. The stage (pipeline_parallel/pp_stage.py) knows neither buckets nor shards, only this
part's calls, which ZeroShards makes too:

    weights()        {name: weight} the stage starts from (here the whole weights in the compute dtype, cast once)
    use(unit)        a context around every read of unit "embed", k or "head": {name: view} to read instead (ZeRO-3's
                     gathered views; here nothing, every weight is whole)
    add(name, grad)  a micro-batch's gradient, accumulated
    ready(unit)      the unit's gradients are final: here its bucket's all-reduce starts (dp_comm.py)
"""
import contextlib

from ..expert_parallel.ep_shard import is_expert
from .dp_comm import GradientBuckets
from .zero_params import unit_names


class Replicated:
    """Plain data parallelism: the rank holds its stage's whole weights; its gradients go to buckets (dp_comm.py), one
    GradientBuckets per group: the data-parallel one, and under ep the experts' (split(name) True) apart."""

    def __init__(self, params, dtype, parts, split):
        self.params, self.dtype, self.parts, self.split = params, dtype, parts, split

    def weights(self):
        return {name: tensor.to(self.dtype) for name, tensor in self.params.items()}  # 16-bit copies when mixed

    def use(self, unit):
        return contextlib.nullcontext({})  # whole already: nothing to gather

    def add(self, name, grad):
        self.parts[self.split(name)].add(name, grad)

    def ready(self, unit):
        for part in (part for part in self.parts if unit in part.flat):
            part.ready(unit)

    def finish(self):
        for part in self.parts:
            part.finish()

    def grads(self):
        return {name: grad for part in self.parts for name, grad in part.views.items()}

    @property
    def events(self):
        return [event for part in self.parts for event in part.events]


def replicated(cfg, params, stage_forms, groups, overlap, timeline, tracker):
    """The stage's Replicated part: its gradient buckets all-reduced over the data-parallel group as they become
    final; under ep the experts' apart, over their expert-data-parallel group (picockpt/parallel/layout.py)."""
    units = unit_names(list(params), stage_forms.layers, stage_forms.first, stage_forms.last)
    # {bucket: [parameter names]} in the order they become final: head, layers from the top, embedding
    names = {"embedding" if key == "embed" else key: members for key, members in reversed(units.items())}
    shapes = {name: tensor.shape for name, tensor in params.items()}
    split = is_expert if groups.layout.ep > 1 else (lambda name: False)
    parts = []
    for expert, comm in enumerate((groups.dp_comm, groups.expert_dp_comm)[:1 + (groups.layout.ep > 1)]):
        kept = {bucket: [name for name in members if split(name) == expert] for bucket, members in names.items()}
        parts.append(GradientBuckets({bucket: members for bucket, members in kept.items() if members}, shapes,
                                     cfg.param_dtype, groups.device, comm, overlap, timeline, tracker))
    return Replicated(params, cfg.torch_dtype, parts, split)

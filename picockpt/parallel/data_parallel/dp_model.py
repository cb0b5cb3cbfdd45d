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
from .dp_comm import ExpertAndDenseBuckets, GradientBuckets
from .zero_params import unit_names


class Replicated:
    """Plain data parallelism: the rank holds its stage's whole weights; its gradients go to buckets (dp_comm.py)."""

    def __init__(self, params, dtype, buckets):
        self.params, self.dtype, self.buckets = params, dtype, buckets

    def weights(self):
        return {name: tensor.to(self.dtype) for name, tensor in self.params.items()}  # 16-bit copies when mixed

    @contextlib.contextmanager
    def use(self, unit):
        yield {}  # whole already: nothing to gather

    def add(self, name, grad):
        self.buckets.add(name, grad)

    def ready(self, unit):
        self.buckets.ready(unit)

    def finish(self):
        self.buckets.finish()

    def grads(self):
        return self.buckets.grads()

    @property
    def events(self):
        return self.buckets.events


def replicated(cfg, params, stage_forms, groups, overlap, timeline, tracker):
    """The stage's Replicated part: its gradient buckets all-reduced over the data-parallel group as they become
    final; under ep the experts' apart, over their expert-data-parallel group (picockpt/parallel/layout.py)."""
    names = bucket_names(params, stage_forms.layers, stage_forms.first, stage_forms.last)
    shapes = {name: tensor.shape for name, tensor in params.items()}

    def make(comm, keep):
        kept = {bucket: [name for name in members if keep(name)] for bucket, members in names.items()}
        return GradientBuckets({bucket: members for bucket, members in kept.items() if members}, shapes,
                               cfg.param_dtype, groups.device, comm, overlap, timeline, tracker)
    if groups.layout.ep == 1:
        buckets = make(groups.dp_comm, lambda name: True)
    else:
        buckets = ExpertAndDenseBuckets(make(groups.dp_comm, lambda name: not is_expert(name)),
                                        make(groups.expert_dp_comm, is_expert), is_expert)
    return Replicated(params, cfg.torch_dtype, buckets)


def bucket_names(params, layers, first, last):
    """{bucket: [parameter names]} of a stage in the order they become final: head, layers from the top, embedding."""
    units = unit_names(list(params), layers, first, last)
    return {"embedding" if key == "embed" else key: names for key, names in reversed(units.items())}

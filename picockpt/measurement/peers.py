"""PyTorch's own recomputation, applied to the autograd reference model, for side-by-side runs.

Each peer is a run_layers(layers, x) function for ReferenceLlama.forward:

    autograd        no recomputation: autograd saves what each op's backward needs
    per_layer       torch.utils.checkpoint around every layer            (~ picockpt "full")
    sequential(n)   checkpoint_sequential in n segments; note that it does *not* checkpoint
                    the last segment, whose backward comes first         (~ picockpt "every:C")
    selective(T)    checkpoint with a selective policy (create_selective_checkpoint_contexts)
                    that recomputes only the attention core, the ops making the (B, H, T, T)
                    scores: q k^T, its scaling and masking, the softmax, the dropout on it
                                                                          (~ picockpt "selective")
                    Every other op is MUST_SAVE, and selective checkpointing caches the output
                    of every MUST_SAVE op, needed by the backward or not: more than autograd keeps.
    save_matmuls(T) the policy PyTorch's documentation shows: keep the matmul outputs, recompute
                    everything else (norms, RoPE, softmax, SiLU) and q k^T    (~ picockpt "cheap")

Host memory instead of recomputation:

    SaveOnCpu(run)  torch.autograd.graph.save_on_cpu(pin_memory=True) around another peer's layers: every tensor
                    autograd saves there is packed into a host buffer and unpacked back to its device in the backward,
                    with copies issued on the current stream (its pack and unpack hooks, torch/autograd/graph.py).
                    SaveOnCpu(autograd) ~ picockpt "none+offload"; SaveOnCpu(per_layer) ~ picockpt "offload". The host
                    buffers are remembered (weakly) so a Tracker can count them apart from device memory.

One peer wraps the whole model instead of its layers:

    min_cut(model, budget)  the model through AOTAutograd with torch.compile's min-cut partitioner
                    (torch._functorch.partitioners.min_cut_rematerialization_partition) under
                    torch._functorch.config.activation_memory_budget = budget (1.0: save what the
                    partitioner likes, 0.0: save only the inputs). One joint graph of the whole step
                    is cut into a forward and a backward graph; the backward graph recomputes what
                    the forward did not save, wherever in the graph that is (no segments).
                    With dropout it is wrong: below budget 1 the partitioner may recompute aten.rand
                    in the backward, which draws fresh numbers (pytorch/pytorch#190758, open).

Which ops are the attention core is decided by where they run in reference.Attention, not by their sizes: a size test
such as "the last two dims are (T, T)" also takes every (B, T, h) tensor when T = h (the norms, the residual adds) and
every (B, H, T, hd) one when T = hd. Attention runs exactly two batched matmuls per layer, q k^T and then P v (the
projections are 2-D matmuls), and every op between them makes or reads the scores; so the core is the ops from the first
batched matmul up to, not including, the second.
"""
import weakref

import torch
import torch._functorch.config as functorch_config
from torch._functorch.aot_autograd import aot_module, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts)

from .reference import run_plain

autograd = run_plain


def per_layer(layers, x):
    for layer in layers:
        x = checkpoint(layer, x, use_reentrant=False)
    return x


def sequential(segments):
    def run(layers, x):
        return checkpoint_sequential(list(layers), segments, x, use_reentrant=False)
    return run


def _attention_core(seq):
    """A fresh inside(ctx, op, args) for one checkpointed layer: is this op in the attention core?
    Counted apart in the forward and in the backward's recomputation, which replays the same ops."""
    batched_matmuls = {False: 0, True: 0}  # ctx.is_recompute -> aten.bmm calls seen so far

    def inside(ctx, op, args):
        if op == torch.ops.aten.bmm.default:
            batched_matmuls[ctx.is_recompute] += 1
            if batched_matmuls[ctx.is_recompute] % 2 == 1:  # q k^T: (n, T, hd) @ (n, hd, T)
                query, keys = args[0], args[1]
                if query.shape[-2] != seq or keys.shape[-1] != seq:
                    raise ValueError(f"peers.selective / save_matmuls(seq={seq}): a layer's first batched matmul "
                                     f"is {tuple(query.shape)} @ {tuple(keys.shape)}, not q k^T making (.., {seq}, "
                                     f"{seq}) scores; build the peer with the sequence length it runs on")
        return batched_matmuls[ctx.is_recompute] % 2 == 1  # from q k^T up to P v, which is outside
    return inside


def _checkpoint_each(decide, seq):
    """Checkpoint every layer with the selective policy decide(in_core, op): each layer gets its own
    count of batched matmuls (context_fn runs once per checkpoint call)."""
    def context():
        inside = _attention_core(seq)
        return create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: decide(inside(ctx, op, args), op))

    def run(layers, x):
        for layer in layers:
            x = checkpoint(layer, x, use_reentrant=False, context_fn=context)
        return x
    return run


def selective(seq):
    def decide(in_core, op):
        return CheckpointPolicy.PREFER_RECOMPUTE if in_core else CheckpointPolicy.MUST_SAVE
    return _checkpoint_each(decide, seq)


def save_matmuls(seq):
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)

    def decide(in_core, op):
        keep = op in matmuls and not in_core  # the projections and P v; not q k^T
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return _checkpoint_each(decide, seq)


class SaveOnCpu:
    """run_layers(layers, x) of another peer, under torch.autograd.graph.save_on_cpu(pin_memory=True)."""

    def __init__(self, run_layers):
        self.run_layers, self.packed = run_layers, []

    def __call__(self, layers, x):
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)
        pack = hooks.pack_hook  # PyTorch's own: (device, host copy)

        def counted(tensor):
            device, packed = pack(tensor)
            self.packed.append(weakref.ref(packed))
            return device, packed
        hooks.pack_hook = counted  # read when the context is entered
        with hooks:
            return self.run_layers(layers, x)

    def host_tensors(self):
        """The host copies packed since the last call and still alive (then forgotten)."""
        alive = [ref() for ref in self.packed]
        self.packed.clear()
        return [tensor for tensor in alive if tensor is not None]


def min_cut(model, budget, graphs=None):
    """model(*inputs) through AOTAutograd with the min-cut partitioner at activation_memory_budget
    `budget` (0 <= budget <= 1). No Dynamo and no code generation: the two graphs run op by op, so a
    Tracker sees every tensor they make (torch.compile itself runs eagerly under a dispatch mode).
    The first call traces and partitions (seconds); run it once before measuring. A dict passed as
    `graphs` receives the partitioned fx graphs under "forward" and "backward"."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ValueError(f"min_cut(budget={budget!r}): activation_memory_budget is a fraction, 0 <= budget <= 1 "
                         f"(1.0 saves what the partitioner likes, 0.0 recomputes everything it can)")

    def partition(joint, inputs, **kwargs):  # the budget holds while this graph is cut, nowhere else
        with functorch_config.patch(activation_memory_budget=float(budget)):
            forward, backward = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        if graphs is not None:
            graphs.update(forward=forward.graph, backward=backward.graph)
        return forward, backward

    def as_it_is(graph, _):  # the graph's own forward, op by op
        return make_boxed_func(graph.forward)
    return aot_module(model, fw_compiler=as_it_is, bw_compiler=as_it_is, partition_fn=partition)

"""One tensor-parallel rank's model, as the engine's loop sees it (picockpt/engine.py: Step). The loop is the single
process's, line for line (a recompute runs the recomputed layers' collectives again); only the parts differ: the
embedding and head are vocab.py's, the layers tp_layer.py's, and a checkpoint may be kept as this rank's 1/t of it.

Distributed saved activations (Megatron-LM's --distribute-saved-activations; Korthikanti et al. sec. 5): without sp each
rank would keep the same whole layer input as its checkpoint, t copies of one tensor; with distribute_saved=True each
keeps 1/t of it, the flat tensor in t equal parts (Megatron's split_tensor_into_1d_equal_chunks), all-gathered by a
recompute sweep before it runs the layer again (gather_split_1d_tensor): memory for communication, counted under
"recompute". Only checkpoint-only inputs are split: a layer stored whole keeps its whole input (its backward reads it).
"""
from ...engine import Model
from ...layer import layer_backward, layer_forward
from ...params import EMBED
from .tp_comm import gather_sequence_forward
from .tp_inventory import rank_layer_inventory
from .tp_layer import TensorParallelCrossings
from .vocab import embedding_backward_parallel, embedding_forward_parallel, head_backward_parallel
from .vocab import head_forward_parallel


class TensorParallelModel(Model):  # Model.start: this step's weights (this rank's), rotary tables
    """params: this rank's slices (tp_shard.py) under the full names; input_ids, targets: the whole batch (B, T)."""

    def __init__(self, params, cfg, input_ids, targets, comm, sp=False, distribute_saved=False):
        names = list(rank_layer_inventory(cfg, *input_ids.shape, comm.world_size, sp))  # what a layer could keep
        super().__init__(params, cfg, input_ids, targets, names)
        self.comm, self.sp, self.distribute_saved = comm, sp, distribute_saved
        self.split = set()  # layers whose stored input is this rank's 1/t of it (distribute_saved)
        self.cross = TensorParallelCrossings(comm, sp, cfg.dropout)  # where picockpt/layer.py's layer crosses ranks

    def embed(self):
        return embedding_forward_parallel(self.input_ids, self.weights[EMBED], self.comm, self.sp)  # (B, n, h)

    def keep_input(self, store, k, x, whole):
        if self.distribute_saved and not whole:  # a checkpoint only: keep this rank's 1/t of it
            self.shape = x.shape  # (B, T, h)
            x = x.reshape(-1).chunk(self.comm.world_size)[self.comm.rank].clone()  # (B*T*h/t,) a copy of its own
            self.split.add(k)
        store.put(k, "input", x)  # (B, n, h), or (B*T*h/t,)

    def load_input(self, store, k, whole):
        """The input of layer k, whole, for a recompute sweep from it. A split one is all-gathered; when the
        sweep stores layer k whole, the whole input replaces the split one (layer k's backward reads it)."""
        if k not in self.split:
            return store.get(k, "input")  # (B, n, h)
        part = store.pop(k, "input") if whole else store.get(k, "input")  # (B*T*h/t,)
        x = gather_sequence_forward(part, self.comm, dim=0).view(self.shape)  # (B, T, h) all-gather: whole again
        if whole:
            self.split.discard(k)
            store.put(k, "input", x)
        return x

    def layer_forward(self, k, x, store, drop, tail):
        return layer_forward(x, self.weights_of[k], self.cfg, self.rope, store, k, drop, tail, self.cross)  # (B, n, h)

    def layer_backward(self, k, dx, store):  # -> dx (B, n, h) and this rank's LayerWeights of gradients
        return layer_backward(dx, self.weights_of[k], self.cfg, self.rope, store, k, self.cross)

    def head_forward(self, x, store, drop):
        return head_forward_parallel(x, self.weights, self.cfg, self.targets, store, self.comm, self.sp, drop)

    def head_backward(self, store):
        return head_backward_parallel(self.weights, self.cfg, self.targets, store, self.comm, self.sp)

    def embed_backward(self, dx):
        shape = self.weights[EMBED].shape  # (V/t, h)
        return embedding_backward_parallel(dx, self.input_ids, shape, self.comm, self.sp)  # (V/t, h)

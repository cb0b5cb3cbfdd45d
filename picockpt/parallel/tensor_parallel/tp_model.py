"""What tensor parallelism changes in a rank's model (picockpt/parallel/rank_model.py): the embedding and head are
vocab.py's, the layer's hooks tp_layer.py's, and a checkpoint may be kept as this rank's 1/t of it.

Distributed saved activations (Megatron-LM's --distribute-saved-activations; Korthikanti et al. sec. 5): without sp each
rank would keep the same whole layer input as its checkpoint, t copies of one tensor; with distribute_saved=True each
keeps 1/t of it, all-gathered by a recompute sweep before it runs the layer again: memory for communication, counted
under "recompute". Only checkpoint-only inputs are split (a layer stored whole reads its input whole)."""
from ...model.params import EMBED
from .tp_comm import gather_sequence_forward
from .tp_forms import rank_layer_inventory
from .tp_layer import TensorParallelHooks
from .vocab import embedding_backward_parallel, embedding_forward_parallel


def apply_tensor_parallel(model, comm, sp=False, distribute_saved=False):
    """Make a RankModel (picockpt/parallel/rank_model.py) a tensor-parallel rank's, its params this rank's slices."""
    model.layer_names = list(rank_layer_inventory(model.cfg, *model.input_ids.shape, comm.world_size, sp))
    model.hooks, model.vocab = TensorParallelHooks(comm, sp, model.cfg.dropout, model.hooks), VocabParallel(comm, sp)
    if distribute_saved:
        model.checkpoints = DistributedSaved(comm)
    return model


class VocabParallel:
    """A tensor-parallel rank's embedding: vocab.py's on its V/t rows (its head: head.py's, crossing in tp_layer.py)."""

    def __init__(self, comm, sp):
        self.comm, self.sp = comm, sp

    def embed(self, model):
        return embedding_forward_parallel(model.input_ids, model.weights[EMBED], self.comm, self.sp)  # (B, n, h)

    def embed_backward(self, model, dx):
        return embedding_backward_parallel(dx, model.input_ids, model.weights[EMBED].shape, self.comm, self.sp)


class DistributedSaved:
    """distribute_saved=True: a checkpoint-only layer input kept as this rank's 1/t of it."""

    def __init__(self, comm):
        self.comm, self.split = comm, set()  # layers whose stored input is this rank's 1/t of it

    def keep_input(self, store, k, x, whole):
        if not whole:  # a checkpoint only: keep this rank's 1/t of it
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

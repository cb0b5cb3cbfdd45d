"""What tensor parallelism changes in a rank's model (picockpt/parallel/rank_model.py): the layer's hooks, embedding
and head are tp_layer.py's (on vocab.py's rows), and a checkpoint may be kept as this rank's 1/t of it.

Distributed saved activations (Megatron-LM's --distribute-saved-activations; Korthikanti et al. sec. 5): without sp each
rank would keep the same whole layer input as its checkpoint, t copies of one tensor; with distribute_saved=True each
keeps 1/t of it, all-gathered by a recompute sweep before it runs the layer again: memory for communication, counted
under "recompute". Only checkpoint-only inputs are split (a layer stored whole reads its input whole)."""
from .tp_comm import gather_sequence_forward
from .tp_forms import rank_layer_inventory
from .tp_layer import TensorParallelHooks


def apply_tensor_parallel(model, comm, sp=False, distribute_saved=False):
    """Make a RankModel (picockpt/parallel/rank_model.py) a tensor-parallel rank's, its params this rank's slices."""
    model.layer_names = list(rank_layer_inventory(model.cfg, *model.input_ids.shape, comm.world_size, sp))
    model.hooks = model.vocab = TensorParallelHooks(comm, sp, model.cfg.dropout, model.hooks)  # vocab: its embed
    if distribute_saved:
        model.checkpoints = DistributedSaved(comm)
    return model


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

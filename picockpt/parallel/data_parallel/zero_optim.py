"""What one ZeRO rank keeps from step to step, and its optimizer step on its own shards.

    state = ZeroState(params, cfg, stage, comm, lr=3e-3, weight_decay=0.0)
    state.params[key]     stages 1, 2: the unit's whole flat parameters (padded,); stage 3: its shard (s,)
    state.grads[key]      after a backward: the gradient of its shard, (s,) (zero_model.py puts it there)
    state.step(comm)      AdamW on every shard; stages 1 and 2 then all-gather the updated shards

The optimizer is picockpt/train.py's make_optimizer, the single process's AdamW (betas 0.9, 0.95,
foreach=False), given this rank's shards as its parameters: one flat (s,) tensor per unit. AdamW is
elementwise (every moment and update of an element reads only that element), so stepping a shard
computes, bit for bit, what stepping the whole tensor computes for those elements; padding elements have
a zero gradient and stay zero. Its state (exp_avg, exp_avg_sq) exists for the shards only: K Psi / N_d.

Stages 1 and 2 hold the whole parameters for the next forward: each unit's updated shards are
all-gathered (the "optimizer" phase) into its flat buffer; the rank's own shard is a view of that buffer,
which the optimizer updated in place. Stage 3 gathers nothing here: the next forward gathers each unit.
"""
import torch

from ...train import make_optimizer
from .zero_params import flat_units, gather_flat


class ZeroState:
    def __init__(self, params, cfg, stage, comm, lr=3e-3, weight_decay=0.0):
        self.cfg, self.stage, self.rank = cfg, stage, comm.rank
        self.units = {unit.key: unit for unit in flat_units(cfg, comm.world_size)}
        self.params, self.grads = {}, {}
        for key, unit in self.units.items():
            flat = unit.flatten({name: params[name].to(comm.device) for name in unit.names}, cfg.param_dtype)
            self.params[key] = flat if stage < 3 else unit.shard(flat, comm.rank).clone()  # (padded,) or (s,)
        self.weights = {key: self.units[key].views(flat) for key, flat in self.params.items()} if stage < 3 else None
        self.shards = {key: flat if stage == 3 else self.units[key].shard(flat, comm.rank)  # (s,) a view, stages 1, 2
                       for key, flat in self.params.items()}  # the tensors the optimizer updates in place
        self.optimizer = make_optimizer({str(key): shard for key, shard in self.shards.items()}, lr, weight_decay)

    def shard(self, key):
        """(s,) this rank's shard of a unit's parameters (a view of the whole flat under stages 1 and 2)."""
        return self.shards[key]

    def param_pieces(self):
        """{name: tensor}: the whole parameters (stages 1, 2) or this rank's pieces of them (stage 3)."""
        if self.stage < 3:
            return {name: tensor for views in self.weights.values() for name, tensor in views.items()}
        return {name: piece for key, unit in self.units.items()
                for name, piece in unit.pieces(self.params[key], self.rank).items()}

    def step(self, comm, tracker=None):
        """One AdamW step on this rank's shards, then (stages 1, 2) every unit whole again."""
        for key in self.units:
            self.shard(key).grad = self.grads[key]  # (s,)
        self.optimizer.step()
        for key in self.units:
            self.shard(key).grad = None
        self.grads.clear()
        if tracker is not None:
            for value in self.optimizer_tensors():
                tracker.mark(value, "optimizer")
        if self.stage < 3:
            for key, unit in self.units.items():
                self.params[key].copy_(gather_flat(self.shard(key), comm, "optimizer", unit.padded))  # (padded,)

    def optimizer_tensors(self):
        return [value for state in self.optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor)]

    def bytes(self):
        """{param_bytes, optimizer_bytes} this rank holds now, by unique storage."""
        return {"param_bytes": storage_bytes(self.params.values()),
                "optimizer_bytes": storage_bytes(self.optimizer_tensors())}


def storage_bytes(tensors):
    """Bytes of the unique storages under these tensors (views of one buffer count once)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())

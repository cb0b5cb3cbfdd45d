"""One ZeRO rank's model, as the engine's loop sees it (picockpt/engine.py: Step): the loop is the single
process's, line for line; only where a unit's weights come from and where its gradients go differ.

Rank r of N_d computes rows r*B/N_d .. (r+1)*B/N_d - 1 of the batch. Its head scales the loss and every
gradient out of the head by n_r / n (its counted targets over the whole batch's), so the ranks' gradients
add up to the whole batch's (expert_parallel/ep_model.py does the same).

Weights (a unit at a time: zero_params.py's embed, layer k, head):
    stages 1, 2   every unit whole on every rank, as plain data parallelism: nothing gathered
    stage 3       rank r holds its shard of each unit; before each use the unit is all-gathered, after it
                  freed. A use is the embedding's forward, a layer's forward, its recompute (every sweep
                  that runs it again) and its backward, the head's forward and backward. Two exceptions:
                    the head stays gathered from its forward to its backward, which follows at once
                    (torchtitan's apply_fsdp_to_decoder does not reshard the final norm and output after
                    the forward);
                    keep_gathered=True: a layer gathered by a recompute sweep stays gathered until its
                    backward, so the backward needs no gather of its own: one gather fewer per recomputed
                    layer, for holding a whole sweep's layers at once (C under every:C). FSDP2 gathers a
                    recomputed block once in the backward under either nesting (fsdp_peer.py counts both):
                    fully_shard(checkpoint(block)) gathers in the pre-backward hook on the unit's outputs,
                    before the recompute unpacks; checkpoint(fully_shard(block)) reruns the unit's forward
                    hooks, which find it gathered during the backward and leave it so.
                  prefetch=True: the gather of the next use's unit starts, asynchronously, before this use
                  computes, as FSDP's forward and backward prefetch do; it is booked under its own use's phase.
Gradients, as soon as a unit's are final (right after its backward):
    stage 1       one all-reduce of the unit's flat gradient: every rank holds the whole gradient
    stages 2, 3   one reduce-scatter: rank r keeps the sum of its shard only, returned as its pieces
                  (zero_params.py) under the parameters' names; the whole flat gradient is freed

The order of uses is known from the schedule (zero_inventory.gather_uses); every use checks that the loop
came in that order (a prefetch bets on it).
"""
import contextlib

import torch

from ...engine import Model
from ...head import head_backward, head_forward
from ...layer import layer_backward, layer_forward
from ...ops import embedding_backward, embedding_forward, rope_tables
from ...ops.cross_entropy import IGNORE_INDEX
from ...params import EMBED, layer_key, layer_weights
from ..comm import all_reduce, reduce_scatter
from ..rng import Part, full_size_draws
from .zero_inventory import gather_uses, kept_after
from .zero_params import gather_flat


class ZeroModel(Model):
    """state: a ZeroState (zero_optim.py: this rank's units, flat params or shards); input_ids, targets:
    this rank's rows; counted: the whole batch's counted targets; schedule: the step's Schedule."""

    def __init__(self, state, cfg, input_ids, targets, comm, counted, schedule, keep_gathered=False, prefetch=True):
        super().__init__(state.param_pieces(), cfg, input_ids, targets)  # params: its pieces, under HF names
        self.state, self.comm, self.keep_gathered, self.prefetch = state, comm, keep_gathered, prefetch
        self.share = int((targets != IGNORE_INDEX).sum()) / counted  # n_r / n
        self.rows = Part(comm.rank, comm.world_size)  # its rows of every dropout mask
        self.uses = gather_uses(cfg, schedule) if state.stage == 3 else None
        self.next_use = 0
        self.gathered, self.pending = {}, {}  # unit -> (padded,) flat weights; unit -> (work, flat) under way
        self.gathered_peak = dict.fromkeys(("forward", "recompute", "backward"), 0)  # bytes, as measured

    def start(self, tracker):  # the rotary tables; under stages 1 and 2 every unit's weights, whole
        self.tracker = tracker
        self.rope = rope_tables(self.cfg, self.input_ids.shape[1], self.input_ids.device, self.cfg.torch_dtype)

    # -- the parts the loop calls ------------------------------------------------------------------
    def embed(self):
        with self.use("embed") as w:
            return embedding_forward(self.input_ids, w[EMBED])  # (b, T, h)

    def layer_forward(self, k, x, store, drop, tail):
        with self.use(k) as w, full_size_draws(self.rows, dim=0, dropout=self.cfg.dropout):  # its rows of the masks
            return layer_forward(x, layer_weights(w, k), self.cfg, self.rope, store, k, drop, tail)  # (b, T, h)

    def layer_backward(self, k, dx, store):
        with self.use(k) as w:
            dx, grads = layer_backward(dx, layer_weights(w, k), self.cfg, self.rope, store, k)  # (b, T, h)
        mine = self.reduce(k, {layer_key(k, role): grad for role, grad in grads._asdict().items()})
        return dx, type(grads)(*(mine[layer_key(k, role)] for role in grads._fields))

    def head_forward(self, x, store, drop):
        with self.use("head") as w:
            loss = head_forward(x, w, self.cfg, self.targets, store, drop)  # mean over this rank's targets
        return loss * self.share if self.share else torch.zeros_like(loss)  # its share of the whole mean

    def head_backward(self, store):
        with self.use("head") as w:
            dx, grads = head_backward(w, self.cfg, self.targets, store)  # (b, T, h), of this rank's mean
        return dx * self.share, self.reduce("head", {name: grad * self.share for name, grad in grads.items()})

    def embed_backward(self, dx):
        grad = embedding_backward(dx, self.input_ids, self.state.units["embed"].shapes[0])  # (V, h): no weight needed
        return self.reduce("embed", {EMBED: grad})[EMBED]

    # -- weights: whole, or gathered around each use -----------------------------------------------
    @contextlib.contextmanager
    def use(self, key):
        unit = self.state.units[key]
        if self.state.stage < 3:
            yield self.state.weights[key]  # {name: whole weight}
            return
        phase = self.tracker.phase_name
        expected = self.uses[self.next_use]
        if expected != (phase, key):
            raise RuntimeError(f"ZeRO-3 use {self.next_use}: the loop asked for ({phase!r}, {key!r}), the schedule "
                               f"for {expected}: the prefetch order no longer matches the engine's walk")
        self.next_use += 1
        flat = self.acquire(key, phase)
        if self.prefetch and self.next_use < len(self.uses):
            self.launch(*self.uses[self.next_use])
        self.note(phase)
        yield unit.views(flat)  # {name: weight}, views into the gathered buffer
        if not kept_after(phase, key, self.keep_gathered):
            del self.gathered[key]  # freed (the views die with the caller's locals)
        del flat

    def acquire(self, key, phase):
        if key not in self.gathered:
            if key in self.pending:  # prefetched
                work, flat = self.pending.pop(key)
                work.wait()
            else:
                flat = self.gather(key, phase, async_op=False)
            self.gathered[key] = flat
        return self.gathered[key]

    def launch(self, phase, key):
        if key not in self.gathered and key not in self.pending:  # the unit in use is in gathered: no second copy
            self.pending[key] = self.gather(key, phase, async_op=True)

    def gather(self, key, phase, async_op):
        unit = self.state.units[key]
        shard = self.state.params[key].to(self.cfg.torch_dtype)  # (s,) in the compute dtype (a no-op in fp32)
        out = gather_flat(shard, self.comm, phase, unit.padded, async_op)  # (padded,) or (work, (padded,))
        self.tracker.mark(out[1] if async_op else out, "weights")
        return out

    def note(self, phase):
        live = sum(flat.nbytes for flat in self.gathered.values()) + sum(f.nbytes for _, f in self.pending.values())
        self.gathered_peak[phase] = max(self.gathered_peak[phase], live)

    # -- gradients -------------------------------------------------------------------------------
    def reduce(self, key, grads):
        """{name: this rank's gradient}: the unit's flat gradient all-reduced (stage 1) or reduce-scattered."""
        unit, stage, comm = self.state.units[key], self.state.stage, self.comm
        flat = unit.flatten(grads, self.cfg.param_dtype)  # (padded,) in the master dtype
        del grads
        if stage == 1:
            flat = all_reduce(flat, comm)  # (padded,) every rank's sum, in place
            mine, shard = unit.views(flat), unit.shard(flat, comm.rank)  # {name: whole gradient}; (s,) a view
        else:
            shard = reduce_scatter(flat, comm, dim=0)  # (s,) the sum of its shard; the whole flat is freed
            mine = unit.pieces(shard, comm.rank)  # {name: (n_r,)} views into it
        del flat
        self.tracker.mark(shard, "gradients")
        self.state.grads[key] = shard  # what the optimizer steps its shard with
        return mine

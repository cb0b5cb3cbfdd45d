"""One pipeline stage, and one micro-batch of it as the engine's loop (engine.py: Step) sees it: the loop runs
unchanged; only the model's parts differ. The first stage embeds, later ones receive the previous stage's activation
(stored as the first layer's checkpoint); the last stage runs the head and loss, earlier ones send their output on and
receive its gradient (recompute-early: the top segment recomputed while it travels); ZB-H1's W (split_backward) runs the
weight gradients each matmul deferred (ops/linear.py: deferred_weight_grads), what they read waiting in a store of its
own. The stage's `data` part (data_parallel/dp_model.py) gives its weights and takes its gradients.

The mean over all tokens: the single process's loss is (sum of the counted tokens' losses) / N, N the whole batch's
counted targets. A micro-batch's head takes the mean over its n_m counted targets, so its loss and gradients are
scaled by n_m / N, and the shares of the micro-batches (and data- and context-parallel ranks) sum to the whole
batch's mean. A micro-batch with no counted target adds 0 (its 0 / 0 loss unused, its gradients already 0).

Dropout draws the single process's masks: each micro-batch's forward starts from the single process's generator
state at the stage's first layer and draws the *whole batch's* masks, keeping its rows (rng.py's full-size draws
along the batch dim: block d*M + m of dp*M), so replaying a checkpoint's state redraws them, at M*dp times the random
numbers. Stage s > 0 starts from stage s-1's state after its first micro-batch's forward, sent with it.
"""
import contextlib
from dataclasses import dataclass

from ...recompute.engine import device_generator
from ...model.params import EMBED, layer_key, layer_weights
from ...ops import rope_tables
from ...ops.linear import WeightGrad, deferred_weight_grads, weight_grad
from .pp_comm import (from_previous_stage_backward, from_previous_stage_forward, to_next_stage_backward,
                      to_next_stage_forward)
from ..rng import RowBlock, full_size_draws


@dataclass(frozen=True)
class StageShared:
    """What every chunk of a rank's stage shares (one chunk but under interleaving)."""
    cfg: object
    params: dict                 # {name: tensor} the rank holds (its slices, its experts)
    pipe: object                 # its neighbours (pp_comm.py: Pipe)
    data: object                 # data parallelism's part: Replicated or ZeroShards (data_parallel/dp_model.py)
    counted: int                 # N: the whole batch's counted targets
    microbatches: int
    dp_rank: int
    dp: int
    activation_shape: tuple      # what crosses from one stage to the next, per rank (b, n, h)
    model_for_rows: object       # model_for_rows(ids, tgt): the rank's model of those rows (rank.py: inner_model)
    recompute_early: bool = False
    split_backward: bool = False  # ZB-H1: a backward's B and W run as two actions


class PipelineStage:
    """One chunk of a rank's stage (its layers; the embedding if first, the head if last) over what they share
    (StageShared, whose fields it reads as its own), its weights and the RNG states."""

    def __init__(self, shared, layers, first, last):
        self.shared, self.layers, self.first, self.last = shared, layers, first, last
        self.step_cfg = shared.cfg.replace(tie_embeddings=False)  # a tied matrix's two uses are summed by the caller
        self.rng_start = self.rng_end = None  # the generator at the stage's first layer / after its last

    def __getattr__(self, name):  # cfg, params, pipe, data, counted, microbatches, ...: StageShared's
        return getattr(self.shared, name)

    def start(self, tracker, device, seq, like=None):
        """The stage's weights for every micro-batch (16-bit copies under mixed precision), once; under ZeRO the
        shards' (whole, or under stage 3 shapes only until each use gathers them). like: another chunk of the same
        rank (interleaved), whose weights and rotary tables this one shares."""
        if like is not None and like is not self:
            self.weights, self.rope = like.weights, like.rope
        else:
            self.weights = self.data.weights()
            for tensor in (tensor for tensor in self.weights.values() if tensor.device.type != "meta"):
                tracker.mark(tensor, "weights")
            self.rope = rope_tables(self.cfg, seq, device, self.cfg.torch_dtype)  # (T, hd) x2
        self.weights_of = {k: layer_weights(self.weights, k) for k in self.layers}

    @contextlib.contextmanager
    def weights_for(self, unit):
        """Unit "embed", k or "head" readable for one use: under ZeRO-3 gathered for it, its views in the weights
        the inner model reads, then its shapes again (the gathered buffer freed, or kept, as zero_shards.py says)."""
        def put(weights):  # in the weights the inner model reads, and in a layer's own view of them
            self.weights.update(weights)
            if weights and unit in self.weights_of:
                self.weights_of[unit] = layer_weights(self.weights, unit)
        with self.data.use(unit) as views:  # none: whole already
            before = {name: self.weights[name] for name in views}
            put(views)
            yield
            put(before)


class StageModel:
    """Micro-batch m of a PipelineStage; `step` is set to the Step that runs it (recompute-early uses its loop)."""

    def __init__(self, stage, m, rank_model, waiting=None):
        self.stage, self.m, self.rank_model, self.step = stage, m, rank_model, None
        self.waiting = waiting  # split_backward: an ActivationStore for what its W reads
        self.cfg, self.layers = stage.step_cfg, stage.layers  # the rest (params, input_ids, ...): rank_model's
        self.mean_share = int((rank_model.targets != -100).sum()) / stage.counted  # n_m / N
        self.rows = RowBlock(stage.dp_rank * stage.microbatches + m, stage.dp * stage.microbatches)  # its batch rows
        self.generator = device_generator(rank_model.input_ids.device)

    def __getattr__(self, name):  # params, input_ids, targets, layer_names, keep_input, load_input: the model's
        return getattr(self.rank_model, name)

    def start(self, tracker):  # the inner model reads the stage's weights (picockpt/recompute/engine.py: Model.start)
        rank_model, stage = self.rank_model, self.stage
        rank_model.weights, rank_model.rope, rank_model.weights_of = stage.weights, stage.rope, stage.weights_of

    def embed(self):
        stage, draws = self.stage, self.cfg.draws_random
        if draws and not stage.first and self.m == 0:  # the state the single process has at this stage's first layer
            like = self.generator.get_state()  # (n,) uint8
            stage.rng_start = from_previous_stage_forward(stage.pipe, like.shape, like.dtype, "rng_state").cpu()
        if stage.first:
            with stage.weights_for("embed"):
                x = self.rank_model.embed()  # (b, n, h)
        else:
            x = from_previous_stage_forward(stage.pipe, stage.activation_shape, self.cfg.torch_dtype)  # (b, n, h)
        if draws:  # every micro-batch draws the whole batch's masks again, from rng_start (stage 0: the caller's)
            self.generator.set_state(stage.rng_start)
        return x

    def layer_forward(self, k, x, store, unstored, tail):
        with full_size_draws(self.rows, dim=0, dropout=1.0 if self.cfg.draws_random else 0), \
                self.stage.weights_for(k):  # its rows of each mask; layer k's weights
            return self.rank_model.layer_forward(k, x, store, unstored, tail)  # (b, n, h)

    def layer_backward(self, k, dx, store):
        stage = self.stage
        with stage.weights_for(k), deferred_weight_grads(stage.split_backward):
            dx, grads = self.rank_model.layer_backward(k, dx, store)  # (b, n, h), LayerWeights
        for role, grad in grads._asdict().items():
            if isinstance(grad, WeightGrad):  # B only: what dW reads waits for the W (the store counts x once)
                self.waiting.put(k, f"{role}.output_grad", grad.output_grad)  # (b, n, out)
                self.waiting.put(k, f"{role}.input", grad.input)  # (b, n, in)
                grads = grads._replace(**{role: None})
            else:
                stage.data.add(layer_key(k, role), grad)
        if self.m == stage.microbatches - 1 and not stage.split_backward:  # the last backward: k's gradients final
            stage.data.ready(k)
        return dx, grads

    def weight_backward(self):
        """ZB-H1's W: every weight gradient its B deferred, layers from the top, dW = dy.T x each (no weights
        read: under ZeRO-3 nothing is gathered), added to the buckets, final after the last micro-batch's."""
        stage, waiting = self.stage, self.waiting
        with self.step.tracker.phase("backward"):
            for k in reversed(self.layers):
                for role in dict.fromkeys(name.rpartition(".")[0] for name in waiting.names(k)):
                    dy, x = waiting.pop(k, f"{role}.output_grad"), waiting.pop(k, f"{role}.input")
                    stage.data.add(layer_key(k, role), weight_grad(dy, x))  # (out, in)
                    del dy, x
                if self.m == stage.microbatches - 1:
                    stage.data.ready(k)
        assert waiting.bytes == 0, f"the W left {waiting.names(None)} stored"

    def head_forward(self, x, store, unstored):
        stage = self.stage
        if not stage.last:
            if self.cfg.draws_random and self.m == 0:  # the next stage's first layer starts from this state
                to_next_stage_forward(self.generator.get_state().to(stage.pipe.device), stage.pipe, "rng_state")
            to_next_stage_forward(x, stage.pipe)
            return x.new_zeros(())  # no loss on this stage
        if self.cfg.draws_random and self.m == 0:
            stage.rng_end = self.generator.get_state()  # where the single process's step leaves the generator
        with stage.weights_for("head"):
            loss = self.rank_model.head_forward(x, store, unstored)  # the mean over this micro-batch's counted targets
        return loss * self.mean_share if self.mean_share else loss.new_zeros(())  # its share of the whole batch's mean

    def head_backward(self, store):
        stage = self.stage
        if not stage.last:
            receive = to_next_stage_backward(stage.pipe, stage.activation_shape, self.cfg.torch_dtype)  # started
            if stage.recompute_early and self.layers[-1] not in self.step.whole:  # recompute-early, while dy travels:
                self.step.recompute(self.layers[-1])  # the loop's first work (the top layer), then found stored
            return receive.wait(), {}  # (b, n, h)
        with stage.weights_for("head"):
            dx, grads = self.rank_model.head_backward(store)  # (b, n, h) for this micro-batch's mean
        for name, grad in grads.items():
            stage.data.add(name, grad.mul_(self.mean_share))  # in place: grads holds the whole batch's too
        if self.m == stage.microbatches - 1:
            stage.data.ready("head")
        return dx.mul_(self.mean_share), grads  # (b, n, h) for the whole batch's mean

    def embed_backward(self, dx):
        stage = self.stage
        if not stage.first:
            from_previous_stage_backward(dx, stage.pipe)
            return dx.new_zeros(())  # no embedding on this stage
        grad = self.rank_model.embed_backward(dx)  # (V, h), or (V/t, h)
        stage.data.add(EMBED, grad)
        if self.m == stage.microbatches - 1:
            stage.data.ready("embedding")
        return grad

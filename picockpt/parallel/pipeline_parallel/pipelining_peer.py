"""The peer for pipeline schedules: torch's own torch.distributed.pipelining running its interleaved schedules on the
autograd reference model (picockpt/measurement/reference.py), split into P*V stage modules, one launch of P gloo ranks.

    results = run_ranks(pipelining_rank_steps, 2, params, cfg, input_ids, targets, SCHEDULES, 2, 4)
    results[r][v] == {"schedule": name, "stages": [virtual stages on rank r], "loss": float (None off the last
                      stage's rank), "grads": {full name: gradient} of the parameters rank r holds,
                      "peak_saved_bytes": b, "actions": ["0F0", "2F0", "2I0", "2W0", ...]}
                     # or {"schedule": name, "error": "..."} when it did not run; one fresh model per schedule

actions: the rank's compute actions in the schedule's order (str of torch's _Action: stage, F forward, B full
backward, I input-only backward, W weight backward, micro-batch). Virtual stage k of S = P*V holds layers
[k*L//S, (k+1)*L//S) (stage 0 the embedding, stage S-1 the final norm and LM head), on rank k % P ("loop" style,
torch 2.13's generate_stage_to_rank_mapping), or under ScheduleZBVZeroBubble ("v" style, V = 2) rank s holds s and
2P-1-s. Each PipelineStage gets example input_args and output_args, so every stage is STATIC and no
metadata-inference forward runs (it would run the real module, its saved tensors in the count).

Loss scaling: torch's default (scale_grads=True with a mean loss_fn) divides every gradient by n_microbatches, the
whole batch's mean only when every micro-batch counts as many targets. Here scale_grads=False and the scaling in
loss_fn, as torchtitan's build_pipeline_schedule does: a micro-batch's summed cross-entropy / N, N the whole batch's
counted targets, as picockpt's own stages take it (pp_stage.py); the losses sum to the batch's mean, whatever the split.

peak_saved_bytes: the most bytes autograd held saved for backward at once on the rank (saved_tensors_hooks around
schedule.step), a storage counted once however many saved tensors view it, the parameters' storages not at all. The
holder keeps tensor.detach(): a saved *output* held as given holds its grad_fn, a cycle only the node's release
breaks, and zero bubble's W never releases the nodes that lead only to the stage's input (about half of each
micro-batch's bytes stayed held after the step; with the detached copy every step ends at 0). Under zero bubble an I
frees nothing of the stage's layers: a micro-batch's saved tensors stay until its W. Measured (P=2, V=2, M=4, a layer
per stage), the peak follows the most stage-micro-batches in flight: rank 0 holds 5 under Interleaved1F1B but 4 under
InterleavedZeroBubble (each W right after its I); rank 1 holds 3 under 1F1B but 4 under zero bubble (3W0 deferred).

fp32 only in earnest (a 16-bit config casts each weight at each use). Dropout, router jitter and tied embeddings
raise. A schedule that raises ends every rank (a rank going on alone would post receives against another schedule's
sends). The batch is made contiguous first: torch <= 2.11 checks each micro-batch's strides against the stage's
contiguous metadata. A schedule this torch cannot run is reported as {"error": ...} on every rank, before any starts it.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...device import torch_version
from ...measurement.reference import ReferenceLlama, run_plain

SCHEDULES = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")


class StageModule(nn.Module):
    """One virtual stage of the reference model: its layers (and embedding, or final norm and LM head), the very
    modules of `model`, so the stage's parameters are the model's own."""

    def __init__(self, model, first_layer, end_layer, first, last):
        super().__init__()
        self.layers = nn.ModuleList(model.model.layers[first_layer:end_layer])
        self.embed = model.embed if first else None  # a bound method, not a submodule: embed_tokens below
        self.logits = model.logits if last else None
        if first:
            self.embed_tokens = model.model.embed_tokens  # registered: the schedule's W and scaling see it
        if last:
            self.norm, self.lm_head = model.model.norm, model.lm_head

    def forward(self, x):  # (b, T) token ids on the first stage, (b, T, h) after
        if self.embed is not None:
            x = self.embed(x)  # (b, T, h)
        x = run_plain(self.layers, x)  # (b, T, h)
        return x if self.logits is None else self.logits(x)  # (b, T, V) on the last stage


class SavedBytes:
    """A saved_tensors_hooks pack: the bytes of the distinct storages autograd holds for backward, and their peak."""

    def __init__(self, skip_storages):
        self.skip = set(skip_storages)  # data_ptr of storages not counted (the parameters')
        self.held = {}  # data_ptr -> [saved tensors holding it, its bytes]
        self.now = self.peak = 0

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.skip:
            entry = self.held.setdefault(key, [0, storage.nbytes()])
            if entry[0] == 0:  # the storage's first saved view: its bytes start counting
                self.now += entry[1]
                self.peak = max(self.peak, self.now)
            entry[0] += 1
        return _Packed(tensor.detach(), self, key)  # detached: a saved output would hold its own grad_fn

    def release(self, key):  # a holder was freed
        entry = self.held.get(key)  # None: a skipped storage's
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:  # its last saved view gone
                self.now -= entry[1]
                del self.held[key]


class _Packed:
    """What autograd keeps for one saved tensor; its __del__ runs when the node holding it is freed."""

    def __init__(self, tensor, counter, key):
        self.tensor, self.counter, self.key = tensor, counter, key

    def __del__(self):
        self.counter.release(self.key)


def pipelining_rank_steps(comm, params, cfg, input_ids, targets, schedules=SCHEDULES, V=2, M=4):
    return [pipelining_rank_step(comm, params, cfg, input_ids, targets, name, V, M) for name in schedules]


def pipelining_rank_step(comm, params, cfg, input_ids, targets, schedule, V=2, M=4):
    import torch.distributed.pipelining as pipelining

    if cfg.dropout > 0 or (cfg.experts and cfg.router_jitter > 0) or cfg.tie_embeddings:
        raise ValueError("pipelining peer: use a config without dropout, router jitter or tied embeddings")
    P, r = comm.world_size, comm.rank
    S, L, (B, T) = P * V, cfg.layers, input_ids.shape
    if L < S or B % M:
        raise ValueError(f"pipelining peer: layers={L} must be >= P*V={S} and batch {B} a multiple of M={M}")
    v_style = schedule == "ScheduleZBVZeroBubble"  # its virtual stages (module docstring): "v" style, else "loop"
    if v_style and V != 2:
        raise ValueError(f"ScheduleZBVZeroBubble needs exactly 2 stages per rank, V={V}")
    if v_style and dist.get_backend(comm.group) == "gloo" and torch_version() < (2, 12):  # alike on every rank
        return {"schedule": schedule, "error": f"torch {torch.__version__}'s {schedule} cannot run on gloo: its "
                f"warm-up sends to rank {P - 1}'s own other stage, and gloo has no pair to itself (2.12's does not)"}
    model = ReferenceLlama(cfg, params)  # a fresh model per schedule: gradients start at None
    names = {id(p): name for name, p in model.named_parameters()}
    b, dtype = B // M, cfg.torch_dtype
    stages = []
    for k in [r, 2 * P - 1 - r] if v_style else [c * P + r for c in range(V)]:  # "loop": stage k on rank k % P
        first, last = k == 0, k == S - 1
        module = StageModule(model, k * L // S, (k + 1) * L // S, first, last)
        # static metadata keeps requires_grad too: a received activation, and every output, needs its gradient
        example_in = (torch.zeros(b, T, dtype=torch.long) if first  # (b, T) token ids
                      else torch.zeros(b, T, cfg.hidden, dtype=dtype, requires_grad=True))  # (b, T, h)
        example_out = torch.zeros(b, T, cfg.vocab if last else cfg.hidden, dtype=dtype, requires_grad=True)
        stages.append(pipelining.PipelineStage(module, k, S, comm.device, input_args=example_in,
                                               output_args=example_out))
    counted = (targets != -100).sum().item()  # N: the whole batch's counted targets (IGNORE_INDEX is -100)

    def loss_fn(logits, target):  # (b, T, V), (b, T): this micro-batch's share of the whole-batch mean
        return F.cross_entropy(logits.to(cfg.stat_dtype).flatten(0, 1), target.flatten(), reduction="sum") / counted

    runner = getattr(pipelining, schedule)(stages, n_microbatches=M, loss_fn=loss_fn, scale_grads=False)
    saved = SavedBytes(p.untyped_storage().data_ptr() for p in model.parameters())
    losses = []
    input_ids, targets = input_ids.contiguous(), targets.contiguous()  # a view's strides fail the stage's check
    inputs = (input_ids,) if any(stage.is_first for stage in stages) else ()  # (B, T) split into M micro-batches
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda packed: packed.tensor):
        runner.step(*inputs, target=targets, losses=losses)
    grads = {names[id(p)]: p.grad.detach().clone() for stage in stages for p in stage.submod.parameters()}
    loss = float(sum(loss.item() for loss in losses)) if losses else None  # the last stage's rank only
    actions = [str(action) for action in runner.pipeline_order[r] if action is not None]  # None: an idle step
    return {"schedule": schedule, "stages": [stage.stage_index for stage in stages], "loss": loss, "grads": grads,
            "peak_saved_bytes": saved.peak, "actions": actions}

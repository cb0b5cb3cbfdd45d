"""The bytes one rank of a layout holds: its stage's layers, the model state each ZeRO stage leaves it, the activations
its micro-batches in flight store, and a reserve for what no closed form counts.

    layers       two splits of L layers over p stages: "even" (picockpt's stage_layers: L // p each, the first L % p one
                 more) and "lighter ends" (the Llama 3 paper's, Grattafiori et al. 2024 sec. 3.3.2: the first and
                 last stages one layer fewer than the others, since they also hold the embedding and the head):
                 L + 2 spread evenly, one taken back from each end
    model state  bytes a parameter, bf16 compute with fp32 master weights, fp32 gradients and AdamW's two fp32 moments,
                 over the d ranks that hold the same weights:
                   0       18         DDP: bf16 weights, fp32 master, gradients and moments, all whole
                   1       6 + 12/d   Megatron's distributed optimizer (docs/source/api-guide/dist_optimizer.md):
                                      bf16 weights and fp32 gradients whole, fp32 master and moments sharded
                   2       2 + 16/d   gradients reduce-scattered every micro-batch, so they stay sharded
                   3       16/d       FSDP: everything sharded; the bf16 weights of two layers gathered at a time
                   3+keep  6 + 16/d   FSDP2 without resharding after the forward (torchtitan's default with
                                      pipelining): the gathered bf16 weights (its mixed precision's param_dtype)
                                      kept for the step, and under pipelining the unsharded gradients accumulated
                                      in the reduce dtype (fp32) until the last micro-batch's backward
                                      reduce-scatters them
    activations  pipeline_parallel/pp_forms.py's stage_plan on the stage's layers and seq/cp tokens: (w - 1) E +
                 the micro-batch's own peak, w = min(p - s, M) in flight under 1F1B; ZB-H1 adds what stage s's s
                 waiting W's read. Interleaved, the rank's order walked chunk by chunk (pp_schedules.actions): its
                 warm-up of 2 (p - s - 1) + (V - 1) p chunk forwards leaves every stage about p micro-batches, p + (p
                 - 1 - 2s) / V, not 1F1B's p - s (stage 0's 1 + (p - 1)/(p V) is Korthikanti et al. 2022, sec.
                 4.2.3, the simpler model's form); under the lighter ends the embedding and the head take a layer's
                 place in the first and last chunk (Grattafiori et al. 2024, sec. 3.3.2)
    reserve      RESERVE_BYTES below: an assumption, stated, not a measurement
"""
import functools

from ..model.config import BYTES
from ..parallel.layout import Layout
from ..parallel.pipeline_parallel.pp_forms import stage_plan
from ..parallel.pipeline_parallel.pp_orders import w_pending_bytes
from ..parallel.pipeline_parallel.pp_schedules import actions, stage_layers

ZERO_STAGES = ("0", "1", "2", "3", "3+keep")
SPLITS = ("even", "lighter ends")
GATHERED_LAYERS = 2  # ZeRO 3: the layer that runs and the next one, prefetched (FSDP's default forward prefetch)

# What the closed forms leave out, held back from every GPU's capacity. ASSUMPTIONS, not measurements:
CUDA_CONTEXT_BYTES = 2**29  # 0.5 GiB: the CUDA context and cuBLAS/cuDNN workspaces (assumed; it varies by driver)
NCCL_BUFFER_BYTES = 4 * 2**20 * 2 * 32 * 4  # 1 GiB: NCCL_BUFFSIZE's default 4 MiB (NCCL's environment-variable docs),
#                                             a send and a receive buffer, 32 channels, 4 communicators (tp, cp, pp, dp)
#                                             (the channel and communicator counts assumed)
FRAGMENTATION = 0.05  # the caching allocator's blocks that are reserved but not allocated: 5% of the peak (assumed;
#                       lesson 25 measures it for picockpt's own steps)


def reserve_bytes(peak):
    """Bytes a rank needs beyond the closed forms' `peak`: context, NCCL's buffers and fragmentation (assumed)."""
    return CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES + int(FRAGMENTATION * peak)


@functools.lru_cache(maxsize=None)
def places(layers, count, split="even"):
    """The layers of each of `count` consecutive places (stages, or interleaving's virtual stages): "even" as
    stage_layers; "lighter ends" L + 2 spread evenly, one taken back from each end for the embedding and the head
    (an end may be left with none: the paper's first chunk holds only the embedding)."""
    if split == "even" or count == 1:
        return tuple(len(r) for r in stage_layers(layers, count))
    counts = [len(r) for r in stage_layers(layers + 2, count)]
    counts[0], counts[-1] = counts[0] - 1, counts[-1] - 1
    return tuple(counts)


def split_layers(layers, pp, split="even"):
    """The number of layers of each of pp stages (places): the lighter ends need at least one layer at each end."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {', '.join(SPLITS)}")
    counts = places(layers, pp, split)
    if min(counts) < 1:
        raise ValueError(f"split='lighter ends' with pp={pp} of {layers} layers leaves an end stage empty: use "
                         f"pp <= {(layers + 2) // 2} or split='even'")
    return counts


def chunk_layers(layers, pp, virtual, split, stage):
    """The layers of each of rank `stage`'s chunks: virtual stage c p + s holds chunk c of rank s (places)."""
    return places(layers, pp * virtual, split)[stage::pp]


def splits_for(layers, pp):
    """The splits that differ and fit: "even", and "lighter ends" where it is another split."""
    if pp > 1 and (layers + 2) // pp >= 2 and split_layers(layers, pp, "lighter ends") != split_layers(layers, pp):
        return "even", "lighter ends"
    return ("even",)


def stage_params(cfg, tp, counts, stage):
    """Parameters one rank of `stage` holds: its layers' matrices split tp ways (norms whole), the embedding on stage
    0, the final norm and LM head on the last (vocab-parallel). counts: split_layers()."""
    h, hd, pp = cfg.hidden, cfg.head_dim, len(counts)
    matrices = h * cfg.heads * hd * 2 + 2 * h * cfg.kv_heads * hd + 3 * h * cfg.ffn
    vocab = cfg.vocab * h // tp
    return (counts[stage] * (matrices // tp + 2 * h) + (vocab if stage == 0 else 0)
            + (vocab * (1 if cfg.tie_embeddings and pp == 1 else 0 if cfg.tie_embeddings else 1) + h
               if stage == pp - 1 else 0))


def model_state_bytes(params, zero, shards, layers=1, frameworks=True):
    """Bytes of model state a rank holds for `params` parameters of `layers` layers (the table above). frameworks
    False: the simpler accounting it replaced, fp32 weights, gradients and moments (16 bytes) sharded stage by stage
    (Rajbhandari et al. 2020) and 16-bit copies beside them, fp32 under 3+keep."""
    d = shards
    gathered = 2 * params * min(GATHERED_LAYERS, layers) // max(1, layers) if zero == "3" else 0
    if not frameworks:
        stage = int(zero[0])
        fp32 = 4 / (d if stage >= 3 else 1) + 4 / (d if stage >= 2 else 1) + 8 / (d if stage >= 1 else 1)
        return int(params * fp32) + (gathered if zero == "3" else 2 * params) + (4 * params if zero == "3+keep" else 0)
    per_param = {"0": 18, "1": 6 + 12 / d, "2": 2 + 16 / d, "3": 16 / d, "3+keep": 6 + 16 / d}[zero]
    return int(params * per_param) + gathered


@functools.lru_cache(maxsize=None)
def microbatch_store(cfg, seq, tp, sp, cp, layers, last, policy):
    """(E, own peak) of one micro-batch of one sequence (seq/cp tokens) on a stage of `layers` layers (the head if
    last): what its forward leaves stored, and its peak during its own step (pp_forms.stage_plan)."""
    _, _, held, peak, _, _ = stage_plan(policy, cfg, 1, seq // cp, layers, last, 1, Layout(tp=tp, sp=sp))
    return held, peak


def chunk_store(cfg, seq, layout, layers, last, policy):
    """(E, own peak) of one micro-batch on a chunk of `layers` layers (none: only the embedding, which stores nothing
    here, or only the head, what it adds to a layer)."""
    tp, sp, cp = layout.tp, layout.sp and layout.tp > 1, layout.cp
    if layers:
        return microbatch_store(cfg, seq, tp, sp, cp, layers, last, policy)
    if not last:
        return 0, 0
    (with_head, head_peak), (layer, _) = (microbatch_store(cfg, seq, tp, sp, cp, 1, end, policy)
                                          for end in (True, False))
    return with_head - layer, head_peak - layer


@functools.lru_cache(maxsize=None)
def chunks_in_flight(pp, microbatches, stage, virtual):
    """The moments of rank `stage`'s interleaved order that can be its peak, as (micro-batches of each chunk held,
    the chunk whose backward runs or None): pp_plan.in_flight_peak's walk, with the bytes left out (made once per
    order). A moment that holds no more of any chunk than another with the same backward running never holds more
    bytes (a chunk's bytes are not negative), so only the undominated ones are kept: walked largest sum first, a
    moment dominated by any other is dominated by one already kept (dominance is transitive and raises the sum)."""
    held, moments = [0] * virtual, set()
    for kind, _, c in actions("interleaved", pp, microbatches, stage, virtual):
        if kind == "F":
            held[c] += 1
        moments.add((tuple(held), c if kind == "B" else None))
        if kind == "B":
            held[c] -= 1
            moments.add((tuple(held), None))
    kept = {}  # the backward's chunk -> its undominated counts
    for counts, b in sorted(moments, key=lambda m: -sum(m[0])):
        if not any(all(x <= y for x, y in zip(counts, other)) for other in kept.setdefault(b, [])):
            kept[b].append(counts)
    return tuple((counts, b) for b, undominated in kept.items() for counts in undominated)


def interleaved_activation_bytes(cfg, seq, layout, chunks, stage, policy):
    """The store's peak of rank `stage` under interleaved 1F1B, each chunk with its (E, own peak) (chunks:
    chunk_layers()): the most any moment of its order holds, a backward's chunk at its own peak."""
    last = stage == layout.pp - 1
    stores = tuple(chunk_store(cfg, seq, layout, n, last and c == len(chunks) - 1, policy)
                   for c, n in enumerate(chunks))
    return most_held(stores, layout.pp, layout.microbatches, stage, layout.virtual_stages)


@functools.lru_cache(maxsize=2**16)
def most_held(stores, pp, microbatches, stage, virtual):
    """The most bytes a moment of rank `stage`'s interleaved order holds, each chunk's (E, own peak) in `stores`
    (made once for the layouts that differ only in what does not change them: dp, ZeRO)."""
    return max(sum(n * held for n, (held, _) in zip(counts, stores))
               + (stores[b][1] - stores[b][0] if b is not None else 0)
               for counts, b in chunks_in_flight(pp, microbatches, stage, virtual))


def stage_activation_bytes(cfg, seq, tp, sp, cp, layers, last, in_flight, policy):
    """The store's peak of one rank of such a stage with `in_flight` micro-batches under 1F1B: (w - 1) E + own peak,
    exact to the parallel runs (tests/test_parallel_pp.py)."""
    held, peak = microbatch_store(cfg, seq, tp, sp, cp, layers, last, policy)
    return (in_flight - 1) * held + peak


def stage_bytes(cfg, seq, layout, counts, stage, zero, policy, frameworks=True, split=None):
    """{part: bytes} of one rank of `stage` (of the layers `counts` split over the layout's stages): model state
    under `zero` (ZERO_STAGES: the state layouts frameworks hold, sharded over the layout's dp x cp ranks),
    activations, a K/V gather (cp) and the reserve (frameworks False: the simpler state accounting, no reserve).
    split: the split `counts` came from, for interleaving's chunks walked in order (None: Korthikanti's factor)."""
    pp, tp, cp, V, schedule = len(counts), layout.tp, layout.cp, layout.virtual_stages, layout.schedule
    sp, M = layout.sp and tp > 1, layout.microbatches
    params = stage_params(cfg, tp, counts, stage)
    if schedule == "interleaved" and split is not None:
        act = interleaved_activation_bytes(cfg, seq, layout, chunk_layers(cfg.layers, pp, V, split, stage), stage,
                                           policy)
    else:
        act = stage_activation_bytes(cfg, seq, tp, sp, cp, counts[stage], stage == pp - 1, min(pp - stage, M), policy)
        if schedule == "interleaved" and stage == 0:
            act = int(act * (1 + (pp - 1) / (pp * V)))
    if schedule == "zb-h1":  # stage s also holds what its s waiting W's read (pp_orders.py)
        act += stage * counts[stage] * w_pending_bytes(cfg, 1, seq // cp, tp)
    kv = 2 * seq * cfg.kv_heads // tp * cfg.head_dim * BYTES[cfg.dtype] if cp > 1 else 0  # one layer's gathered K/V
    parts = {"model_state": model_state_bytes(params, zero, layout.dp * cp, counts[stage], frameworks),
             "activations": act, "kv_gather": kv}
    parts["reserve"] = reserve_bytes(sum(parts.values())) if frameworks else 0
    return parts

"""The time of one micro-batch on one rank of a layout's stage, term by term, and the data-parallel traffic that does
not hide; each term with its source. layout_search.py composes them into a step.

A micro-batch on one rank of a stage:
    compute      the stage's layers (and the head on the last), forward and backward (twice the forward's FLOPs) kernel
                 by kernel at the rates kernel_rates.py gives each shape (the roofline, cost.py, with Model.kernels
                 off), and every micro-batch each weight gradient accumulated into its fp32 buffer: the weight-gradient
                 GEMM reads and writes 8 bytes a parameter (Megatron's gradient_accumulation_fusion,
                 fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 into main_grad; FSDP2 accumulates unsharded
                 gradients in its fp32 reduce dtype too), memory-bound when a micro-batch's rows are few
    recompute    none; cheap: the norms' outputs and SwiGLU's product rebuilt, by their bytes; full: the whole forward
                 again, with its tensor- and context-parallel collectives (Megatron's and torch's full recompute rerun
                 the layer from its input)
    tp           two blocks a layer, each a column-parallel then a row-parallel linear (Megatron-LM's
                 megatron/core/tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication):
                   with sequence parallelism: forward an all-gather before and a reduce-scatter after (exposed);
                   backward the output gradient's all-gather (exposed), the input's all-gather again for the weight
                   gradient, launched async under the input-gradient GEMM, and the input gradient's reduce-scatter
                   launched async under the weight-gradient GEMM (each exposed only by what it outlasts them)
                   without: forward one all-reduce after (exposed); backward the column-parallel input gradient's
                   all-reduce, launched async under the weight-gradient GEMM
                 with sequence parallelism the three exposed collectives are chunked under their GEMMs, as
                 TransformerEngine's userbuffers run them (NVIDIA/TransformerEngine transformer_engine/pytorch/module/
                 base.py, initialize_ub's defaults): the column-parallel forward's all-gather and the row-parallel
                 backward's output-gradient all-gather as a "ring_exchange" of tp chunks, the row-parallel
                 forward's reduce-scatter as a "pipeline" of 4 chunks whose collective takes 16 SMs from the GEMM
                 (the better of that and the reduce-scatter exposed: Megatron's --disable-tp-comm-overlap-rs)
    cp           an all-gather of the layer's K/V over the cp ranks (the Llama 3 paper's choice) in the forward,
                 again in the backward and in a full recompute, and a reduce-scatter of their gradients (exposed)
    pp           per micro-batch, the two blocking exchanges of 1F1B's steady state (Megatron's p2p_communication.py:
                 send_forward_recv_backward, send_backward_recv_forward), each one activation's send with its NCCL
                 latency; V times under interleaving: the per-micro-batch overhead a pipeline pays
    dp           over the dp x cp ranks that hold the same weights (torchtitan's dp_shard_cp), one collective a layer
                 (collectives.per_layer_seconds), gradients reduced in fp32, weights gathered in bf16 (torchtitan's
                 mixed-precision defaults): ZeRO 0 an all-reduce, 1 and 3+keep a reduce-scatter, hidden behind the
                 last micro-batch's backward, and a gather behind the first forward; ZeRO 2 a reduce-scatter every
                 micro-batch behind its backward; ZeRO 3 every micro-batch two gathers (forward, backward: a
                 recompute nested inside FSDP's unit shares the backward's, torchtitan's fully_shard(checkpoint(block)))
                 and a reduce-scatter. Each collective is exposed by what it outlasts the compute it hides behind.

Model says which of these corrections are on; each off gives back the simpler model it replaced (lesson 29).
"""
import functools
from dataclasses import dataclass

from .layer_forms import layer_inventory
from .collectives import algorithm_seconds, collective_seconds, members_per_node, per_layer_seconds
from ..model.config import BYTES
from .cost import head_ops, layer_ops, rebuild_seconds
from .kernel_rates import gemm_passes, op_seconds
from ..recompute.schedule import OP_LEVEL

REDUCE_BYTES = 4  # gradients reduced in fp32 and weights gathered in the compute dtype: torchtitan's defaults
#                   (mixed_precision_reduce = "float32", mixed_precision_param = "bfloat16")


@dataclass(frozen=True)
class Model:
    """Which of the model's corrections are on (all, by default); each off gives back the simpler model it replaced,
    so a lesson can show what each one moves:
        topology   collectives by topology, NCCL's choice of ring, tree or PAT, FSDP's one collective a layer;
                   off: every group that leaves a node a ring at one NIC a member, one collective a stage
        sharding   each ZeRO stage's bytes and traffic as frameworks hold and move them (layout_memory.py), and the
                   reserve; off: 16 bytes of fp32 state a parameter sharded by stage, 16-bit copies beside them (fp32
                   under 3+keep), ZeRO 2's gradients reduced once, ZeRO 3 gathering again for a full recompute
        recompute  full recomputation reruns the whole forward; off: the forward less the down projection
        stages     every stage priced, the lighter-ends split, interleaving over whole chunks only; off: the even
                   split, stage 0 and the last alone, interleaving wherever p V <= L
        overlap    Megatron's async backward tensor-parallel collectives, and layouts without sequence parallelism;
                   off: every tensor-parallel collective exposed, sequence parallelism always
        accumulation  every micro-batch's weight gradients accumulated into fp32 (8 bytes a parameter read and
                   written); off: the weight-gradient GEMM writes its 16-bit output once
        kernels    each matmul and flash kernel at the rate its shape reaches (the hardware's KernelRates:
                   kernel_rates.py); off: every kernel at the datasheet's peak (the roofline)
        chunked_tp with sequence parallelism, the forward's all-gather and reduce-scatter and the backward's
                   output-gradient all-gather split into chunks that run under the GEMMs beside them
                   (TransformerEngine's userbuffers: Megatron's --tp-comm-overlap, which needs --sequence-parallel;
                   ring_exchange_exposed, pipelined_exposed); off: those three exposed whole"""
    topology: bool = True
    sharding: bool = True
    recompute: bool = True
    stages: bool = True
    overlap: bool = True
    accumulation: bool = True
    kernels: bool = True
    chunked_tp: bool = True


FULL_MODEL = Model()
ACCUMULATOR_BYTES = 4  # the fp32 gradient buffer a weight-gradient GEMM adds into (Megatron's main_grad)


def accumulation_seconds(ops, weights, e, hw, rates=None):
    """What accumulating the weight gradients into fp32 adds to the backward of `ops`: each weight-gradient GEMM
    reads and writes its accumulator (2 x 4 bytes a weight) where a plain one writes e bytes, its math at its
    shape's rate (the peak when rates is None). weights: {op name: (weights of each of its kernels, ...)}."""
    extra = 0.0
    for op in ops:
        for (flops, nbytes), shape, count in zip(op.kernels, op.shapes, weights.get(op.name, ())):
            rate = hw.matmul if rates is None else rates.gemm_rate(*gemm_passes(shape, "backward")[1], hw.matmul)
            accumulating = nbytes + (2 * ACCUMULATOR_BYTES - e) * count
            extra += max(flops / rate, accumulating / hw.memory) - max(flops / rate, nbytes / hw.memory)
    return extra


def weight_counts(cfg, tp):
    """{op name: weights of each matmul kernel} of a layer and the head, on one of tp ranks (as layer_ops splits)."""
    h, q, kv, f = cfg.hidden, cfg.heads * cfg.head_dim // tp, cfg.kv_heads * cfg.head_dim // tp, cfg.ffn // tp
    return {"qkv": (h * q, h * kv, h * kv), "o_proj": (q * h,), "gate_up": (h * f, h * f), "down": (f * h,),
            "logits": (h * cfg.vocab // tp,)}


def group_seconds(kind, nbytes, ranks, hw, per_node, model=FULL_MODEL, layers=1):
    """`layers` collectives of nbytes / layers over `ranks` GPUs (per_node of them in a node), by the model's rules."""
    if kind == "p2p":
        return collective_seconds(kind, nbytes, ranks, hw, per_node)
    if ranks <= 1:
        return 0.0
    if model.topology:
        return per_layer_seconds(kind, nbytes, layers, ranks, hw, per_node)
    return algorithm_seconds(kind, nbytes, ranks, hw, 1 if per_node < ranks else ranks)["ring"]


UB_SPLITS, UB_SMS = 4, 16  # TransformerEngine's userbuffers defaults for a "pipeline" overlap (module/base.py)


def ring_exchange_exposed(gather, gemm, tp):
    """What an all-gather split into tp chunks, each passed round the ring while the GEMM runs on the chunk before,
    leaves exposed: tp GEMM chunks and tp - 1 transfers, each transfer beside one chunk (TransformerEngine's
    "ring_exchange", num_splits = tp, on the copy engines: the GEMM keeps every SM)."""
    return max(0.0, gather - gemm * (tp - 1) / tp)


def pipelined_exposed(scatter, gemm, sms=None):
    """What a GEMM split into UB_SPLITS chunks, each chunk's reduce-scatter under the next chunk's GEMM, adds to the
    GEMM alone: the last chunk's reduce-scatter, every other one by what it outlasts its GEMM chunk, and the GEMM on
    `sms` less the UB_SMS the collective takes (TransformerEngine's "pipeline": num_splits 4, num_sm 16,
    set_sm_margin); sms None: the GEMM at its rate (the roofline)."""
    slowed = gemm * sms / (sms - UB_SMS) if sms else gemm
    chunk, piece = slowed / UB_SPLITS, scatter / UB_SPLITS
    return slowed - gemm + piece + (UB_SPLITS - 1) * max(0.0, piece - chunk)


@functools.lru_cache(maxsize=None)
def microbatch_seconds(cfg, seq, tp, sp, cp, layers, last, policy, hw, send_node, model=FULL_MODEL):
    """{term: seconds} of one micro-batch's forward, backward and recompute on one rank of a stage of `layers` layers
    (the head if last); "forward" its forward alone. send_node: 2 when the next stage is in the same node, else 1."""
    e, n, h = BYTES[cfg.dtype], seq // cp, cfg.hidden
    sp = sp and tp > 1
    rates = hw.kernels if model.kernels else None
    layer_kernels = layer_ops(cfg, 1, seq, tp, sp, cp, causal_skip=True)
    head_kernels = head_ops(cfg, 1, n, tp, sp) if last else ()
    ops, back = ({op.name: op_seconds(op, hw, rates, way) for op in layer_kernels} for way in ("forward", "backward"))
    layer, layer_back = (sum(v for name, v in t.items() if name != "probs") for t in (ops, back))
    head, head_back = (sum(op_seconds(op, hw, rates, way) for op in head_kernels) for way in ("forward", "backward"))
    weights = weight_counts(cfg, tp)
    accumulate = (layers * accumulation_seconds(layer_kernels, weights, e, hw, rates)
                  + accumulation_seconds(head_kernels, weights, e, hw, rates)) if model.accumulation else 0.0
    block = n * h * e  # one block's input or output, the rank's n tokens
    tp_forward = tp_backward = 0.0
    if tp > 1:
        for column, row in (("qkv", "o_proj"), ("gate_up", "down")):  # a block: column- then row-parallel
            hide = back[column] / 2 if model.overlap else 0.0  # the input- or the weight-gradient GEMM
            if sp:
                gather = group_seconds("all_gather", block, tp, hw, tp, model)
                scatter = group_seconds("reduce_scatter", block, tp, hw, tp, model)
                if model.chunked_tp:
                    sms = rates.sms if rates is not None else None
                    tp_forward += (ring_exchange_exposed(gather, ops[column], tp)
                                   + min(scatter, pipelined_exposed(scatter, ops[row], sms)))
                    tp_backward += ring_exchange_exposed(gather, back[row] / 2, tp)
                else:
                    tp_forward += gather + scatter
                    tp_backward += gather
                tp_backward += max(0.0, gather - hide) + max(0.0, scatter - hide)
            else:
                reduce = group_seconds("all_reduce", block, tp, hw, tp, model)
                tp_forward += reduce
                tp_backward += max(0.0, reduce - hide)
    kv = 2 * seq * cfg.kv_heads // tp * cfg.head_dim * e  # K and V of the whole sequence, this rank's heads
    cp_node = members_per_node(((cp, tp),), hw.node)
    cp_ag, cp_rs = (group_seconds(kind, kv, cp, hw, cp_node, model) for kind in ("all_gather", "reduce_scatter"))
    cheap = rebuild_seconds(ops, set(layer_inventory(cfg, 1, n)) & OP_LEVEL["cheap"])  # norms, SwiGLU again
    rebuild = {"none": 0.0, "cheap": cheap, "full": layer if model.recompute else layer - ops["down"]}[policy]
    reruns = 1 if policy == "full" else 0  # a full recompute runs the forward's collectives again
    send = group_seconds("p2p", block // (tp if sp else 1), 2, hw, send_node, model)
    forward = layers * layer + head
    return {"compute": forward + layers * layer_back + head_back + accumulate, "recompute": layers * rebuild,
            "tp_comm": layers * (tp_forward * (1 + reruns) + tp_backward),
            "cp_comm": layers * (cp_ag * (2 + reruns) + cp_rs), "pp_comm": 2 * send, "forward": forward}


@functools.lru_cache(maxsize=2**16)
def dp_exposed_seconds(params, zero, shards, microbatches, forward, backward, hw, per_node, layers=1, e=2,
                       policy="none", model=FULL_MODEL):
    """Gradient and weight traffic over the `shards` ranks that hold the same weights (per_node of them in a node),
    one collective a layer, less what hides (the module's docstring)."""
    if shards == 1:
        return 0.0
    grads = params * REDUCE_BYTES
    ar, rs, ag = (group_seconds(kind, nbytes, shards, hw, per_node, model, layers if model.topology else 1)
                  for kind, nbytes in (("all_reduce", grads), ("reduce_scatter", grads), ("all_gather", params * e)))
    if zero == "0":
        return max(0.0, ar - backward)
    if zero in ("1", "3+keep") or zero == "2" and not model.sharding:
        return max(0.0, rs - backward) + max(0.0, ag - forward)
    if zero == "2":
        return microbatches * max(0.0, rs - backward) + max(0.0, ag - forward)
    gathers = 3 if policy == "full" and not model.sharding else 2
    return microbatches * (max(0.0, ag - forward) + (gathers - 1) * max(0.0, ag - backward) + max(0.0, rs - backward))

"""Closed forms per context-parallel rank, which the tracker equals to the byte: stored bytes, bytes moved, FLOPs.

Stored bytes: under tiled or fused attention every tensor a layer or the head keeps is linear in its tokens, so a
rank's table is picockpt/planning/step_forms.py's at its n = T/cp tokens, with one more entry under
cp_comm="allgather" with keep_kv: attn.kv_others (2, B, KV, T - n, hd), kept whatever the layer's mode. With X, A, F
a layer input, a layer stored whole and the head at n tokens, and K that entry (0 without keep_kv):

    none / op level      L (A + K) + F
    every:C (full: C=1)  max(n_seg X + L K + F,  max_k (k X + s_k K + n_k (A + K)))   s_k: layers below segment k

Communication per rank and layer (cp_comm.py's count), KV = 2 B KV n hd e the bytes of this rank's K/V block and
G = 2 B KV n hd s those of its gradient (statistics dtype):

                    forward       backward                       recompute (each layer a sweep recomputes)
    ring            (cp-1) KV     (cp-1) KV + cp G               (cp-1) KV      (ring_overlap: the same hops)
    allgather       (cp-1) KV     (cp-1) KV + (cp-1) G           (cp-1) KV
    + keep_kv       (cp-1) KV     (cp-1) G                       0

budget:SIZE plans each rank's chain at n tokens with every recomputed layer also paying its ring again, as the
FLOPs of the same time (recompute_comm_flops). FLOPs: the single process's on n tokens but attention, a sum of
blocks (cp_attention.py): each of its chunks j against its own chunk causally and the j c tokens before it whole.
Zigzag gives every rank (2cp-1) c earlier tokens, the same count; contiguous gives rank r r c, so with d the
diagonal block's count and e = 2 B H hd c^2 the busiest rank against the mean is
    max / mean = (d + (cp-1) e) / (d + (cp-1) e / 2)      (-> 2 as cp grows; 3/2 at cp = 2 when d = e/2)
"""
from ...planning.layer_forms import attention_matmul_flops, chain_sizes, layer_flops, segments_peak, tail_flops
from ...model.config import BYTES
from ...planning.hardware import INFINIBAND_NDR
from ...planning.host_walk import DEFAULT_COMPUTE_RATE
from ...recompute.policy import as_policy
from .cp_comm import RINGS
from .cp_layout import SequenceLayout

# bytes/s between context-parallel ranks: one 400 Gb/s NIC per GPU (cp spans servers once tp fills one; the Llama 3
# paper's RoCE and InfiniBand fabrics are 400 Gb/s per GPU)
CP_BANDWIDTH = INFINIBAND_NDR


def kept_kv_bytes(cfg, batch, seq, cp, cp_comm="ring", keep_kv=False):
    """K: the other ranks' K/V rows one layer keeps (allgather with keep_kv; else 0)."""
    kept = cp_comm == "allgather" and keep_kv
    return 2 * batch * cfg.kv_heads * (seq - seq // cp) * cfg.head_dim * BYTES[cfg.dtype] if kept else 0


def cp_peak_bytes(cfg, batch, seq, policy, cp, cp_comm="ring", keep_kv=False):
    """The exact peak of one rank's activation store over one step."""
    policy = as_policy(policy, cfg)
    if policy.budget is not None:
        raise ValueError(f"policy={policy.text!r}: a budget is planned per rank (parallel/job.py: stage_forms gives "
                         f"its peak); cp_peak_bytes takes none, full, every:C, selective or cheap")
    X, A, F = chain_sizes(cfg, batch, seq // cp, policy.unstored)
    K, L = kept_kv_bytes(cfg, batch, seq, cp, cp_comm, keep_kv), cfg.layers
    return L * (A + K) + F if policy.segment is None else segments_peak([X] * L, [A + K] * L, F, policy.segment,
                                                                         always=[K] * L)


def cp_comm_bytes(cfg, batch, seq, policy, cp, cp_comm="ring", keep_kv=False, schedule=None, t=1):
    """{"forward", "recompute", "backward"}: bytes one rank's ring or all-gather moves in one step (schedule: a
    pipeline stage's own, over its layers; None: the policy's over cfg.layers; t: tensor-parallel ranks, each
    passing the K/V of its KV/t heads)."""
    if cp == 1:  # one rank: its own block is all there is
        return {"forward": 0, "recompute": 0, "backward": 0}
    forward, backward, again = layer_comm_bytes(cfg, batch, seq, cp, cp_comm, keep_kv, t)
    schedule = schedule or as_policy(policy, cfg).schedule(cfg, batch, seq // cp)
    recomputed = sum(last - first + 1 for first, last in schedule.sweeps(cfg.layers))  # the engine's walk
    return {"forward": cfg.layers * forward, "recompute": recomputed * again, "backward": cfg.layers * backward}


def stage_comm_bytes(forms, seq, cp, cp_comm="ring", keep_kv=False):
    """{"forward", "recompute", "backward"}: what one rank of a stage moves in a step: its ring or all-gather on
    the stage's layers for each of its M micro-batches (forms: pipeline_parallel/pp_forms.py's ChunkForms at
    T/cp tokens, its own schedule, the K/V of its KV/t heads), plus its tensor-parallel collectives."""
    cfg = forms.cfg.replace(layers=len(forms.layers))
    ring = cp_comm_bytes(cfg, forms.b, seq, forms.policy, cp, cp_comm, keep_kv, forms.local_schedule, forms.t)
    tp = forms.tp_comm_bytes()
    return {phase: forms.M * nbytes + tp[phase] for phase, nbytes in ring.items()}


def layer_comm_bytes(cfg, batch, seq, cp, cp_comm="ring", keep_kv=False, t=1):
    """(forward, backward, again): one layer's bytes on one rank, and what a recomputation of its forward
    moves again (the kept all-gathered K/V: nothing)."""
    act, stat, _ = (BYTES[name] for name in cfg.dtype_names)
    block = 2 * batch * cfg.kv_heads // t * (seq // cp) * cfg.head_dim  # elements of one rank's K/V block
    KV, G = block * act, block * stat
    if cp_comm in RINGS:  # overlapped or not: the same hops
        forward, backward = (cp - 1) * KV, (cp - 1) * KV + cp * G
    else:  # the other cp - 1 ranks' blocks, and their partial gradients of this rank's block
        forward, backward = (cp - 1) * KV, (0 if keep_kv else (cp - 1) * KV) + (cp - 1) * G
    return forward, backward, 0 if cp_comm == "allgather" and keep_kv else forward


def recompute_comm_flops(cfg, batch, seq, cp, cp_comm="ring", keep_kv=False, t=1, bandwidth=CP_BANDWIDTH,
                         rate=DEFAULT_COMPUTE_RATE):
    """What recomputing one layer's forward costs in communication, as FLOPs of the same time: the bytes it
    moves again over `bandwidth` (bytes/s), at `rate` (FLOP/s). The budget planner adds it to a recomputed
    layer's FLOPs under context parallelism, so a sweep pays for its ring again (pp_forms.stage_plan)."""
    return 0 if cp == 1 else round(layer_comm_bytes(cfg, batch, seq, cp, cp_comm, keep_kv, t)[2] * rate / bandwidth)


def rank_attention_flops(cfg, batch, seq, cp, layout, rank):
    """FLOPs of one of a layer's two attention matmuls (q k^T, or P v) on one rank: its blocks, summed."""
    layout = SequenceLayout(layout, cp, seq)
    c = layout.chunk
    diagonal = attention_matmul_flops(cfg, batch, c)  # its own chunk, causal: the kernel's count on c tokens
    earlier = 2 * batch * cfg.heads * cfg.head_dim * c  # per earlier token, every row of the chunk
    return sum(diagonal + earlier * j * c for j in layout.chunks(rank))


def cp_flops(cfg, batch, seq, policy, cp, layout, rank, head=True, schedule=None, t=1):
    """{"forward", "recompute", "backward"}: one rank's matmul FLOPs (what FlopCounterMode counts); head=False and
    a schedule: a pipeline stage before the last (its layers only, its own schedule); t: tensor-parallel ranks
    (each computes 1/t of every matmul: its heads, its MLP slice, its vocabulary slice)."""
    n = seq // cp
    parts = layer_flops(cfg, batch, n)
    core = rank_attention_flops(cfg, batch, seq, cp, layout, rank) // t
    layer = (parts["qkvo"] + parts["mlp"]) // t + 2 * core  # q k^T and P v
    head = 2 * batch * n * cfg.hidden * cfg.vocab // t if head else 0
    forward = cfg.layers * layer + head
    backward = 2 * forward + (cfg.layers * core if cfg.attention == "fused" else 0)  # fused: the recomputed q k^T
    schedule = schedule or as_policy(policy, cfg).schedule(cfg, batch, n)
    sweeps = schedule.sweeps(cfg.layers)
    recompute = sum(last - first + 1 for first, last in sweeps) * layer
    recompute -= len(sweeps) * tail_flops(cfg, batch, n) // t if schedule.stop_early else 0  # each sweep's last tail
    recompute += cfg.layers * core if cfg.attention == "tiled" else 0  # the tiles' q k^T, rebuilt in the backward
    recompute += head if cfg.loss_chunk else 0  # a chunked head's logits, rebuilt (none without a head)
    return {"forward": forward, "recompute": recompute, "backward": backward}


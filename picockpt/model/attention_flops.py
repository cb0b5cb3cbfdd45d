"""The FLOPs of the attention kernels picockpt calls, counted at the query's heads, forward and backward.

torch.utils.flop_counter has formulas for the SDPA kernels, but before torch 2.12 they assert that key and
value have as many heads as the query (an AssertionError under grouped-query attention, where picockpt's k and v
keep their KV heads), and it has none for the CPU flash kernel. These are picockpt's own: the tracker consults
them before torch's registry, and FlopCounterMode takes them as `custom_mapping=ATTENTION_FLOPS`.

With q (B, H, Tq, d), k (B, KV, Tk, d), v (B, KV, Tk, dv), each of the H query heads reads its group's K/V head
(a kernel broadcasts it, as repeat_interleave would lay it out), so every count is at H heads:

    forward   S = q k^T                      2·B·H·Tq·Tk·d
              O = P v                        2·B·H·Tq·Tk·dv
    backward  S = q k^T again (in the kernel) 2·B·H·Tq·Tk·d
              dV = P^T dO                    2·B·H·Tq·Tk·dv
              dP = dO V^T                    2·B·H·Tq·Tk·dv
              dq = dS k                      2·B·H·Tq·Tk·d
              dk = dS^T q                    2·B·H·Tq·Tk·d

The whole Tq x Tk square counts, causal or not, as torch's own formulas count it (a causal kernel skips the tiles
above the diagonal, so about half of it runs): picockpt/planning/step_forms.py's closed forms count the same square.
"""
import torch
from torch.utils.flop_counter import shape_wrapper

aten = torch.ops.aten


def attention_forward_flops(query, key, value, *args, out_shape=None, **kwargs):
    """FLOPs of S = q k^T and O = P v over the shapes of q (B, H, Tq, d), k (B, KV, Tk, d), v (B, KV, Tk, dv)
    (q, k, v lead every forward op's arguments)."""
    (B, H, Tq, d), Tk, dv = query, key[2], value[3]
    _check(query, key, value)
    return 2 * B * H * Tq * Tk * (d + dv)


def attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs):
    """FLOPs of the kernel's backward: S recomputed, dV, dP, dq and dk (the table above) (grad_out, q, k, v lead a
    backward's arguments)."""
    (B, H, Tq, d), Tk, dv = query, key[2], value[3]
    _check(query, key, value)
    if tuple(grad_out) != (B, H, Tq, dv):
        raise ValueError(f"attention backward: grad_out {tuple(grad_out)} is not the output's shape {(B, H, Tq, dv)}")
    return 2 * B * H * Tq * Tk * (3 * d + 2 * dv)


def _check(query, key, value):
    """Shapes a kernel accepts: K/V heads dividing the query's heads, one key length, one head dimension for q, k."""
    (B, H, _, d), (Bk, KV, Tk, dk), (Bv, KVv, Tv, _) = query, key, value
    if not (B == Bk == Bv and KV == KVv and Tk == Tv and d == dk and KV and H % KV == 0):
        raise ValueError(f"attention FLOPs: q {tuple(query)}, k {tuple(key)}, v {tuple(value)} are not (B, H, Tq, d), "
                         f"(B, KV, Tk, d), (B, KV, Tk, dv) with KV dividing H")


# Every attention op picockpt calls, on the CPU or CUDA, and those sdpa dispatches to (the peers' attention):
# its (B, H, T, hd) tensors first. An op this torch lacks is left out.
_KERNELS = ("_scaled_dot_product_flash_attention_for_cpu",  # the CPU flash kernel (picockpt's fused, on the CPU)
            "_scaled_dot_product_flash_attention",          # FlashAttention-2 (CUDA)
            "_scaled_dot_product_efficient_attention",      # memory-efficient attention (CUDA)
            "_scaled_dot_product_cudnn_attention")          # cuDNN's fused attention (CUDA)
def _on_tensors(formula):
    """formula over shapes -> over an op's tensors, as torch's registry entries are (shape_wrapper); _get_raw tells
    FlopCounterMode's custom_mapping that it is wrapped already."""
    wrapped = shape_wrapper(formula)
    wrapped._get_raw = True
    return wrapped


ATTENTION_FLOPS = {getattr(aten, name + suffix): _on_tensors(formula) for name in _KERNELS
                   for suffix, formula in (("", attention_forward_flops), ("_backward", attention_backward_flops))
                   if hasattr(aten, name + suffix)}

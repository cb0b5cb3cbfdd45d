"""Causal grouped-query attention by torch's own fused kernels, called as a forward/backward pair.

No autograd: the forward calls the kernel's forward op and returns what its backward op needs;
the backward calls that backward op. Like attention_tiled.py (the same algorithm, written out),
the kernels keep the output and one log-sum-exp per row, and recompute the probabilities tile by
tile in the backward, inside the kernel.

    device, dtype                kernel (aten op)
    CPU, any float dtype         _scaled_dot_product_flash_attention_for_cpu (+ _backward): grouped-query
                                 attention natively (k, v keep their KV heads)
    CUDA, bf16 / fp16            _scaled_dot_product_flash_attention (+ _backward): FlashAttention-2;
                                 k and v are expanded to H heads for the call (working memory only, as
                                 Hugging Face's repeat_kv does), their gradients summed back per group
    CUDA, fp32 / fp64            refused: the flash kernel is 16-bit only (use bf16, or tiled/eager)

What is stored: out (as the layer's attn.context: a view, no extra bytes) and lse (B, H, T) fp32
(fp64 in fp64 runs). Dropout is refused (Config): the CPU kernel has none, and the CUDA kernel's
random state would be a third tensor to keep and replay. With dropout 0 the CUDA backward does
not read its seed and offset, so empty placeholders are passed.

FLOPs: FlopCounterMode knows the CUDA kernels (2 T x T matmuls forward, 5 backward: one is the
recomputed q k^T, inside the kernel, so it counts as backward). It does not know the CPU kernel,
whose formula, the same, is registered below.
"""
import torch
from torch.utils import flop_counter

aten = torch.ops.aten


def _register_cpu_flops():
    """The CPU flash kernel computes what the CUDA ones do: give FlopCounterMode the same formulas."""
    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)  # q k^T and P v

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    for op, formula in ((aten._scaled_dot_product_flash_attention_for_cpu, forward),
                        (aten._scaled_dot_product_flash_attention_for_cpu_backward, backward)):
        if op not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op)(formula)


_register_cpu_flops()


def check_fused(device, dtype):
    """A clear error where no fused kernel exists for the device and dtype."""
    if torch.device(device).type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attention='fused' on CUDA runs the flash kernel, which takes bf16 or fp16, not "
                         f"{str(dtype).replace('torch.', '')}: use --dtype bf16, or attention='tiled' or 'eager'")


def fused_attention_forward(q, k, v, causal=True):
    """q (B, H, T, hd), k/v (B, KV, T, hd) -> out (B, H, T, hd), lse (B, H, T). causal=False: no mask,
    every row sees all Tk keys of k/v (B, KV, Tk, hd), keys that all come before the queries (context
    parallelism's blocks of earlier tokens, picockpt/parallel/context_parallel/cp_attention.py)."""
    check_fused(q.device, q.dtype)
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)  # out, lse
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, H, T, hd) each, transient
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)  # (B, H, T, hd), (B, H, T)
    return out, lse


def fused_attention_backward(dout, q, k, v, out, lse, causal=True):
    """The kernel's own backward: recomputes P = exp(q k^T / sqrt(hd) - lse) tile by tile, then
    dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)), dq = dS k / sqrt(hd), dk = dS^T q / sqrt(hd)."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    B, H, T, hd = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    G = H // KV
    k_all, v_all = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, H, Tk, hd) each
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)  # unread: dropout is 0
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout, q, k_all, v_all, out, lse, None, None, T, Tk, 0.0, causal, seed, offset)  # dq (B, H, T, hd), dk, dv Tk
    dk = dk.view(B, KV, G, Tk, hd).sum(2)  # (B, KV, Tk, hd) the G query heads of a group share k
    dv = dv.view(B, KV, G, Tk, hd).sum(2)  # (B, KV, Tk, hd)
    return dq, dk, dv

"""Causal grouped-query attention by torch's own fused kernels, called as a forward/backward pair.

No autograd: the forward calls the kernel's forward op and returns what its backward op needs;
the backward calls that backward op. Like attention_tiled.py (the same algorithm, written out),
the kernels keep the output and one log-sum-exp per row, and recompute the probabilities tile by
tile in the backward, inside the kernel.

    device, dtype                kernel (aten op)
    CPU, any float dtype         _scaled_dot_product_flash_attention_for_cpu (+ _backward): grouped-query
                                 attention natively (k, v keep their KV heads)
    CUDA, bf16 / fp16            _scaled_dot_product_flash_attention (+ _backward): FlashAttention-2,
                                 grouped-query attention natively too (its mha_fwd / mha_bwd take KV heads
                                 dividing H, as SDPA's enable_gqa relies on): k and v keep their KV heads,
                                 and the backward returns dk, dv summed over each group's query heads
    CUDA, fp32 / fp64            refused: the flash kernel is 16-bit only (use bf16, or tiled/eager)
    CUDA, head_dim % 8 or > 256  refused: the flash kernel takes head dimensions that are multiples of 8,
                                 at most 256 (the CPU kernel takes any)

What is stored: out (as the layer's attn.context: a view, no extra bytes) and lse (B, H, T) fp32
(fp64 in fp64 runs). Dropout is refused (Config): the CPU kernel has none, and the CUDA kernel's
random state would be a third tensor to keep and replay. With dropout 0 the CUDA backward does
not read its seed and offset, so empty placeholders are passed.

FLOPs: picockpt/attention_flops.py counts every one of these kernels (2 T x T matmuls forward, 5 backward: one
is the recomputed q k^T, inside the kernel, so it counts as backward), at the query's heads.
"""
import torch

aten = torch.ops.aten


FLASH_HEAD_STEP, FLASH_HEAD_MAX = 8, 256  # the CUDA flash kernel's head dimensions: multiples of 8, up to 256


def check_fused(device, dtype, head_dim=None):
    """A clear error where no fused kernel exists for the device, dtype and head dimension (None: not checked)."""
    if torch.device(device).type != "cuda":
        return  # the CPU flash kernel takes every float dtype and head dimension
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attention='fused' on CUDA runs the flash kernel, which takes bf16 or fp16, not "
                         f"{str(dtype).replace('torch.', '')}: use --dtype bf16, or attention='tiled' or 'eager'")
    if head_dim is not None and (head_dim % FLASH_HEAD_STEP or head_dim > FLASH_HEAD_MAX):
        below = min(FLASH_HEAD_MAX, max(FLASH_HEAD_STEP, head_dim // FLASH_HEAD_STEP * FLASH_HEAD_STEP))
        near = sorted({below, min(FLASH_HEAD_MAX, below + FLASH_HEAD_STEP)})
        raise ValueError(f"attention='fused' on CUDA runs the flash kernel, which takes a head dimension that is a "
                         f"multiple of {FLASH_HEAD_STEP}, at most {FLASH_HEAD_MAX}, not head_dim={head_dim} "
                         f"(hidden/heads): choose hidden and heads for head_dim "
                         f"{' or '.join(map(str, near))}, or use attention='tiled' or 'eager'")


def fused_attention_forward(q, k, v, causal=True):
    """q (B, H, T, hd), k/v (B, KV, T, hd) -> out (B, H, T, hd), lse (B, H, T). causal=False: no mask,
    every row sees all Tk keys of k/v (B, KV, Tk, hd), keys that all come before the queries (context
    parallelism's blocks of earlier tokens, picockpt/parallel/context_parallel/cp_attention.py)."""
    check_fused(q.device, q.dtype, q.shape[-1])
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)  # out, lse
    # k, v with their KV heads: query head i reads KV head i // G, as repeat_interleave would lay them out
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)  # (B, H, T, hd), (B, H, T)
    return out, lse


def fused_attention_backward(dout, q, k, v, out, lse, causal=True):
    """The kernel's own backward: recomputes P = exp(q k^T / sqrt(hd) - lse) tile by tile, then
    dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)), dq = dS k / sqrt(hd), dk = dS^T q / sqrt(hd)."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    T, Tk = q.shape[2], k.shape[2]
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)  # unread: dropout is 0
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    return aten._scaled_dot_product_flash_attention_backward(  # dq (B, H, T, hd); dk, dv (B, KV, Tk, hd): the
        dout, q, k, v, out, lse, None, None, T, Tk, 0.0, causal, seed, offset)  # kernel sums each group's heads

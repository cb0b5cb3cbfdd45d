"""Causal grouped-query attention by torch's own fused kernels, called as a forward/backward pair.

No autograd: the forward calls the kernel's forward op and returns what its backward op needs; the backward calls that
backward op. Like attention_tiled.py (the same algorithm, written out), the kernels keep the output and one log-sum-exp
per row, and recompute the probabilities tile by tile in the backward, inside the kernel.

The kernel is the one torch's scaled_dot_product_attention would run for the same q, k, v
(fused_kernel below asks torch, and says which by name):

    device, dtype                kernel (aten op)
    CPU, any float dtype         'flash_cpu': _scaled_dot_product_flash_attention_for_cpu (+ _backward):
                                 grouped-query attention natively (k, v keep their KV heads)
    CUDA, bf16 / fp16, where     'cudnn': _scaled_dot_product_cudnn_attention (+ _backward): cuDNN's fused
    sdpa picks cuDNN             attention, which sdpa puts first on Hopper and Blackwell (sm90, sm100) with a
                                 recent cuDNN, for the shapes it takes (head_dim a multiple of 8, at most 128,
                                 or 256 with newer cuDNN), unless deterministic algorithms are on (its backward
                                 is not); grouped-query attention natively, dk, dv summed per group
    CUDA, bf16 / fp16, else      'flash': _scaled_dot_product_flash_attention (+ _backward): FlashAttention-2,
                                 grouped-query attention natively too (its mha_fwd / mha_bwd take KV heads
                                 dividing H, as SDPA's enable_gqa relies on): k and v keep their KV heads,
                                 and the backward returns dk, dv summed over each group's query heads
    CUDA, fp32 / fp64            refused: the fused kernels are 16-bit only (use bf16, or tiled/eager)
    CUDA, head_dim % 8 or > 256  refused: the flash kernel takes head dimensions that are multiples of 8,
                                 at most 256 (the CPU kernel takes any)

What is stored, whichever the kernel: out (as the layer's attn.context: a view, no extra bytes) and
lse (B, H, T) fp32 (fp64 in fp64 runs; cuDNN returns it as (B, H, T, 1), kept as a (B, H, T) view of
the same bytes). Both CUDA kernels also return a dropout seed and offset (and cuDNN's cum_seq_q/k and
max_q/k, for nested tensors): dropout is refused (Config), since the CPU kernel has none and the CUDA
kernels' random state would be a third tensor to keep and replay; with dropout 0 their backwards do not
read the seed and offset, so empty placeholders are passed, and max_q, max_k are T and Tk.

FLOPs: picockpt/model/attention_flops.py counts every one of these kernels (2 T x T matmuls forward, 5 backward: one
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


SDPA_BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}  # torch's SDPBackend values
CUDNN_OP = getattr(aten, "_scaled_dot_product_cudnn_attention", None)
HAS_CUDNN_OP = CUDNN_OP is not None and "compute_log_sumexp" in str(CUDNN_OP.default._schema)  # its torch >= 2.5 form


def sdpa_choice(q, k, v, causal=True):
    """The backend torch's scaled_dot_product_attention would pick for q, k, v (k, v at their KV heads) on
    CUDA: 'cudnn', 'flash', 'efficient' or 'math', asked of torch's own chooser (its priority order, its
    checks of device, dtype, shapes and flags); None where torch cannot say (not CUDA)."""
    if q.device.type != "cuda":
        return None
    choose = getattr(torch, "_fused_sdp_choice", None)  # what sdpa itself calls
    if choose is not None:
        try:
            return SDPA_BACKENDS.get(choose(q, k, v, None, 0.0, causal, enable_gqa=True))
        except TypeError:  # torch < 2.5: no enable_gqa (and no grouped-query attention in its kernels)
            return SDPA_BACKENDS.get(choose(q, k, v, None, 0.0, causal))
    cuda = torch.backends.cuda  # else its public checks, and sdpa's preference: cuDNN first on sm90 / sm100
    params = cuda.SDPAParams(q, k, v, None, 0.0, causal, True)
    prefers_cudnn = torch.cuda.get_device_capability(q.device)[0] in (9, 10)
    return "cudnn" if prefers_cudnn and cuda.can_use_cudnn_attention(params) else "flash"


def fused_kernel(q, k, v, causal=True):
    """The kernel fused attention runs for q (B, H, T, hd), k/v (B, KV, Tk, hd): 'flash_cpu' on the CPU; on CUDA
    'cudnn' where sdpa would run cuDNN's fused attention (and this torch has its op), else 'flash'."""
    if q.device.type == "cpu":
        return "flash_cpu"
    return "cudnn" if HAS_CUDNN_OP and sdpa_choice(q, k, v, causal) == "cudnn" else "flash"


def fused_kernel_for(cfg, seq, device):
    """fused_kernel for a Config at sequence length seq on device, to print before a run (small empty q, k, v)."""
    q = torch.empty(1, cfg.heads, seq, cfg.head_dim, device=device, dtype=cfg.torch_dtype)  # (1, H, T, hd)
    k = torch.empty(1, cfg.kv_heads, seq, cfg.head_dim, device=device, dtype=cfg.torch_dtype)  # (1, KV, T, hd)
    return fused_kernel(q, k, k)


def fused_attention_forward(q, k, v, causal=True):
    """q (B, H, T, hd), k/v (B, KV, T, hd) -> out (B, H, T, hd), lse (B, H, T). causal=False: no mask,
    every row sees all Tk keys of k/v (B, KV, Tk, hd), keys that all come before the queries (context
    parallelism's blocks of earlier tokens, picockpt/parallel/context_parallel/cp_attention.py)."""
    check_fused(q.device, q.dtype, q.shape[-1])
    kernel = fused_kernel(q, k, v, causal)  # 'flash_cpu', 'cudnn' or 'flash': the kernel sdpa would run
    if kernel == "flash_cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)  # out, lse
    # k, v with their KV heads: query head i reads KV head i // G, as repeat_interleave would lay them out
    if kernel == "cudnn":
        out, lse, *_ = aten._scaled_dot_product_cudnn_attention(  # (B, H, T, hd), (B, H, T, 1)
            q, k, v, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=causal)
        return out, lse.squeeze(-1)  # (B, H, T, hd), (B, H, T) a view
    return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]  # out (B, H, T, hd), lse (B, H, T)


def fused_attention_backward(dout, q, k, v, out, lse, causal=True):
    """The kernel's own backward: recomputes P = exp(q k^T / sqrt(hd) - lse) tile by tile, then
    dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)), dq = dS k / sqrt(hd), dk = dS^T q / sqrt(hd)."""
    kernel = fused_kernel(q, k, v, causal)  # the forward's: the same inputs, the same choice
    if kernel == "flash_cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    T, Tk = q.shape[2], k.shape[2]
    if kernel == "cudnn":
        seed, offset = (torch.empty((), dtype=torch.int64, device=q.device) for _ in range(2))  # unread: dropout 0
        if dout.stride() != out.stride():  # cuDNN reads dO in O's memory layout (it would copy it, and warn)
            dout = torch.empty_like(out).copy_(dout)  # (B, H, T, hd) laid out as out
        return aten._scaled_dot_product_cudnn_attention_backward(  # dq (B, H, T, hd); dk, dv (B, KV, Tk, hd)
            dout, q, k, v, out, lse.unsqueeze(-1), seed, offset, attn_bias=None, cum_seq_q=None, cum_seq_k=None,
            max_q=T, max_k=Tk, dropout_p=0.0, is_causal=causal)
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)  # unread: dropout is 0
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    return aten._scaled_dot_product_flash_attention_backward(  # dq (B, H, T, hd); dk, dv (B, KV, Tk, hd): the
        dout, q, k, v, out, lse, None, None, T, Tk, 0.0, causal, seed, offset)  # kernel sums each group's heads

"""What fused attention and context parallelism check for CUDA, tested on the CPU: the flash kernel's dtype and
head dimension refused by name (the check needs a CUDA device object, not a GPU), the kernel called with k and v
at their KV heads (its CUDA branch traced on meta tensors, whose shapes follow the kernels' own), a lesson's
dtype for its device, and the overlapped ring's checks, flag, closed forms and timing verdict (one process)."""
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from picockpt import Config
from picockpt.ops.attention_fused import check_fused, fused_attention_backward, fused_attention_forward
from picockpt.parallel.context_parallel.cp_check import check_context_parallel
from picockpt.parallel.context_parallel.cp_forms import cp_comm_bytes, layer_comm_bytes
from picockpt.teaching.reproduce import load

CUDA = torch.device("cuda")  # a device object: nothing is allocated on it
LESSONS = Path(__file__).resolve().parents[1] / "lessons"


@pytest.mark.parametrize("head_dim, near", [(12, "head_dim 8 or 16"), (4, "head_dim 8 or 16"), (260, "head_dim 256"),
                                            (264, "head_dim 256")])
def test_fused_on_cuda_refuses_a_head_dim_the_flash_kernel_cannot_take(head_dim, near):
    with pytest.raises(ValueError, match=rf"multiple of 8, at most 256, not head_dim={head_dim} \(hidden/heads\): "
                                         rf"choose hidden and heads for {near}, or use attention='tiled' or 'eager'"):
        check_fused(CUDA, torch.bfloat16, head_dim)


def test_fused_on_cuda_takes_16_bit_head_dims_of_multiples_of_8_and_the_cpu_takes_any():
    for head_dim in (8, 16, 64, 128, 256):
        assert check_fused(CUDA, torch.float16, head_dim) is None
    assert check_fused(torch.device("cpu"), torch.float32, 12) is None
    assert check_fused("cpu", torch.float64, 300) is None
    with pytest.raises(ValueError, match="flash kernel, which takes bf16 or fp16, not float32"):
        check_fused(CUDA, torch.float32, 12)  # the dtype first: the flag to change before the head_dim
    q = torch.randn(1, 4, 9, 12, dtype=torch.float64)  # (B, H, T, hd) hd = 12: fine on the CPU kernel
    k = torch.randn(1, 2, 9, 12, dtype=torch.float64)  # (B, KV, T, hd)
    out, lse = fused_attention_forward(q, k, k)
    assert out.shape == (1, 4, 9, 12) and lse.shape == (1, 4, 9)


class Ops(TorchDispatchMode):
    """Every aten op run inside, with the shapes of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func.overloadpacket.__name__), [tuple(a.shape) for a in args
                                                               if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def test_the_flash_kernel_gets_k_and_v_at_their_kv_heads():
    """The CUDA branch on meta tensors (shapes only): the flash ops receive k, v (B, KV, T, hd), not expanded to
    H heads, and the backward's dk, dv come back at KV heads; no op copies them to H heads."""
    B, H, KV, T, hd = 2, 8, 2, 16, 8
    q, dout = (torch.empty(B, H, T, hd, device="meta", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.empty(B, KV, T, hd, device="meta", dtype=torch.bfloat16) for _ in range(2))
    with Ops() as ops:
        out, lse = fused_attention_forward(q, k, v)
        dq, dk, dv = fused_attention_backward(dout, q, k, v, out, lse)
    names = [name for name, _ in ops.calls]
    assert names == ["_scaled_dot_product_flash_attention", "empty", "empty",
                     "_scaled_dot_product_flash_attention_backward"], names
    assert ops.calls[0][1] == [(B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd)]
    assert ops.calls[3][1][2:4] == [(B, KV, T, hd), (B, KV, T, hd)]
    assert (dq.shape, dk.shape, dv.shape) == ((B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd))


def lesson_helpers():
    return load(LESSONS / "_lesson.py")


def test_a_lesson_computes_fused_in_bf16_on_cuda_and_says_so(capsys):
    dtype_for_device = lesson_helpers().dtype_for_device
    cfg = Config.from_preset("small", attention="fused")
    assert dtype_for_device(cfg, torch.device("cpu")) is cfg  # the CPU run: as it is, nothing said
    assert dtype_for_device(cfg.replace(attention="tiled"), CUDA) == cfg.replace(attention="tiled")
    capsys.readouterr()
    chosen = dtype_for_device(cfg.replace(attention="eager"), CUDA, ("eager", "tiled", "fused"))
    assert chosen == cfg.replace(attention="eager", dtype="bfloat16")
    assert capsys.readouterr().out == ("fused attention on cuda runs the flash kernel, which takes bf16 or fp16: "
                                       "this run computes in bfloat16 where the CPU run takes float32\n")
    assert dtype_for_device(cfg.replace(dtype="float16"), CUDA).dtype == "float16"  # already 16-bit: kept
    with pytest.raises(ValueError, match=r"not head_dim=12 \(hidden/heads\)"):
        dtype_for_device(cfg.replace(hidden=48), CUDA)  # bf16 does not cure a head dimension


def test_ring_overlap_is_a_cp_comm_with_the_ring_s_closed_forms():
    cfg = Config.from_preset("tiny", attention="tiled", dtype="float64")
    check_context_parallel(cfg, 2, 16, cp_comm="ring_overlap")
    with pytest.raises(ValueError, match="cp_comm='ringoverlap': use 'ring' .*, 'ring_overlap' \\(the same ring, "
                                         "each step sent while a block is computed\\) or 'allgather'"):
        check_context_parallel(cfg, 2, 16, cp_comm="ringoverlap")
    for cp in (2, 4):
        assert layer_comm_bytes(cfg, 2, 64, cp, "ring_overlap") == layer_comm_bytes(cfg, 2, 64, cp, "ring")
        assert cp_comm_bytes(cfg, 2, 64, "full", cp, "ring_overlap") == cp_comm_bytes(cfg, 2, 64, "full", cp, "ring")
    block = 2 * 2 * cfg.kv_heads * 32 * cfg.head_dim * 8  # one rank's K/V block at cp = 2, fp64 bytes
    assert layer_comm_bytes(cfg, 2, 64, 2, "ring_overlap") == (block, block + 2 * block, block)


def test_the_parallel_command_takes_cp_comm_ring_overlap(capsys):
    from picockpt.cli import Parser
    from picockpt.cli.parallel import add_arguments
    parser = Parser(prog="python -m picockpt parallel")
    add_arguments(parser)
    assert parser.parse_args(["--cp", "2", "--cp-comm", "ring_overlap"]).cp_comm == "ring_overlap"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cp", "2", "--cp-comm", "overlap"])
    assert "--cp-comm: invalid choice: 'overlap' (choose from 'ring', 'ring_overlap', 'allgather')" in \
        capsys.readouterr().err


def test_lesson_18_calls_a_timing_inconclusive_when_its_spread_straddles_1():
    lesson = load(LESSONS / "18_context_parallelism.py")
    spread = lesson_helpers().Spread
    straddles = lesson.overlap_claim(spread((0.9, 1.0, 1.2)), "cpu")
    assert not straddles.conclusive and straddles.text == (
        "ring_overlap / ring step time: inconclusive on this machine (1.000 [0.900..1.200] over 3 interleaved "
        "repeats: the repeats straddle 1); by work (exact) it is 1.000")
    faster = lesson.overlap_claim(spread((0.7, 0.8, 0.9)), "cpu")
    assert faster.conclusive and faster.text == (
        "ring_overlap / ring step time: 0.800 [0.700..0.900] over 3 interleaved repeats (every repeat below 1); "
        "by work (exact) it is 1.000")
    slower = lesson.overlap_claim(spread((1.1, 1.2)), "cpu")
    assert not slower.conclusive and "inconclusive on this machine" in slower.text
    assert lesson.overlap_claim(spread((0.5,)), "fast").text.endswith("timing not meaningful at --fast shapes")


@pytest.mark.parametrize("dout_like_out", [False, True])
def test_where_sdpa_would_pick_cudnn_the_cudnn_kernel_runs_with_k_and_v_at_their_kv_heads(monkeypatch, dout_like_out):
    """The cuDNN branch on meta tensors, sdpa's choice patched to cuDNN (what it picks on an H100/H200): the cuDNN
    ops receive k, v at KV heads; the lse comes back (B, H, T) (a view of cuDNN's (B, H, T, 1)) and goes back to
    the backward as (B, H, T, 1); dO is handed over in O's layout (copied only when it is not)."""
    from picockpt.ops import attention_fused
    monkeypatch.setattr(attention_fused, "sdpa_choice", lambda q, k, v, causal=True: "cudnn")
    B, H, KV, T, hd = 2, 8, 2, 16, 64
    q = torch.empty(B, H, T, hd, device="meta", dtype=torch.bfloat16)
    k, v = (torch.empty(B, KV, T, hd, device="meta", dtype=torch.bfloat16) for _ in range(2))
    assert attention_fused.fused_kernel(q, k, v) == "cudnn"
    with Ops() as ops:
        out, lse = fused_attention_forward(q, k, v)
    assert [name for name, _ in ops.calls] == ["_scaled_dot_product_cudnn_attention", "squeeze"]
    assert ops.calls[0][1] == [(B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd)]
    assert (out.shape, lse.shape, lse.dtype) == ((B, H, T, hd), (B, H, T), torch.float32)
    dout = torch.empty_like(out) if dout_like_out else torch.empty(B, T, H, hd, device="meta",
                                                                   dtype=torch.bfloat16).transpose(1, 2)
    with Ops() as ops:
        dq, dk, dv = fused_attention_backward(dout, q, k, v, out, lse)
    names = [name for name, _ in ops.calls]
    copy = [] if dout.stride() == out.stride() else ["empty_like", "copy_"]
    assert names == ["empty", "empty", *copy, "unsqueeze", "_scaled_dot_product_cudnn_attention_backward"], names
    assert ops.calls[-1][1][:6] == [(B, H, T, hd), (B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd), (B, H, T, hd),
                                    (B, H, T, 1)]
    assert (dq.shape, dk.shape, dv.shape) == ((B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd))


def test_the_fused_kernel_is_named_the_cpu_keeps_its_flash_kernel_and_cuda_follows_sdpa(monkeypatch):
    from picockpt.ops import attention_fused
    cfg = Config.from_preset("tiny", attention="fused")
    assert attention_fused.fused_kernel_for(cfg, 16, "cpu") == "flash_cpu"
    q, k = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8)
    assert attention_fused.sdpa_choice(q, k, k) is None  # not CUDA: torch's chooser is not asked
    with Ops() as ops:
        fused_attention_forward(q, k, k)
    assert [name for name, _ in ops.calls] == ["_scaled_dot_product_flash_attention_for_cpu"]
    meta = torch.empty(1, 4, 16, 8, device="meta", dtype=torch.bfloat16)
    assert attention_fused.fused_kernel(meta, meta, meta) == "flash"  # no CUDA device to ask: FlashAttention-2
    for choice, kernel in (("cudnn", "cudnn"), ("flash", "flash"), ("efficient", "flash"), ("math", "flash")):
        monkeypatch.setattr(attention_fused, "sdpa_choice", lambda q, k, v, causal=True, c=choice: c)
        assert attention_fused.fused_kernel(meta, meta, meta) == kernel
    monkeypatch.setattr(attention_fused, "sdpa_choice", lambda q, k, v, causal=True: "cudnn")
    monkeypatch.setattr(attention_fused, "HAS_CUDNN_OP", False)  # a torch without the cuDNN op's current form
    assert attention_fused.fused_kernel(meta, meta, meta) == "flash"


def test_sdpa_s_choice_is_asked_of_torch_s_own_chooser_or_else_of_its_public_checks(monkeypatch):
    """torch._fused_sdp_choice (what sdpa calls) answers by SDPBackend number; before enable_gqa it takes none;
    without it, torch.backends.cuda's can_use_cudnn_attention and sdpa's preference for cuDNN on sm90 / sm100."""
    from types import SimpleNamespace

    from picockpt.ops import attention_fused
    on_cuda = SimpleNamespace(device=CUDA)  # stands for a CUDA tensor: only its device is read before the chooser
    asked = []
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *args, **kwargs: asked.append(kwargs) or 3, raising=False)
    assert attention_fused.sdpa_choice(on_cuda, on_cuda, on_cuda) == "cudnn" and asked == [{"enable_gqa": True}]

    def older(q, k, v, mask, dropout, causal, **kwargs):
        if kwargs:
            raise TypeError("_fused_sdp_choice() got an unexpected keyword argument 'enable_gqa'")
        return 1
    monkeypatch.setattr(torch, "_fused_sdp_choice", older)
    assert attention_fused.sdpa_choice(on_cuda, on_cuda, on_cuda) == "flash"
    monkeypatch.delattr(torch, "_fused_sdp_choice")
    monkeypatch.setattr(torch.backends.cuda, "SDPAParams", lambda *args: args)
    monkeypatch.setattr(torch.backends.cuda, "can_use_cudnn_attention", lambda params: params[5] is True)
    for major, want in ((9, "cudnn"), (10, "cudnn"), (8, "flash")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, m=major: (m, 0))
        assert attention_fused.sdpa_choice(on_cuda, on_cuda, on_cuda) == want

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
from picockpt.parallel.context_parallel.cp_inventory import cp_comm_bytes, layer_comm_bytes
from picockpt.reproduce import load

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

"""Each op's hand-written backward against autograd through its own forward, in float64."""
import pytest
import torch
from torch.testing import assert_close

from picockpt import Config
from picockpt import ops

D = torch.float64


def autograd_grads(forward, inputs, dout):
    """Gradients of sum(forward(*inputs) * dout) w.r.t. every floating input, by autograd."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = forward(*leaves)
    torch.autograd.backward(out, dout)
    return [x.grad for x in leaves if x.is_floating_point()]


def rand(*shape):
    return torch.randn(*shape, dtype=D)


def test_linear():
    x, w = rand(2, 5, 7), rand(3, 7)
    dy = rand(2, 5, 3)
    dx, dw = ops.linear_backward(dy, x, w)
    ex, ew = autograd_grads(ops.linear_forward, [x, w], dy)
    assert_close(dx, ex, rtol=1e-12, atol=1e-12)
    assert_close(dw, ew, rtol=1e-12, atol=1e-12)


def test_embedding():
    w, ids = rand(11, 6), torch.randint(0, 11, (3, 9))
    dy = rand(3, 9, 6)
    (ew,) = autograd_grads(lambda w: ops.embedding_forward(ids, w), [w], dy)
    assert_close(ops.embedding_backward(dy, ids, w.shape), ew, rtol=1e-12, atol=1e-12)


def test_rmsnorm():
    x, w = rand(2, 5, 8), rand(8)
    dy = rand(2, 5, 8)
    y, rstd = ops.rmsnorm_forward(x, w, 1e-5, D)
    assert_close(y, w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    dx, dw = ops.rmsnorm_backward(dy, x, rstd, w)
    ex, ew = autograd_grads(lambda x, w: ops.rmsnorm_forward(x, w, 1e-5, D)[0], [x, w], dy)
    assert_close(dx, ex, rtol=1e-10, atol=1e-12)
    assert_close(dw, ew, rtol=1e-10, atol=1e-12)


def test_rope():
    cfg = Config.from_preset("tiny", dtype="float64")
    cos, sin = ops.rope_tables(cfg, 9, "cpu", D)
    x, dy = rand(2, 9, 3, cfg.head_dim), rand(2, 9, 3, cfg.head_dim)
    (ex,) = autograd_grads(lambda x: ops.rope_forward(x, cos, sin), [x], dy)
    assert_close(ops.rope_backward(dy, cos, sin), ex, rtol=1e-12, atol=1e-12)
    # a rotation keeps the length of every pair
    y = ops.rope_forward(x, cos, sin)
    assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_swiglu():
    g, u, da = rand(2, 5, 7), rand(2, 5, 7), rand(2, 5, 7)
    dg, du = ops.swiglu_backward(da, g, u)
    eg, eu = autograd_grads(ops.swiglu_forward, [g, u], da)
    assert_close(dg, eg, rtol=1e-12, atol=1e-12)
    assert_close(du, eu, rtol=1e-12, atol=1e-12)


def test_dropout():
    x, dy = rand(4, 6), rand(4, 6)
    mask = ops.dropout_mask((4, 6), 0.3, "cpu")
    (ex,) = autograd_grads(lambda x: ops.dropout_forward(x, mask, 0.3), [x], dy)
    assert_close(ops.dropout_backward(dy, mask, 0.3), ex, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_attention(heads, kv_heads, p):
    B, T, hd = 2, 7, 6
    q, k, v = rand(B, heads, T, hd), rand(B, kv_heads, T, hd), rand(B, kv_heads, T, hd)
    mask = ops.dropout_mask((B, heads, T, T), p, "cpu") if p > 0 else None
    dout = rand(B, heads, T, hd)
    out, probs, dropped = ops.attention_forward(q, k, v, D, mask, p)
    # against a plain implementation that repeats k and v per query head
    G = heads // kv_heads
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ kk.transpose(-1, -2)) / hd ** 0.5 + torch.full((T, T), float("-inf"), dtype=D).triu(1)
    expect = torch.softmax(s, -1) * (mask.to(D) / (1 - p) if mask is not None else 1) @ vv
    assert_close(out, expect, rtol=1e-12, atol=1e-12)
    dq, dk, dv = ops.attention_backward(dout, q, k, v, probs, dropped, D, mask, p)
    eq, ek, ev = autograd_grads(lambda q, k, v: ops.attention_forward(q, k, v, D, mask, p)[0], [q, k, v], dout)
    for got, want in ((dq, eq), (dk, ek), (dv, ev)):
        assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_cross_entropy_with_ignored_targets():
    z, t = rand(10, 11), torch.randint(0, 11, (10,))
    t[[2, 7]] = -100  # ignored, as in torch and transformers: out of the sum and of the count
    count = 8

    def mean_loss(z):
        return ops.cross_entropy_forward(z, t, D)[0] / count

    assert_close(mean_loss(z), torch.nn.functional.cross_entropy(z, t), rtol=1e-12, atol=1e-14)
    (ez,) = autograd_grads(mean_loss, [z], torch.tensor(1.0, dtype=D))
    assert_close(ops.cross_entropy_backward(1.0 / count, z, t, D), ez, rtol=1e-12, atol=1e-14)
    logz = ops.cross_entropy_forward(z, t, D)[1]  # what a chunked head keeps instead of the logits
    assert_close(ops.cross_entropy_backward(1.0 / count, z, t, D, logz), ez, rtol=1e-12, atol=1e-14)
    assert ez[[2, 7]].abs().max() == 0


def test_rmsnorm_weight_gradient_stays_in_the_statistics_dtype():
    """A sum over B*T tokens: rounded to bf16 on its way to the fp32 master gradient it would lose ~8 bits."""
    from picockpt.ops import rmsnorm_backward, rmsnorm_forward
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 32, generator=g).bfloat16()
    w = torch.rand(32, generator=g).bfloat16() + 0.5
    dy = torch.randn(4, 64, 32, generator=g).bfloat16()
    _, rstd = rmsnorm_forward(x, w, 1e-6, torch.float32)
    dx, dw = rmsnorm_backward(dy, x, rstd, w)
    assert (dx.dtype, dw.dtype) == (torch.bfloat16, torch.float32)
    exact = (dy.double() * x.double() * rstd.double()).sum(dim=(0, 1))
    assert (dw.double() - exact).abs().max() < (dw.bfloat16().double() - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_elementwise_backwards_are_bitwise_their_written_out_formulas(dtype):
    """SwiGLU's backward is autograd's own kernels (silu, silu_backward); RMSNorm's widens 16-bit inputs inside
    each kernel instead of through fp32 copies; RoPE's adds and subtracts halves in place instead of building
    rotate_half: each gives the bits of the formula in its docstring, computed the plain way, in every dtype."""
    g = torch.Generator().manual_seed(0)
    gate, up, dact = (3 * torch.randn(2, 17, 40, generator=g).to(dtype) for _ in range(3))
    want = autograd_grads(ops.swiglu_forward, [gate, up], dact)
    assert all(torch.equal(got, w) for got, w in zip(ops.swiglu_backward(dact, gate, up), want))

    stat = torch.float64 if dtype == torch.float64 else torch.float32
    x, dy = (torch.randn(2, 17, 24, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(24, generator=g).to(dtype) + 0.5
    _, rstd = ops.rmsnorm_forward(x, w, 1e-6, stat)
    xs, dys = x.to(stat), dy.to(stat)  # (B, T, h) the fp32 copies the formula reads
    dn = dys * w.to(stat)
    want_dx = (rstd * (dn - xs * rstd.pow(2) * (dn * xs).mean(-1, keepdim=True))).to(dtype)
    dx, dw = ops.rmsnorm_backward(dy, x, rstd, w)
    assert torch.equal(dx, want_dx) and torch.equal(dw, (dys * (xs * rstd)).sum(dim=(0, 1)))

    cfg = Config.from_preset("tiny")
    cos, sin = ops.rope_tables(cfg, 17, "cpu", dtype)
    dq = torch.randn(2, 3, 17, cfg.head_dim, generator=g).to(dtype).transpose(1, 2)  # (B, T, H, hd) as the layer
    c, s = cos[:, None, :], sin[:, None, :]
    got = ops.rope_backward(dq, cos, sin)
    assert torch.equal(got, dq * c - ops.rope.rotate_half(dq * s)) and got.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_attention_probs_are_bitwise_the_unfused_chain(dtype):
    """baddbmm folds the causal mask into the matmul (0 / -inf added before rounding): the scores are bitwise
    the matmul's, scaled after, as Hugging Face's eager attention orders it; softmax(dtype=) once."""
    from picockpt.ops.attention import attention_probs
    g = torch.Generator().manual_seed(0)
    B, H, KV, T, hd = 2, 6, 2, 19, 8
    q = torch.randn(B, H, T, hd, generator=g).to(dtype)
    k = torch.randn(B, KV, T, hd, generator=g).to(dtype)
    scores = q @ k.repeat_interleave(H // KV, dim=1).transpose(-1, -2) * hd ** -0.5  # (B, H, T, T)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.softmax(scores.float(), dim=-1).to(dtype)
    assert torch.equal(attention_probs(q, k, torch.float32), expected)

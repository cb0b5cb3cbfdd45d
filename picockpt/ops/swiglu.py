"""The SwiGLU product of Llama's MLP: a = silu(g) * u, with g = x Wg^T and u = x Wu^T.

silu(g) = g * sigmoid(g). The product a is the input of the down projection; it is elementwise in (g, u), so it can be
dropped and rebuilt from the kept g and u in one line (the way llm.c rebuilds GELU in its backward).
"""
import torch


def swiglu_forward(gate, up):
    # gate, up (B, T, f)
    return torch.nn.functional.silu(gate) * up  # (B, T, f)


def swiglu_backward(dact, gate, up):
    """Forward was a = silu(g) * u, silu(g) = g * s with s = sigmoid(g).

    du = da * silu(g)
    dg = da * u * silu'(g),   silu'(g) = s + g * s * (1 - s) = s * (1 + g * (1 - s))

    Written out, dg is about seven passes over (B, T, f) (sigmoid, 1 - s, and a pass per product);
    torch has the silu' line as one kernel, aten.silu_backward(grad, g) = grad * s * (1 + g * (1 - s)),
    computed in fp32 inside for 16-bit tensors (the kernel autograd runs for F.silu). So four passes:
    silu(g), its product with da (in place), da * u, and silu_backward over that buffer (in place),
    the same kernels, in the same order, as autograd's backward of silu(g) * u: bitwise its result.
    """
    dup = torch.nn.functional.silu(gate).mul_(dact)  # (B, T, f) du = silu(g) * da
    dgate = dact * up  # (B, T, f) da * u, the gradient reaching silu(g)
    torch.ops.aten.silu_backward(dgate, gate, grad_input=dgate)  # (B, T, f) dg = (da * u) * silu'(g), in place
    return dgate, dup

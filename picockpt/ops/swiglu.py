"""The SwiGLU product of Llama's MLP: a = silu(g) * u, with g = x Wg^T and u = x Wu^T.

silu(g) = g * sigmoid(g). The product a is the input of the down projection; it
is elementwise in (g, u), so it can be dropped and rebuilt from the kept g and u
in one line (the way llm.c rebuilds GELU in its backward).
"""
import torch


def swiglu_forward(gate, up):
    # gate, up (B, T, f)
    return torch.nn.functional.silu(gate) * up  # (B, T, f)


def swiglu_backward(dact, gate, up):
    """Forward was a = silu(g) * u, silu(g) = g * s with s = sigmoid(g).

    du = da * silu(g)
    dg = da * u * silu'(g),   silu'(g) = s + g * s * (1 - s) = s * (1 + g * (1 - s))
    """
    s = torch.sigmoid(gate)  # (B, T, f)
    dup = dact * gate * s  # (B, T, f)
    # dgate = (1 - s) * g + 1, times s * u * da, computed in place: one (B, T, f) buffer, no temporaries
    dgate = (1 - s).mul_(gate).add_(1).mul_(s).mul_(up).mul_(dact)  # (B, T, f)
    return dgate, dup

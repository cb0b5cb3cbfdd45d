"""Linear layer without bias, as in Llama: y = x @ W.T, W of shape (out, in).

Its backward is two matmuls that need nothing of each other: dx, which the layer below waits for, and dW, which
nobody waits for. A zero-bubble pipeline (Qi et al. 2023; picockpt/parallel/pipeline_parallel) runs them apart:
inside deferred_weight_grads() linear_backward returns a WeightGrad, what dW reads, in dW's place, and the
pipeline stage computes weight_grad(*it) later (ZB-H1's W), holding dy and x until then.
"""
import contextlib
from collections import namedtuple

WeightGrad = namedtuple("WeightGrad", "output_grad input")  # dy (..., out) and x (..., in), for dW later
_deferring = [False]  # True inside deferred_weight_grads()


def linear_forward(x, weight):
    # x (..., in), weight (out, in)
    return x @ weight.T  # (..., out)


def linear_backward(dy, x, weight):
    """Forward was y = x @ W.T, i.e. y[n, o] = sum_i x[n, i] * W[o, i].

    dx[n, i] = sum_o dy[n, o] * W[o, i]       -> dx = dy @ W
    dW[o, i] = sum_n dy[n, o] * x[n, i]       -> dW = dy.T @ x   (n runs over all B*T rows)
    """
    dx = dy @ weight  # (..., in)
    return dx, WeightGrad(dy, x) if _deferring[0] else weight_grad(dy, x)  # dW (out, in), or what it reads


def weight_grad(dy, x):
    return dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (out, in)


@contextlib.contextmanager
def deferred_weight_grads(defer=True):
    """Inside: every linear_backward returns WeightGrad(dy, x) in place of dW (defer=False: a no-op)."""
    before, _deferring[0] = _deferring[0], defer
    try:
        yield
    finally:
        _deferring[0] = before

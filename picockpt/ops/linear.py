"""Linear layer without bias, as in Llama: y = x @ W.T, W of shape (out, in)."""


def linear_forward(x, weight):
    # x (..., in), weight (out, in)
    return x @ weight.T  # (..., out)


def linear_backward(dy, x, weight):
    """Forward was y = x @ W.T, i.e. y[n, o] = sum_i x[n, i] * W[o, i].

    dx[n, i] = sum_o dy[n, o] * W[o, i]       -> dx = dy @ W
    dW[o, i] = sum_n dy[n, o] * x[n, i]       -> dW = dy.T @ x   (n runs over all B*T rows)
    """
    dx = dy @ weight  # (..., in)
    dweight = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (out, in)
    return dx, dweight

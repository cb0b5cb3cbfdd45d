"""Token embedding: a row lookup, y[b, t] = W[ids[b, t]]."""
import torch


def embedding_forward(ids, weight):
    # ids (B, T) int64, weight (V, h)
    return weight[ids]  # (B, T, h)


def embedding_backward(dy, ids, weight_shape):
    """Forward was y[b, t, :] = W[ids[b, t], :].

    Each row of W receives the sum of the gradients of the positions that read it:
    dW[v, :] = sum over (b, t) with ids[b, t] == v of dy[b, t, :]   (a scatter-add)
    """
    dweight = torch.zeros(weight_shape, dtype=dy.dtype, device=dy.device)  # (V, h)
    dweight.index_add_(0, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))  # (V, h)
    return dweight

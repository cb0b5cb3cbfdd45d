"""Every op of the model as a pair of plain functions, forward and backward, side by side.

A forward returns its output and whatever its backward will need; a backward takes the gradient of the output and those
tensors and returns the gradients of the inputs and weights. Nothing here touches autograd or the activation store: the
layer (picockpt/model/layer.py) decides what is kept.
"""
from .attention import attention_backward, attention_forward, attention_probs
from .cross_entropy import cross_entropy_backward, cross_entropy_forward
from .dropout import dropout_backward, dropout_forward, dropout_mask
from .embedding import embedding_backward, embedding_forward
from .linear import linear_backward, linear_forward
from .rmsnorm import rmsnorm_apply, rmsnorm_backward, rmsnorm_forward
from .rope import rope_backward, rope_forward, rope_tables
from .swiglu import swiglu_backward, swiglu_forward

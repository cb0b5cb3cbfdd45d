"""picockpt: activation recomputation (gradient checkpointing), written out by hand.

    from picockpt import Config, init_params, loss_and_grads
    cfg = Config.from_preset("tiny")
    params = init_params(cfg, seed=0)
    loss, grads = loss_and_grads(params, cfg, input_ids, targets, policy="every:2")

"checkpoint" in picockpt always means a stored activation, never a saved model file.
"""
from .config import PRESETS, Config
from .engine import loss_and_grads
from .params import init_params, param_shapes
from .policy import parse_policy, parse_size
from .store import ActivationStore

__all__ = ["Config", "PRESETS", "init_params", "param_shapes", "loss_and_grads", "parse_policy",
           "parse_size", "ActivationStore"]

"""picockpt: activation recomputation (gradient checkpointing), written out by hand.

    from picockpt import Config, init_params, loss_and_grads
    cfg = Config.from_preset("tiny")
    params = init_params(cfg, seed=0)
    loss, grads = loss_and_grads(params, cfg, input_ids, targets, policy="every:2")

"checkpoint" in picockpt always means a stored activation, never a saved model file.

The names below are imported when first used (PEP 562), not when the package is: `python -m picockpt` imports
this file before its own code runs, and torch takes seconds to import, so a Ctrl-C then reaches the command's
handler (one line, exit code 130) instead of a traceback from inside torch.
"""
import importlib

WHERE = {"Config": "model.config", "PRESETS": "model.config", "loss_and_grads": "recompute.engine",
         "init_params": "model.params", "param_shapes": "model.params", "parse_policy": "recompute.policy",
         "parse_size": "recompute.policy", "ActivationStore": "recompute.store"}
__all__ = list(WHERE)


def __getattr__(name):
    if name not in WHERE:
        raise AttributeError(f"module 'picockpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{WHERE[name]}", __name__), name)
    globals()[name] = value  # the next use finds it without coming here
    return value


def __dir__():
    return sorted(set(globals()) | set(WHERE))

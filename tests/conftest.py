import pytest
import torch

from picockpt import Config, init_params
from picockpt.measure import make_batch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


def setup(batch=2, seq=13, seed=0, preset="tiny", **overrides):
    """A config, its params and one batch of the synthetic task."""
    cfg = Config.from_preset(preset, **overrides)
    params = init_params(cfg, seed=seed)
    input_ids, targets = make_batch(cfg, batch, seq, "cpu", seed)
    return cfg, params, input_ids, targets

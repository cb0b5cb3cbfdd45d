import os

import pytest
import torch

from picockpt import Config, init_params
from picockpt.measure import make_batch


def pytest_configure(config):
    """Under pytest-xdist (the whole suite: pyproject.toml's addopts) each worker computes on its share of
    the cores, so two workers on two cores do not wait on each other's threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(items):
    """The files that start processes or execute notebooks first: under pytest-xdist's --dist loadfile each
    file runs whole on one worker, and a long file begun last would leave the other worker idle."""
    heavy = {item.path for item in items if item.get_closest_marker("ranks") or item.get_closest_marker("notebooks")}
    items.sort(key=lambda item: item.path not in heavy)  # stable: the order within each group stays


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny shapes run as fast on one thread as on two, and steadily on a shared, busy CPU (torch's
    worker threads otherwise wait on each other whenever a core is taken)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def setup(batch=2, seq=13, seed=0, preset="tiny", **overrides):
    """A config, its params and one batch of the synthetic task."""
    cfg = Config.from_preset(preset, **overrides)
    params = init_params(cfg, seed=seed)
    input_ids, targets = make_batch(cfg, batch, seq, "cpu", seed)
    return cfg, params, input_ids, targets


def random_norms(model):
    """Give a Hugging Face model random norm weights (they start at 1), so a swapped norm would show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model

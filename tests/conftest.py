import fcntl
import json
import os

import pytest
import torch

from picockpt import Config, init_params
from picockpt.measurement.measure import make_batch


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


@pytest.fixture(scope="session")
def u_curve(tmp_path_factory):
    """measure(layers, hidden, ffn, seq) -> (cfg, batch, {C: the store's measured peak under every:C, C = 1..L}) of
    lesson 04's deep, narrow model (its deep() and measure_peaks; batch 2). test_lessons.py and test_formulas.py hold
    the same sweep to their formulas: it is measured once per test run, under pytest-xdist once for all the workers
    (a file in the run's shared temporary folder, written under a lock; the other worker reads it)."""
    from picockpt.teaching.reproduce import discover, load
    [path] = [path for path in discover(kinds=(".py",)) if path.name.startswith("04_segments")]
    segments = load(path)
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None
    cache = {}

    def measure(layers, hidden, ffn, seq):
        cfg, batch = segments.deep(layers, hidden=hidden, ffn=ffn), 2
        key = f"u_curve_{layers}_{hidden}_{ffn}_{seq}"
        if key not in cache:
            cache[key] = once_per_run(shared, key, lambda: segments.measure_peaks(cfg, batch, seq, range(1, layers + 1)))
        return cfg, batch, cache[key]
    return measure


def once_per_run(folder, key, compute):
    """compute() -> {int: int}, computed by the first worker to ask and read from folder/key.json by the others
    (folder None: this process alone, computed here)."""
    if folder is None:
        return compute()
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = folder / f"{key}.json"
        if done.exists():
            return {int(k): v for k, v in json.loads(done.read_text()).items()}
        value = compute()
        done.write_text(json.dumps(value))
        return value


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


def split_layout(kwargs, alone=None):
    """(Layout of the keywords that name its fields, the other keywords): a test case written as flat keywords, as
    picockpt.parallel takes it (the layout one object, the launch's and the job's keywords beside it). alone: the
    sizes to start from when no keyword names one (loss_and_grads' Layout(tp=2), what it runs given no layout)."""
    from dataclasses import replace
    from picockpt.parallel import Layout
    fields = Layout.__dataclass_fields__
    given = {k: v for k, v in kwargs.items() if k in fields}
    sizes = {"dp", "pp", "tp", "ep", "cp", "zero", "microbatches"}
    base = alone if alone is not None and not sizes & set(given) else Layout()
    return replace(base, **given), {k: v for k, v in kwargs.items() if k not in fields}

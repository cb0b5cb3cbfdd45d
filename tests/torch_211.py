"""Torch 2.11's surface (what the GPU images ship) simulated on the torch these tests run on, so the CPU tests
reproduce what differs:

- torch.utils.flop_counter's SDPA formulas before torch 2.12 assert that key and value have the query's heads
  (an AssertionError under grouped-query attention);
- torch.distributed has neither all_gather_single nor reduce_scatter_single (both new in 2.13): FSDP2 calls
  all_gather_into_tensor and reduce_scatter_tensor;
- DTensor.full_tensor()'s functional all-gather (2.11: _functional_collectives.all_gather_tensor; 2.13 calls
  all_gather_single) runs as a coalesced all-gather, which gloo lacks ("Backend gloo does not support
  allgather_into_tensor_coalesced");
- torch.__version__ reads 2.11.0 (what picockpt decides by version: pipelining's warm-up, below);
- torch.distributed.pipelining checks every stage input's shape and strides against the stage's metadata (torch
  <= 2.11 always; later torch only under TORCH_DISTRIBUTED_DEBUG=DETAIL, which this sets).

In this process: `with torch_211(monkeypatch): ...` (the fixture `torch_211_surface` below). In subprocesses, their
spawned ranks too: `env=torch_211_env()`, whose PYTHONPATH runs torch_211_site/sitecustomize.py at start-up.
"""
import os
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.utils import flop_counter

NEWER_DISTRIBUTED = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
_LENIENT = flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count
_FUNCTIONAL_GATHERS = {name: getattr(funcol, name) for name in ("all_gather_tensor", "all_gather_single")
                       if hasattr(funcol, name)}  # DTensor's gather: the older name, and 2.13's


def _strict_forward(query_shape, key_shape, value_shape):
    if not (query_shape[1] == key_shape[1] == value_shape[1]):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
    return _LENIENT[0](query_shape, key_shape, value_shape)


def _strict_backward(grad_out_shape, query_shape, key_shape, value_shape):
    if not (grad_out_shape[1] == query_shape[1] == key_shape[1] == value_shape[1]):
        raise AssertionError("sdpa_backward_flop_count: grad_out/value/key/query shapes are incompatible")
    return _LENIENT[1](grad_out_shape, query_shape, key_shape, value_shape)


def _gloo_gather(name):
    def gather(tensor, gather_dim, group, *args, **kwargs):
        if dist.get_backend() == "gloo":  # every CPU test's ranks
            raise RuntimeError("Backend gloo does not support allgather_into_tensor_coalesced")
        return _FUNCTIONAL_GATHERS[name](tensor, gather_dim, group, *args, **kwargs)
    return gather


class _DistributedBefore213(types.ModuleType):
    """torch.distributed as FSDP2 calls it in torch 2.11: the flat collectives under their older names, each
    looked up on torch.distributed at its call (so a wrapper put there, as the FSDP2 peer's counter, sees it)."""

    def __getattr__(self, name):
        return getattr(dist, NEWER_DISTRIBUTED.get(name, name))


def changes():
    """(object, name, new value or None to delete) for each difference above."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # 2.13's FSDP2 calls the new names

    return ([(flop_counter, "sdpa_flop_count", _strict_forward),
             (flop_counter, "sdpa_backward_flop_count", _strict_backward)]
            + [(dist, name, None) for name in NEWER_DISTRIBUTED if hasattr(dist, name)]
            + [(_fsdp_collectives, "dist", _DistributedBefore213("torch.distributed"))]
            + [(funcol, name, _gloo_gather(name)) for name in _FUNCTIONAL_GATHERS]
            + [(torch, "__version__", "2.11.0")]
            + [(os.environ, "TORCH_DISTRIBUTED_DEBUG", "DETAIL")])


def apply(monkeypatch=None):
    """Make the changes: through pytest's monkeypatch (undone after the test), or for good (a subprocess)."""
    for target, name, value in changes():
        if target is os.environ:
            (monkeypatch.setenv if monkeypatch else os.environ.__setitem__)(name, value)
        elif value is None:
            monkeypatch.delattr(target, name) if monkeypatch else delattr(target, name)
        else:
            monkeypatch.setattr(target, name, value) if monkeypatch else setattr(target, name, value)


@pytest.fixture
def torch_211_surface(monkeypatch):
    apply(monkeypatch)


def torch_211_env():
    """os.environ for a subprocess that starts with torch 2.11's surface (and so do the ranks it spawns)."""
    site = str(Path(__file__).parent / "torch_211_site")
    path = os.pathsep.join(filter(None, (site, os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path}

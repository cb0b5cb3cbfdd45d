"""The collective pairs on 2 and 4 ranks against the same math in one process (autograd as the
oracle), and the bytes each rank's Comm books per phase against their closed form.

Values are multiples of 1/8 below 8 in fp64, so every sum of a few is exact whatever order the
collective adds in: the comparisons are torch.equal, not a tolerance.
"""
import contextlib
import multiprocessing
from types import SimpleNamespace

import pytest
import torch

from picockpt.parallel import (all_reduce_grads, all_to_all_backward, all_to_all_forward,
                               copy_to_parallel_backward, copy_to_parallel_forward, exchange_splits,
                               gather_sequence_backward, gather_sequence_forward, reduce_from_parallel_backward,
                               reduce_from_parallel_forward, run_ranks, scatter_sequence_backward,
                               scatter_sequence_forward, split_sequence_backward, split_sequence_forward)
from picockpt.measurement.tracker import Tracker

B, N, H = 2, 3, 4  # batch, sequence positions per rank (T = N * world size), hidden
# ranks forked from a helper that imported torch once: ~0.1 s a run instead of ~1 s of CPU a rank
# (the spawn path itself is tested in test_parallel_launch.py)
START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
GRAD_SHAPES = {"model.norm.weight": (H,), "lm_head.weight": (5, H)}
F64 = 8  # bytes per element


def values(seed, *shape):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-64, 64, shape, generator=generator).double() / 8  # exact sums in fp64


def rows(source, destination):
    """How many rows rank `source` sends to rank `destination` in the all-to-all: uneven, some 0,
    and a rank's own chunk is not always empty."""
    return (source + 2 * destination + 1) % 4


def run_every_pair(comm, tracker_kind):
    """Each pair's forward and backward on this rank's inputs; returns the outputs and the log."""
    with (Tracker("cpu", physical=False, flops=False) if tracker_kind == "Tracker" else Phases()) as tracker:
        comm.tracker = tracker
        return run_pairs_in_phases(comm, tracker.phase)


class Phases:  # the least a tracker needs to be: an object with a phase_name
    phase_name = "outside"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @contextlib.contextmanager
    def phase(self, name):
        self.phase_name = name
        yield
        self.phase_name = "outside"


def run_pairs_in_phases(comm, phase):
    W, r = comm.world_size, comm.rank
    T = N * W
    out = {}
    with phase("forward"):
        out["copy.y"] = copy_to_parallel_forward(values(1, B, T, H), comm)
        out["reduce.y"] = reduce_from_parallel_forward(values(200 + r, B, T, H), comm)
        out["gather.y"] = gather_sequence_forward(values(300 + r, B, N, H), comm, dim=1)
        out["scatter.y"] = scatter_sequence_forward(values(500 + r, B, T, H), comm, dim=1)
        out["split.y"] = split_sequence_forward(values(3, B, T, H), comm, dim=1)
        send = [rows(r, s) for s in range(W)]
        receive = exchange_splits(send, comm)
        out["a2a.receive"] = receive
        out["a2a.y"] = all_to_all_forward(values(800 + r, sum(send), H), comm, send, receive)
    with phase("recompute"):  # what a recomputed layer does again: the same gather
        out["gather.y again"] = gather_sequence_forward(values(300 + r, B, N, H), comm, dim=1)
    with phase("backward"):
        out["copy.dx"] = copy_to_parallel_backward(values(100 + r, B, T, H), comm)
        out["reduce.dx"] = reduce_from_parallel_backward(values(2, B, T, H), comm)
        out["gather.dx"] = gather_sequence_backward(values(400 + r, B, T, H), comm, dim=1)
        out["scatter.dx"] = scatter_sequence_backward(values(600 + r, B, N, H), comm, dim=1)
        out["split.dx"] = split_sequence_backward(values(700 + r, B, N, H), comm, dim=1)
        out["a2a.dx"] = all_to_all_backward(values(900 + r, sum(receive), H), comm, send, receive)
    grads = {name: values(1000 + 10 * r + i, *shape) for i, (name, shape) in enumerate(GRAD_SHAPES.items())}
    out["grads.sum"] = dict(all_reduce_grads(grads, comm))  # no phase: booked under "outside"
    grads = {name: values(1000 + 10 * r + i, *shape) for i, (name, shape) in enumerate(GRAD_SHAPES.items())}
    out["grads.mean"] = dict(all_reduce_grads(grads, comm, mean=True))
    return out, comm.log


def one_process(W):
    """The same math with every rank's tensors in one process; gradients by autograd."""
    T = N * W
    want = [{} for _ in range(W)]
    # copy_to_parallel: one replicated x used by W branches, each with its own output gradient
    x = values(1, B, T, H).requires_grad_()
    sum((x * values(100 + r, B, T, H)).sum() for r in range(W)).backward()
    for r in range(W):
        want[r]["copy.y"], want[r]["copy.dx"] = x.detach(), x.grad
    # reduce_from_parallel: y = sum of the ranks' summands, replicated; its gradient is one dy
    xs = [values(200 + r, B, T, H).requires_grad_() for r in range(W)]
    y = sum(xs)
    (y * values(2, B, T, H)).sum().backward()
    for r in range(W):
        want[r]["reduce.y"], want[r]["reduce.dx"] = y.detach(), xs[r].grad
    # gather_sequence: y = cat of the shards, used by every rank's branch with its own gradient
    xs = [values(300 + r, B, N, H).requires_grad_() for r in range(W)]
    y = torch.cat(xs, dim=1)
    sum((y * values(400 + r, B, T, H)).sum() for r in range(W)).backward()
    for r in range(W):
        want[r]["gather.y"], want[r]["gather.y again"], want[r]["gather.dx"] = y.detach(), y.detach(), xs[r].grad
    # scatter_sequence: y = sum of the summands; rank r keeps slice r
    xs = [values(500 + r, B, T, H).requires_grad_() for r in range(W)]
    shards = sum(xs).chunk(W, dim=1)
    sum((shards[r] * values(600 + r, B, N, H)).sum() for r in range(W)).backward()
    for r in range(W):
        want[r]["scatter.y"], want[r]["scatter.dx"] = shards[r].detach(), xs[r].grad
    # split_sequence: one replicated x; rank r keeps slice r
    x = values(3, B, T, H).requires_grad_()
    shards = x.chunk(W, dim=1)
    sum((shards[r] * values(700 + r, B, N, H)).sum() for r in range(W)).backward()
    for r in range(W):
        want[r]["split.y"], want[r]["split.dx"] = shards[r].detach(), x.grad
    # all_to_all: rank r's rows, in blocks by destination; rank s receives the blocks in source order
    xs = [values(800 + r, sum(rows(r, s) for s in range(W)), H).requires_grad_() for r in range(W)]
    blocks = [x.split([rows(r, s) for s in range(W)]) for r, x in enumerate(xs)]
    ys = [torch.cat([blocks[r][s] for r in range(W)]) for s in range(W)]
    sum((ys[s] * values(900 + s, ys[s].shape[0], H)).sum() for s in range(W)).backward()
    for r in range(W):
        want[r]["a2a.receive"] = [rows(s, r) for s in range(W)]
        want[r]["a2a.y"], want[r]["a2a.dx"] = ys[r].detach(), xs[r].grad
    # all_reduce_grads: the sum (and the mean) of every rank's gradient
    for i, (name, shape) in enumerate(GRAD_SHAPES.items()):
        total = sum(values(1000 + 10 * r + i, *shape) for r in range(W))
        for r in range(W):
            want[r].setdefault("grads.sum", {})[name] = total
            want[r].setdefault("grads.mean", {})[name] = total / W
    return want


def closed_form_bytes(W, r):
    """What rank r's Comm must book: the conventions of picockpt/parallel/comm.py."""
    full = B * N * W * H * F64  # one (B, T, H) tensor
    sent = sum(rows(r, s) for s in range(W)) * H * F64  # this rank's all-to-all input, own chunk included
    received = sum(rows(s, r) for s in range(W)) * H * F64
    grads = sum(torch.Size(shape).numel() for shape in GRAD_SHAPES.values()) * F64
    bytes_ = {"forward": {"all_reduce": full, "all_gather": full, "reduce_scatter": full,
                          "all_to_all": W * 8 + sent},  # the split sizes (one int64 per rank), then the rows
              "recompute": {"all_gather": full},
              "backward": {"all_reduce": full, "reduce_scatter": full, "all_gather": 2 * full,
                           "all_to_all": received},
              "outside": {"all_reduce": 2 * grads}}
    calls = {"forward": {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 2},
             "recompute": {"all_gather": 1},
             "backward": {"all_reduce": 1, "reduce_scatter": 1, "all_gather": 2, "all_to_all": 1},
             "outside": {"all_reduce": 2 * len(GRAD_SHAPES)}}
    return bytes_, calls


@pytest.fixture(autouse=True)
def no_rank_left_behind():
    yield
    assert multiprocessing.active_children() == []


@pytest.mark.ranks
@pytest.mark.parametrize("world_size, tracker_kind", [(2, "Tracker"), (4, "phase_name only")])
def test_every_pair_equals_one_process_math_and_books_its_closed_form_bytes(world_size, tracker_kind):
    results = run_ranks(run_every_pair, world_size, tracker_kind, timeout_s=60, start_method=START)
    want = one_process(world_size)
    for r, (out, log) in enumerate(results):
        assert out.keys() == want[r].keys()
        for key, expected in want[r].items():
            if isinstance(expected, dict):
                assert all(torch.equal(out[key][name], expected[name]) for name in expected), (r, key)
            elif isinstance(expected, list):
                assert out[key] == expected, (r, key)
            else:
                assert out[key].dtype == torch.float64 and torch.equal(out[key], expected), (r, key)
        bytes_, calls = closed_form_bytes(world_size, r)
        assert (log.bytes, log.calls) == (bytes_, calls), r
        assert log.total() == sum(sum(per_kind.values()) for per_kind in bytes_.values())
        assert log.total(phase="backward", kind="all_gather") == bytes_["backward"]["all_gather"]
        assert log.total(kind="all_gather") == bytes_["forward"]["all_gather"] * 4  # forward, recompute, 2 backward
        assert (log.count(), log.count(phase="forward"), log.count(kind="all_to_all")) == (15, 5, 3)


def test_shapes_that_do_not_split_are_value_errors_naming_the_dim():
    comm = SimpleNamespace(rank=0, world_size=4)  # these checks run before anything is sent
    not_divisible = r"^dim=1: size 6 of a tensor of shape \(2, 6, 4\) is not divisible by the 4 ranks"
    with pytest.raises(ValueError, match=not_divisible):
        split_sequence_forward(torch.zeros(2, 6, 4), comm, dim=1)
    with pytest.raises(ValueError, match=not_divisible):
        scatter_sequence_forward(torch.zeros(2, 6, 4), comm, dim=1)
    with pytest.raises(ValueError, match=r"^dim=3: a tensor of shape \(2, 6, 4\) has dims -3\.\.2"):
        gather_sequence_forward(torch.zeros(2, 6, 4), comm, dim=3)
    with pytest.raises(ValueError, match=r"^send_splits=\[1, 2\]: give 4 row counts \(one per rank\), none negative"):
        all_to_all_forward(torch.zeros(3, 4), comm, [1, 2], [1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"^send_splits=\[1, 1, 1, 1\] sum to 4, but the tensor has 3 rows"):
        all_to_all_forward(torch.zeros(3, 4), comm, [1, 1, 1, 1], [1, 1, 1, 1])


def test_a_negative_dim_counts_from_the_end():
    comm = SimpleNamespace(rank=1, world_size=2)
    x = torch.arange(12.0).reshape(1, 3, 4)
    assert torch.equal(split_sequence_forward(x, comm, dim=-1), x[..., 2:])

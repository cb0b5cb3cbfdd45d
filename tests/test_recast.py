"""The policy's recast: a layer's 16-bit weight copies cast each time it runs and dropped after, against
today's one copy of every weight kept for the step. The same bits, the copies' bytes equal to the closed
form (params.copy_bytes, fit.step_bytes's state), refused where it means nothing (fp32) or is not built
(the parallel layouts)."""
import pytest
import torch

from picockpt import loss_and_grads
from picockpt.measurement.alloc_trace import live_peak, only, trace_of
from picockpt.planning.fit import step_bytes
from picockpt.model.params import copy_bytes
from picockpt.recompute.policy import parse_policy
from picockpt.measurement.tracker import Tracker
from picockpt.parallel import Layout

from conftest import setup

POLICIES = ["none", "full", "every:2", "selective", "cheap", "every:2+selective", "full+cheap", "budget:100KiB"]
SHAPES = {
    "dense": dict(layers=3),
    "tied": dict(hidden=32, heads=4, kv_heads=2, layers=2, tie_embeddings=True),
    "experts": dict(layers=2, experts=4, experts_per_token=2, ffn=32),
}


@pytest.fixture(autouse=True)
def _one_thread():  # 16-bit ops this small run fastest on one thread
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def weights_peak(tracker):
    """The highest bytes held at once by the storages the step marked "weights" (its 16-bit copies)."""
    return live_peak(only(trace_of(tracker), ("weights",)))


def test_spellings():
    assert parse_policy("full+recast").text == "full+recast"
    assert parse_policy("recast+selective+every:2").text == "every:2+selective+recast"
    assert parse_policy("recast").text == parse_policy("none+recast").text == "recast"
    assert parse_policy("full+recast+offload").text == "full+recast+offload"
    assert parse_policy("full").recast is False and parse_policy("full+recast").recast is True
    with pytest.raises(ValueError, match="recast is given twice"):
        parse_policy("recast+full+recast")


def test_refused_without_copies():
    """In fp32 and fp64 the step computes with the master weights: nothing to recast."""
    for dtype in ("float32", "float64"):
        cfg, params, ids, targets = setup(dtype=dtype)
        with pytest.raises(ValueError, match=f"recast.*dtype='{dtype}'.*leave out recast"):
            loss_and_grads(params, cfg, ids, targets, "full+recast")


def test_parallel_layouts_refuse_recast_before_any_rank_starts():
    from picockpt.parallel.job import ParallelJob, checked_job
    cfg, params, ids, targets = setup(dtype="bfloat16", layers=2)
    job = ParallelJob(params, cfg, ids, targets, "full+recast", Layout(tp=2))
    with pytest.raises(ValueError, match=r"policy 'full\+recast': recast .* one process only.*policy 'full'"):
        checked_job(job, "cpu", 2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("dropout", [0.0, 0.15])
def test_recast_is_bitwise_today(dtype, dropout):
    """The cast is deterministic: casting a layer's weights again gives the same bits, so every policy
    with recast gives today's loss and gradients exactly."""
    cfg, params, ids, targets = setup(batch=2, seq=19, layers=4, dtype=dtype, dropout=dropout)
    for policy in POLICIES:
        torch.manual_seed(0)
        loss0, grads0 = loss_and_grads(params, cfg, ids, targets, policy)
        torch.manual_seed(0)
        loss, grads = loss_and_grads(params, cfg, ids, targets, policy + "+recast")
        assert torch.equal(loss, loss0), policy
        assert all(torch.equal(grads[name], grads0[name]) for name in grads0), policy


@pytest.mark.parametrize("shape", list(SHAPES))
def test_weight_copies_equal_the_closed_form(shape):
    """Kept: 2 bytes for every parameter. Recast: the embedding's, final norm's and head's, plus one
    layer's, whatever the layer level; the same number in fit.step_bytes's state."""
    cfg, params, ids, targets = setup(batch=2, seq=16, dtype="bfloat16", **SHAPES[shape])
    optimizer_free = cfg.num_params() * 8  # fp32 weights and their gradients
    for policy in ("none", "full", "every:2+selective"):
        for recast in (False, True):
            text = policy + ("+recast" if recast else "")
            with Tracker() as tracker:
                loss_and_grads(params, cfg, ids, targets, text, tracker=tracker)
            assert weights_peak(tracker) == copy_bytes(cfg, recast), text
            assert step_bytes(cfg, 2, 16, text, optimizer=False)["state"] == optimizer_free + copy_bytes(cfg, recast)
    assert copy_bytes(cfg) == 2 * cfg.num_params()
    assert copy_bytes(cfg, True) < copy_bytes(cfg) and copy_bytes(cfg.replace(dtype="float32"), True) == 0


def test_recast_lowers_the_tracked_total_by_the_copies():
    """The physical activation count leaves the copies out either way: the same bytes. The tracked total
    (every storage of the step) is lower by at least the closed forms' difference: kept, the copies add
    copy_bytes(cfg) at every moment; recast, at most copy_bytes(cfg, True)."""
    cfg, params, ids, targets = setup(batch=2, seq=16, layers=4, dtype="bfloat16")
    peaks = {}
    for text in ("full", "full+recast"):
        with Tracker() as tracker:
            loss_and_grads(params, cfg, ids, targets, text, tracker=tracker)
        peaks[text] = tracker
    kept, recast = peaks["full"], peaks["full+recast"]
    assert kept.peak_physical == recast.peak_physical and kept.peak_logical == recast.peak_logical
    total = {name: max(p["total"] for p in t.peaks.values()) for name, t in peaks.items()}
    assert copy_bytes(cfg) - copy_bytes(cfg, True) <= total["full"] - total["full+recast"] < copy_bytes(cfg), total

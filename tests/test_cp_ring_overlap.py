"""The overlapped ring (cp_comm="ring_overlap") against the simple one, cp = 2 on gloo, one launch: the same hops
and the same sums in the same order, so the same loss and gradients bitwise (fp64 tiled, fp32 fused), the same
bytes per phase and kind, each equal to its closed form."""
import multiprocessing

import pytest
import torch

from picockpt import Config, init_params
from picockpt.measurement.measure import make_batch
from picockpt.parallel import Layout, ParallelJob, run_jobs

from processes import no_process_left_behind  # noqa: F401 (a fixture)

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
BASE = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=40, max_seq=64)
MODELS = [dict(dtype="float64", attention="tiled", attention_tile=4), dict(dtype="float32", attention="fused")]

pytestmark = pytest.mark.usefixtures("no_process_left_behind")


@pytest.mark.ranks
def test_the_overlapped_ring_gives_the_simple_ring_s_loss_and_gradients_bitwise():
    jobs = []
    for fields in MODELS:
        cfg = Config(**{**BASE, **fields})
        params = init_params(cfg, seed=1)
        ids, targets = make_batch(cfg, 2, 16, "cpu", seed=1)
        jobs += [ParallelJob(params, cfg, ids, targets, "full", Layout(cp=2, cp_comm=comm))
                 for comm in ("ring", "ring_overlap")]
    results = run_jobs(jobs, 2, start_method=START, timeout_s=120)
    for (loss, grads, ring), (loss_o, grads_o, overlapped), fields in zip(results[0::2], results[1::2], MODELS):
        assert torch.equal(loss_o, loss), fields
        assert sorted(grads_o) == sorted(grads)
        assert [k for k in grads if not torch.equal(grads_o[k], grads[k])] == [], fields
        for simple, r in zip(ring, overlapped):
            assert r["cp_comm"] == "ring_overlap" and simple["cp_comm"] == "ring"
            assert r["comm_bytes"] == simple["comm_bytes"] == r["predicted_comm_bytes"], fields
            assert r["comm_bytes_by_kind"] == simple["comm_bytes_by_kind"], fields
            assert r["comm_bytes"]["recompute"] == r["comm_bytes"]["forward"] > 0, fields  # full: the ring again
            assert r["peak_activation_bytes"] == simple["peak_activation_bytes"] == r["predicted_activation_bytes"]

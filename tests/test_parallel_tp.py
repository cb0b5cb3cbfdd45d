"""Tensor and sequence parallelism with recomputation, on 1, 2 and 4 gloo ranks against the
single-process engine: the same gradients (fp64 rel <= 1e-10, fp32 rel <= 1e-5), every policy bitwise
equal to none within one (t, sp), and every rank's stored peak, per-layer bytes, communication bytes per
phase and FLOPs equal to their closed forms (picockpt/parallel/inventory.py).

Each t is one launch of its ranks that runs every (model, sp, policy) job in turn (run_jobs): starting
ranks is the slow part, so the jobs share it; they are a covering set, not the whole cross product
(layouts). Relative error of a gradient: max |g - g_single| / max |g_single| over the tensor.
"""
import math
import multiprocessing

import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.measurement.measure import make_batch
from picockpt.parallel import Layout, ParallelJob, run_jobs
from picockpt.parallel.tensor_parallel.tp_forms import rank_chain, rank_peak_bytes
from picockpt.planning.planner import least_budget

from processes import no_process_left_behind  # noqa: F401 (a fixture)

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
BATCH, SEQ = 2, 8
BASE = dict(vocab=64, hidden=32, layers=3, ffn=64, max_seq=64, dtype="float64")
MODELS = {  # name -> Config fields; every t below divides their heads, kv heads, ffn and vocab
    "mha": dict(heads=4, kv_heads=4),
    "gqa": dict(heads=8, kv_heads=4),
    "gqa dropout": dict(heads=8, kv_heads=4, dropout=0.1),
    "gqa tiled": dict(heads=8, kv_heads=4, attention="tiled", attention_tile=3),
    "gqa fused chunked": dict(heads=8, kv_heads=4, attention="fused", loss_chunk=5),
    "mha tied fp32": dict(heads=4, kv_heads=4, tie_embeddings=True, dtype="float32", dropout=0.1),
    "gqa fp32": dict(heads=8, kv_heads=4, dtype="float32"),
}
POLICIES = ["none", "full", "every:2", "selective", "cheap", "every:2+selective", "budget"]
DISTRIBUTED = ["full", "every:2", "budget"]  # with distribute_saved (sp=False only)
PER_T = {1: ["mha", "gqa dropout"], 2: list(MODELS), 4: ["mha", "gqa", "gqa dropout", "gqa fp32"]}
EVERY_JOB = "gqa dropout"  # at each t, every policy in every layout (the other models: layouts() below)
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}


pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_process_left_behind")]  # every test spawns ranks


def model(name):
    cfg = Config(**{**BASE, **MODELS[name]})
    params = init_params(cfg, seed=1)
    input_ids, targets = make_batch(cfg, BATCH, SEQ, "cpu", seed=1)
    return cfg, params, input_ids, targets


def budget(cfg, t, sp, distributed):
    """budget:SIZE a quarter of the way from this rank's least feasible budget to storing everything."""
    chain = rank_chain(cfg, BATCH, SEQ, t, sp, distributed)
    least, most = least_budget(chain), rank_peak_bytes(cfg, BATCH, SEQ, "none", t, sp, distributed)
    return f"budget:{least + (most - least) // 4}"


def layouts(name, i):
    """((sp, distributed, policies), ...) of one model at one t, i its place among the t's models other than
    EVERY_JOB. A covering set of the 3 layouts x 7 (or 3) policies, 17 jobs a model: EVERY_JOB runs all of them at
    every t; every other model none under both sp (the reference of the bitwise test), one of DISTRIBUTED in turn,
    and under tiled or fused attention selective (nothing left to drop), cheap, one whole-layer recomputation and
    budget; a dense model three of the other six policies in turn (so two such models hold all six): 6 or 7 jobs,
    the policies split between the two sp in turn."""
    if name == EVERY_JOB:
        return (False, False, POLICIES), (True, False, POLICIES), (False, True, DISTRIBUTED)
    if "attention" in MODELS[name]:
        policies = ["selective", "cheap", "full" if i % 2 else "every:2", "budget"]
    else:
        policies = (["full", "every:2", "selective", "cheap", "every:2+selective", "budget"] * 2)[3 * i % 6:][:3]
    split = tuple((sp, False, ["none"] + [p for j, p in enumerate(policies) if (i + j) % 2 == sp])
                  for sp in (False, True))
    return split + ((False, True, [DISTRIBUTED[i % 3]]),)


def relative(value, reference):
    return ((value.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


@pytest.fixture(scope="module", params=sorted(PER_T))
def launch(request):
    """One launch of t ranks: every job for t, and the single-process step of each model."""
    t = request.param
    jobs, single = [], {}
    others = [name for name in PER_T[t] if name != EVERY_JOB]
    for name in PER_T[t]:
        cfg, params, input_ids, targets = model(name)
        torch.manual_seed(7)
        state = torch.get_rng_state()  # every run starts from this state: the same dropout masks
        single[name] = loss_and_grads(params, cfg, input_ids, targets, "none")
        for sp, distributed, policies in layouts(name, others.index(name) if name in others else None):
            for policy in policies:
                policy = budget(cfg, t, sp, distributed) if policy == "budget" else policy
                jobs.append((name, ParallelJob(params, cfg, input_ids, targets, policy,
                                               Layout(tp=t, sp=sp, distribute_saved=distributed), rng_state=state)))
    results = run_jobs([job for _, job in jobs], t, start_method=START, timeout_s=120)
    return t, single, [(name, job, *result) for (name, job), result in zip(jobs, results)]


def test_gradients_equal_the_single_process_engine(launch):
    t, single, runs = launch
    for name, job, loss, grads, _ in runs:
        loss0, grads0 = single[name]
        tolerance = TOLERANCE[job.cfg.dtype]
        assert set(grads) == set(grads0)
        assert abs(loss.item() - loss0.item()) <= tolerance * abs(loss0.item()), (t, name, job.policy)
        for key in grads0:
            assert grads[key].shape == grads0[key].shape and grads[key].dtype == grads0[key].dtype
            error = relative(grads[key], grads0[key])
            assert error <= tolerance, (t, name, job.policy, job.layout.sp, job.layout.distribute_saved, key, error)


def test_every_policy_is_bitwise_equal_to_none_within_one_layout(launch):
    t, _, runs = launch
    none = {(name, job.layout.sp): (loss, grads) for name, job, loss, grads, _ in runs
            if job.policy == "none" and not job.layout.distribute_saved}
    for name, job, loss, grads, _ in runs:
        loss0, grads0 = none[name, job.layout.sp]  # distributed saved activations: against none without sp
        assert torch.equal(loss, loss0), (t, name, job.policy, job.layout.sp)
        for key in grads0:
            assert torch.equal(grads[key], grads0[key]), (t, name, job.policy, job.layout, key)


def test_every_rank_stores_exactly_the_closed_form(launch):
    t, _, runs = launch
    for name, job, _, _, reports in runs:
        assert [r["rank"] for r in reports] == list(range(t))
        for r in reports:
            where = (t, name, job.policy, job.layout.sp, job.layout.distribute_saved, r["rank"])
            assert r["peak_activation_bytes"] == r["predicted_activation_bytes"], where
            assert r["layer_stored_bytes"] == r["predicted_layer_stored_bytes"], where
            assert r["head_stored_bytes"] == r["predicted_head_stored_bytes"], where
            assert r["flops"] == r["predicted_flops"], where
            assert r["peak_live_bytes"] >= r["peak_activation_bytes"], where


def test_communication_per_phase_equals_its_closed_form(launch):
    t, _, runs = launch
    for name, job, _, _, reports in runs:
        for r in reports:
            assert r["comm_bytes"] == r["predicted_comm_bytes"], (t, name, job.policy, job.layout.sp, r["rank"])


def test_recomputation_repeats_exactly_the_forward_collectives_of_the_recomputed_layers(launch):
    """Written from the layer, not from step_forms.py: outside the layers the forward moves the embedding's
    sum (S bytes), the loss's three all-reduces of B*T statistics, and under sp the head's all-gather (S)."""
    t, _, runs = launch
    by_job = {(name, job.policy, job.layout.sp, job.layout.distribute_saved): reports[0]
              for name, job, _, _, reports in runs}
    if t == 1:  # a group of one moves nothing: every collective returns its input at once
        for key, r in by_job.items():
            assert r["comm_bytes"] == {"forward": 0, "recompute": 0, "backward": 0}, key
            assert sum(r["comm_calls"].values()) == 0, key
        return
    for (name, policy, sp, distributed), r in by_job.items():
        cfg = Config(**{**BASE, **MODELS[name]})
        act = torch.empty((), dtype=cfg.torch_dtype).element_size()
        stat = torch.empty((), dtype=cfg.stat_dtype).element_size()
        S, stats = BATCH * SEQ * cfg.hidden * act, 3 * BATCH * SEQ * stat  # a whole activation; the loss's three
        layers_forward = r["comm_bytes"]["forward"] - S - stats - (S if sp else 0)  # the L layers' ENTER and LEAVE
        assert layers_forward == cfg.layers * (4 if sp else 2) * S
        recompute, calls = r["comm_bytes"]["recompute"], r["comm_calls"]["recompute"]
        if policy in ("none", "selective", "cheap"):
            assert recompute == 0 and calls == 0, (name, policy, sp)
        elif policy in ("full", "every:2", "every:2+selective"):  # every layer recomputed once, whole
            segments = cfg.layers if policy == "full" else math.ceil(cfg.layers / 2)
            gathers = segments * S if distributed else 0  # one all-gather of its checkpoint per segment
            assert recompute == layers_forward + gathers, (name, policy, sp, distributed)
            assert r["comm_bytes_by_kind"]["recompute"].get("all_gather", 0) == (
                gathers + (2 * cfg.layers * S if sp else 0))
        else:  # budget: fewer layers, sweeps that stop before their last LEAVE
            assert 0 < recompute < layers_forward + (cfg.layers * S if distributed else 0), (name, policy, sp)

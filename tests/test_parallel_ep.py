"""Expert parallelism with recomputation, on 2 gloo ranks against the single-process engine: the same
gradients (fp64 rel <= 1e-10, fp32 rel <= 1e-5), every policy (MoE options and both recompute choices
included, router jitter and dropout included) bitwise equal to none, and every rank's stored peak,
per-layer bytes, communication bytes per phase and FLOPs equal to their closed forms
(picockpt/parallel/ep_forms.py), for the routing of the single process on the whole batch.

One launch of the two ranks runs every (model, policy, keep_dispatched) job in turn (run_jobs); one launch of four
runs ep = 2 beside dp = 2 and beside pp = 2 (expert parallelism composed through the one rank step).
Relative error of a gradient: max |g - g_single| / max |g_single| over the tensor.
"""
import multiprocessing

import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.measurement.measure import make_batch
from picockpt.model.routing import route_by_token, step_routing
from picockpt.parallel import Layout, ParallelJob, run_jobs
from picockpt.parallel.expert_parallel.ep_forms import ep_layer_inventory

from processes import no_process_left_behind  # noqa: F401 (a fixture)

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
EP, BATCH, SEQ = 2, 4, 8
BASE = dict(vocab=64, hidden=32, layers=3, heads=4, kv_heads=2, ffn=24, max_seq=64, experts=4, experts_per_token=2,
            dtype="float64")
MODELS = {  # name -> Config fields
    "shared tied top-1": dict(experts_per_token=1, shared_expert_ffn=16, tie_embeddings=True),
    "fp32 ignored targets": dict(dtype="float32"),
    "tiled chunked all to one": dict(attention="tiled", attention_tile=3, loss_chunk=5),
    "fused E8 top-3": dict(attention="fused", experts=8, experts_per_token=3),
    "jitter dropout": dict(router_jitter=0.1, dropout=0.1),  # last: the generator it leaves is checked
}
POLICIES = ["none", "cheap+moe_act", "full", "moe", "every:2+moe", "moe+router"]
CHOICES = {"full", "moe", "every:2+moe", "full+moe+shared_experts"}  # also run with keep_dispatched=True
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}


pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_process_left_behind")]  # every test spawns ranks


def model(name):
    cfg = Config(**{**BASE, **MODELS[name]})
    params = init_params(cfg, seed=1)
    input_ids, targets = make_batch(cfg, BATCH, SEQ, "cpu", seed=1)
    if name == "fp32 ignored targets":  # rank 0's sequences count 3 targets, rank 1's 16: unequal shares
        targets = targets.clone()
        targets[0] = -100
        targets[1, 3:] = -100
    if name == "tiled chunked all to one":  # every token to experts 0 and 1: rank 1's experts get no row
        params = route_by_token(params, cfg)
        input_ids = input_ids // cfg.experts * cfg.experts
    return cfg, params, input_ids, targets


def relative(value, reference):
    """A zero reference (top-1 routing gives the router none) compares the difference itself."""
    scale = reference.double().abs().max().item()
    return (value.double() - reference.double()).abs().max().item() / (scale or 1.0)


@pytest.fixture(scope="module")
def launch():
    """One launch of 2 ranks: every job, and the single-process step and routing of each model."""
    jobs, single = [], {}
    for name in MODELS:
        cfg, params, input_ids, targets = model(name)
        torch.manual_seed(7)
        state = torch.get_rng_state()  # every run starts from this state: the same masks and jitter noise
        loss, grads = loss_and_grads(params, cfg, input_ids, targets, "none")
        after = torch.get_rng_state()  # where the single process's step leaves the generator
        torch.set_rng_state(state)
        single[name] = (loss, grads, step_routing(params, cfg, input_ids), after)  # routing: the step's draws
        policies = POLICIES + (["full+moe+shared_experts"] if cfg.shared_expert_ffn else [])
        jobs += [(name, ParallelJob(params, cfg, input_ids, targets, policy, Layout(ep=EP, keep_dispatched=keep),
                                    rng_state=state))
                 for policy in policies for keep in ((False, True) if policy in CHOICES else (False,))]
    results = run_jobs([job for _, job in jobs], EP, start_method=START, timeout_s=120)
    single["generator after"] = torch.get_rng_state()
    return single, [(name, job, *result) for (name, job), result in zip(jobs, results)]


def test_gradients_equal_the_single_process_engine(launch):
    single, runs = launch
    for name, job, loss, grads, _ in runs:
        loss0, grads0, *_ = single[name]
        tolerance = TOLERANCE[job.cfg.dtype]
        assert set(grads) == set(grads0)
        assert abs(loss.item() - loss0.item()) <= tolerance * abs(loss0.item()), (name, job.policy)
        for key in grads0:
            assert grads[key].shape == grads0[key].shape and grads[key].dtype == grads0[key].dtype
            error = relative(grads[key], grads0[key])
            assert error <= tolerance, (name, job.policy, job.layout.keep_dispatched, key, error)


def test_the_callers_generator_is_left_where_the_single_process_leaves_it(launch):
    single, runs = launch
    name, job = runs[-1][:2]
    assert name == "jitter dropout"  # the last job: its masks and noise advance the generator
    assert torch.equal(single["generator after"], single[name][3])  # after the step's draws
    assert not torch.equal(single["generator after"], job.rng_state)  # not where it started


def test_every_policy_and_choice_is_bitwise_equal_to_none(launch):
    _, runs = launch
    none = {name: (loss, grads) for name, job, loss, grads, _ in runs if job.policy == "none" and
            not job.layout.keep_dispatched}
    for name, job, loss, grads, _ in runs:
        loss0, grads0 = none[name]
        assert torch.equal(loss, loss0), (name, job.policy, job.layout.keep_dispatched)
        for key in grads0:
            assert torch.equal(grads[key], grads0[key]), (name, job.policy, job.layout.keep_dispatched, key)


def test_every_rank_stores_and_computes_exactly_the_closed_form(launch):
    single, runs = launch
    for name, job, _, _, reports in runs:
        routing = single[name][2]
        assert [r["rank"] for r in reports] == [0, 1]
        assert [r["experts"] for r in reports] == [list(range(0, job.cfg.experts // 2)),
                                                   list(range(job.cfg.experts // 2, job.cfg.experts))]
        for r in reports:
            where = (name, job.policy, job.layout.keep_dispatched, r["rank"])
            assert r["received_rows"] == r["predicted_received_rows"], where  # the single process's routing
            assert r["received_rows"] == [sum(counts[e] for e in r["experts"]) for counts in routing], where
            assert r["peak_activation_bytes"] == r["predicted_activation_bytes"], where
            assert r["layer_stored_bytes"] == r["predicted_layer_stored_bytes"], where
            assert r["head_stored_bytes"] == r["predicted_head_stored_bytes"], where
            assert r["flops"] == r["predicted_flops"], where
            assert r["peak_live_bytes"] >= r["peak_activation_bytes"], where
    skewed = [reports for name, job, *_, reports in runs if name == "tiled chunked all to one"][0]
    assert skewed[1]["received_rows"] == [0, 0, 0]  # experts 2 and 3 got nothing, and their rank ran anyway


def test_communication_per_phase_equals_its_closed_form(launch):
    _, runs = launch
    for name, job, _, _, reports in runs:
        for r in reports:
            assert r["comm_bytes"] == r["predicted_comm_bytes"], (name, job.policy, job.layout.keep_dispatched,
                                                                  r["rank"])
            # what leaves the rank: every all-to-all's buffer less the rows it sends itself
            assert r["all_to_all_sent_bytes"] == r["predicted_all_to_all_sent_bytes"], (name, job.policy, r["rank"])
            assert all(0 < r["all_to_all_sent_bytes"][phase] <= r["comm_bytes"][phase]
                       for phase in ("forward", "backward")), (name, job.policy, r["rank"])


def test_recomputation_repeats_the_dispatch_or_reads_the_rows_it_kept(launch):
    """Written from the layer, not from ep_forms.py. Per layer the forward runs four all-to-alls: the
    counts (8E bytes), the tokens (P h e) and their weights (P s) out, the combine (M h e) back. A
    recomputed layer never exchanges counts again (its routing is kept); it repeats the dispatch, or with
    keep_dispatched reads the rows it kept, and repeats the combine to compute its output again."""
    _, runs = launch
    for name, job, _, _, reports in runs:
        cfg = job.cfg
        act = torch.empty((), dtype=cfg.torch_dtype).element_size()
        stat = torch.empty((), dtype=cfg.stat_dtype).element_size()
        P = BATCH // EP * SEQ * cfg.experts_per_token  # pairs a rank sends per layer
        for r in reports:
            where = (name, job.policy, job.layout.keep_dispatched, r["rank"])
            forward = r["comm_bytes_by_kind"]["forward"]
            assert forward == {"all_to_all": sum(8 * cfg.experts + P * (cfg.hidden * act + stat) +
                                                 M * cfg.hidden * act for M in r["received_rows"])}, where
            recompute, calls = r["comm_bytes_by_kind"]["recompute"].get("all_to_all", 0), r["comm_calls"]["recompute"]
            dispatch = cfg.layers * P * (cfg.hidden * act + stat)
            combine = sum(M * cfg.hidden * act for M in r["received_rows"])
            whole = job.policy.startswith(("full", "every"))  # every layer's forward runs again
            dropped = "moe" in job.policy.split("+") and not job.layout.keep_dispatched  # the backward dispatches again
            kept = 0 if job.layout.keep_dispatched else dispatch
            expected = (combine + kept if whole else 0) + (dispatch if dropped else 0)
            assert recompute == expected, where
            assert calls == cfg.layers * ((1 if job.layout.keep_dispatched else 3) * whole + 2 * dropped), where


def test_a_checkpoint_keeps_the_routing_and_with_keep_dispatched_the_rows(launch):
    """Under full, layer 0 holds its input, its routing decision (N_r k int64), the counts its experts
    received (E int64) and, with keep_dispatched, those rows and their weights: the only difference the
    choice makes to what is stored."""
    single, runs = launch
    for name, job, _, _, reports in runs:
        if job.policy != "full":
            continue
        cfg = job.cfg
        act = torch.empty((), dtype=cfg.torch_dtype).element_size()
        stat = torch.empty((), dtype=cfg.stat_dtype).element_size()
        N = BATCH // EP * SEQ
        for r in reports:
            rows = r["received_rows"][0] * (cfg.hidden * act + stat) if job.layout.keep_dispatched else 0
            assert r["layer_stored_bytes"] == N * cfg.hidden * act + 8 * N * cfg.experts_per_token + \
                8 * cfg.experts + rows, (name, job.layout.keep_dispatched, r["rank"])
            stored = ep_layer_inventory(cfg, BATCH, SEQ, EP, r["rank"], single[name][2][0], keep_dispatched=True)
            assert stored["moe.dispatched"][0] == (r["received_rows"][0], cfg.hidden)


# ---- composed: ep beside dp and beside pp, on 4 ranks --------------------------------------------------
COMPOSED = {"ep=2 dp=2": dict(dp=2), "ep=2 pp=2 M=2 1f1b": dict(pp=2, microbatches=2),
            "ep=2 pp=2 M=2 afab": dict(pp=2, microbatches=2, schedule="afab")}
COMPOSED_POLICIES = [("none", False), ("full", False), ("full", True), ("every:2+moe", False), ("cheap+moe_act", True)]


@pytest.fixture(scope="module")
def composed():
    """One launch of 4 ranks: fp64, 4 layers (two stages of two), dropout and ignored targets, every layout and
    policy above, against the single-process step."""
    cfg = Config(**{**BASE, "layers": 4, "dropout": 0.1})
    params = init_params(cfg, seed=2)
    input_ids, targets = make_batch(cfg, 8, SEQ, "cpu", seed=2)
    targets = targets.clone()
    targets[1, 2:] = -100  # the replicas' and micro-batches' shares of the mean differ
    torch.manual_seed(7)
    state = torch.get_rng_state()
    single = loss_and_grads(params, cfg, input_ids, targets, "none")
    jobs = [(name, ParallelJob(params, cfg, input_ids, targets, policy, Layout(ep=EP, keep_dispatched=keep, **layout),
                               rng_state=state))
            for name, layout in COMPOSED.items() for policy, keep in COMPOSED_POLICIES]
    results = run_jobs([job for _, job in jobs], 4, start_method=START, timeout_s=120)
    return single, [(name, job, *result) for (name, job), result in zip(jobs, results)]


def test_composed_gradients_equal_the_single_process_and_every_policy_equals_none_bitwise(composed):
    (loss0, grads0), runs = composed
    none = {name: (loss, grads) for name, job, loss, grads, _ in runs if job.policy == "none"}
    for name, job, loss, grads, _ in runs:
        assert abs(loss.item() - loss0.item()) <= 1e-10 * abs(loss0.item()), (name, job.policy)
        assert set(grads) == set(grads0)
        for key in grads0:
            assert relative(grads[key], grads0[key]) <= 1e-10, (name, job.policy, job.layout.keep_dispatched, key)
            assert torch.equal(grads[key], none[name][1][key]), (name, job.policy, job.layout.keep_dispatched, key)
        assert torch.equal(loss, none[name][0]), (name, job.policy)


def test_composed_ranks_store_move_and_compute_exactly_their_closed_forms(composed):
    _, runs = composed
    for name, job, _, _, reports in runs:
        assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
        for r in reports:
            where = (name, job.policy, job.layout.keep_dispatched, r["rank"])
            assert r["experts"] == list(range(2 * r["ep_rank"], 2 * r["ep_rank"] + 2)), where
            for key in ("activation_bytes", "microbatch_stored_bytes", "layer_stored_bytes", "head_stored_bytes",
                        "flops", "comm_bytes", "all_to_all_sent_bytes", "received_rows", "p2p_bytes", "dp_bytes"):
                measured = r["peak_" + key if key == "activation_bytes" else key]
                assert measured == r["predicted_" + key], (where, key)
            # the gradients' reduction: every weight but the experts' over the dp x ep replicas; the experts'
            # over the dp ranks that hold them (none beside pp alone)
            assert (r["dp_bytes"] > 0) and (r["predicted_dp_bytes"] == r["dp_bytes"]), where

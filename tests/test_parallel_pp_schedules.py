"""Pipeline schedules beyond 1F1B on gloo ranks: interleaved 1F1B (V = 2, 3 chunks a rank, round a ring of
ranks) and ZB-H1 (each backward's B and W as two actions) against the single-process engine: the same loss and
gradients (fp64, rel <= 1e-10) under none, full, every:2 and a stage-aware budget, with dropout and ignored
targets, beside dp, tp (sp) and ZeRO; every rank's stored peak, first-layer and head bytes, FLOPs and
point-to-point bytes equal their closed forms (pp_forms.py); the recorded sends and receives complete in
NCCL's order. One launch per world size, shared by every case.
"""
import multiprocessing
from dataclasses import replace

import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import chain_sizes
from picockpt.measurement.measure import make_batch
from picockpt.ops.linear import WeightGrad, deferred_weight_grads, linear_backward, weight_grad
from picockpt.parallel import Layout, ParallelJob, run_jobs
from picockpt.parallel.job import checked_job, layer_forms
from picockpt.parallel.pipeline_parallel.pp_forms import ChunkForms
from picockpt.parallel.pipeline_parallel.pp_orders import w_pending_bytes
from picockpt.parallel.pipeline_parallel.pp_plan import in_flight_peak
from picockpt.parallel.pipeline_parallel.pp_schedules import actions, in_flight

from nccl_order import nccl_order_completes
from processes import no_process_left_behind  # noqa: F401 (a fixture)

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
SEQ = 8
BASE = dict(vocab=64, hidden=32, heads=4, kv_heads=2, ffn=48, max_seq=64, dtype="float64", dropout=0.1)
pytestmark = pytest.mark.usefixtures("no_process_left_behind")


def model(layers, batch):
    cfg = Config(**BASE, layers=layers)
    params = init_params(cfg, seed=1)
    input_ids, targets = make_batch(cfg, batch, SEQ, "cpu", seed=batch)
    targets = targets.clone()
    targets[0, :3] = -100  # unequal shares of the mean
    return cfg, params, input_ids, targets


def budget_for(job):
    """budget:SIZE every stage can meet, but not by keeping everything: the busiest stage's peak under every:2."""
    return f"budget:{max(layer_forms(replace(job, policy='every:2'), s).peak_bytes for s in range(job.layout.pp))}"


def jobs_for(world):
    out, single = [], {}

    def add(layers, batch, policy, **layout):
        cfg, params, input_ids, targets = model(layers, batch)
        torch.manual_seed(7)
        state = torch.get_rng_state()
        if (layers, batch) not in single:
            single[layers, batch] = loss_and_grads(params, cfg, input_ids, targets, "none")
        job = ParallelJob(params, cfg, input_ids, targets, policy, Layout(**layout), rng_state=state)
        out.append((replace(job, policy=budget_for(job)) if policy == "budget" else job, single[layers, batch]))

    if world == 2:
        for policy in ("none", "full", "every:2", "budget"):
            add(4, 4, policy, pp=2, microbatches=4, schedule="zb-h1")
            if policy != "every:2":  # 4 chunks of one layer each: every:2 would be every:1, and is refused
                add(4, 4, policy, pp=2, microbatches=4, schedule="interleaved", virtual_stages=2)
        add(6, 6, "full", pp=2, microbatches=6, schedule="interleaved", virtual_stages=3)
        add(6, 6, "budget", pp=2, microbatches=6, schedule="interleaved", virtual_stages=3)
        add(4, 2, "every:2", pp=2, microbatches=2, schedule="zb-h1")  # M = P: no steady state
        add(4, 4, "full", pp=2, microbatches=4, schedule="zb-h1", recompute_early=True)
    else:
        add(4, 8, "full", pp=2, dp=2, microbatches=4, schedule="zb-h1")
        add(4, 8, "budget", pp=2, dp=2, microbatches=4, schedule="interleaved", virtual_stages=2)
        add(4, 4, "every:2", pp=2, tp=2, sp=True, microbatches=4, schedule="zb-h1")
        add(4, 4, "full", pp=2, tp=2, sp=False, microbatches=2, schedule="interleaved", virtual_stages=2)
        add(4, 8, "full", pp=2, dp=2, microbatches=4, schedule="zb-h1", zero=3)
        add(8, 8, "none", pp=4, microbatches=4, schedule="interleaved", virtual_stages=2)
        add(5, 10, "every:2", pp=4, microbatches=5, schedule="zb-h1")
    return out


@pytest.fixture(scope="module", params=[2, 4])
def launch(request):
    jobs = jobs_for(request.param)
    results = run_jobs([job for job, _ in jobs], request.param, start_method=START, timeout_s=120)
    return [(job, single, *result) for (job, single), result in zip(jobs, results)]


def where(job, report=None):
    layout = job.layout
    return (job.policy, f"pp={layout.pp} M={layout.microbatches} {layout.schedule} V={layout.virtual_stages} "
            f"dp={layout.dp} tp={layout.tp} zero={layout.zero}", None if report is None else f"rank {report['rank']}")


def relative(value, reference):
    return ((value - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.ranks
def test_loss_and_every_gradient_equal_the_single_process(launch):
    for job, (loss0, grads0), loss, grads, _ in launch:
        assert abs(loss.item() - loss0.item()) <= 1e-10 * abs(loss0.item()), where(job)
        assert list(grads) == list(grads0), where(job)
        for name in grads0:
            assert relative(grads[name], grads0[name]) <= 1e-10, (where(job), name)


@pytest.mark.ranks
def test_every_rank_equals_its_closed_forms(launch):
    for job, _, _, _, reports in launch:
        for r in reports:
            for key in ("activation_bytes", "microbatch_stored_bytes", "layer_stored_bytes", "head_stored_bytes",
                        "flops", "p2p_bytes", "comm_bytes", "dp_bytes"):
                measured = r["peak_activation_bytes" if key == "activation_bytes" else key]
                assert measured == r[f"predicted_{key}"], (where(job, r), key)
            if job.policy.startswith("budget:"):
                assert r["peak_activation_bytes"] <= int(job.policy.split(":")[1]), where(job, r)


@pytest.mark.ranks
def test_under_none_the_peak_is_the_inventory_walked_along_the_order(launch):
    """Written from picockpt/planning/step_forms.py and the order alone: a micro-batch-chunk of n layers holds n A (+ F with
    the head) from its F to its B; under ZB-H1 it holds n w_pending_bytes from its B to its W instead."""
    for job, _, _, _, reports in launch:
        if job.policy != "none" or job.layout.tp > 1:
            continue
        b = job.input_ids.shape[0] // (job.layout.dp * job.layout.microbatches)
        _, A, F = chain_sizes(job.cfg, b, SEQ)
        W = w_pending_bytes(job.cfg, b, SEQ) if job.layout.schedule == "zb-h1" else 0
        for r in reports:
            sizes = [(b_ - a + 1, chunk == len(r["chunk_layers"]) - 1 and r["stage"] == job.layout.pp - 1)
                     for chunk, (a, b_) in enumerate(r["chunk_layers"])]
            held = [n * A + (F if head else 0) for n, head in sizes]
            layout = job.layout
            order = actions(layout.schedule, layout.pp, layout.microbatches, r["stage"], layout.virtual_stages)
            own = max(held)  # none: a micro-batch's peak is its end of forward (nothing to recompute)
            expected = in_flight_peak(order, lambda m, c: held[c], lambda m, c: held[c],
                                      lambda m, c: W * sizes[c][0])
            assert own <= r["peak_activation_bytes"] == expected, where(job, r)


@pytest.mark.ranks
def test_every_rank_posts_its_point_to_point_in_an_order_nccl_completes(launch):
    for job, _, _, _, reports in launch:
        posted = {r["rank"]: [[tuple(op) for op in group] for group in r["p2p_posted"]] for r in reports}
        assert nccl_order_completes(posted), where(job)
        assert any(len(group) == 2 for groups in posted.values() for group in groups), where(job)  # pairs


@pytest.mark.ranks
def test_zb_h1_holds_more_than_1f1b_under_full_recomputation(launch):
    """What deferring W costs: from its B to its W a micro-batch keeps every linear's input and output gradient,
    far more than a full-recompute micro-batch's checkpoints (stage 0 for one micro-batch at a time, stage s for
    up to s + 1), so every stage of ZB-H1 stores more than 1F1B's."""
    for job, _, _, _, reports in launch:
        if job.layout.schedule == "zb-h1" and job.policy == "full" and job.layout.tp == 1 and not job.layout.zero:
            for r in reports:
                B, T = job.input_ids.shape
                one_f = ChunkForms(job.cfg, B, T, "full",
                                   Layout(dp=job.layout.dp, pp=job.layout.pp, microbatches=job.layout.microbatches),
                                   r["stage"])
                assert r["peak_activation_bytes"] > one_f.peak_bytes, where(job, r)


def test_deferred_weight_grads_return_what_dw_reads():
    torch.manual_seed(0)
    dy, x, w = torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(5, 4)
    dx, dw = linear_backward(dy, x, w)
    with deferred_weight_grads():
        dx2, pending = linear_backward(dy, x, w)
    assert isinstance(pending, WeightGrad) and pending.output_grad is dy and pending.input is x
    assert torch.equal(dx, dx2) and torch.equal(weight_grad(*pending), dw)
    assert isinstance(linear_backward(dy, x, w)[1], torch.Tensor)  # outside: dW at once again


def test_interleaved_stage_zero_holds_the_most_micro_batch_chunks():
    """Korthikanti et al. 2022, sec. 4.2.3: rank 0 warms up with (P - 1) 2 + (V - 1) P forwards, one more in
    the steady state."""
    for P, M, V in ((2, 4, 2), (4, 8, 2), (2, 6, 3)):
        assert in_flight("interleaved", P, M, 0, V) == (P - 1) * 2 + (V - 1) * P + 1


def test_a_zb_h1_budget_plan_fits_although_waiting_w_bytes_exceed_the_room_it_plans_in():
    """Each frontier plan is priced with W's waiting bytes on top, more than the room it was planned in: the walk
    down the frontier must still step to a smaller room each time, and end at a plan within the budget."""
    cfg = Config(vocab=256, hidden=128, layers=8, heads=4, kv_heads=2, ffn=384, max_seq=128, dropout=0.1)
    params, (input_ids, targets) = init_params(cfg, seed=0), make_batch(cfg, 8, 64, "cpu", seed=0)
    job = ParallelJob(params, cfg, input_ids, targets, "every:2", Layout(pp=2, microbatches=8, schedule="zb-h1"))
    size = int(budget_for(job).split(":")[1])
    for stage in range(2):
        assert layer_forms(replace(job, policy=f"budget:{size}"), stage).peak_bytes <= size


@pytest.mark.parametrize("layout, message", [
    (dict(pp=2, microbatches=3, schedule="interleaved", virtual_stages=2), "multiple of 2"),
    (dict(pp=2, microbatches=4, schedule="interleaved", virtual_stages=3), "virtual_stages <= 4"),
    (dict(pp=2, microbatches=2, schedule="1f1b", virtual_stages=2), "schedule='interleaved'"),
    (dict(pp=2, microbatches=2, schedule="zb-h2"), "'zb-h1'"),
    (dict(pp=2, dp=2, microbatches=2, schedule="interleaved", virtual_stages=2, zero=1), "not supported yet"),
])
def test_a_schedule_it_cannot_run_is_refused_before_any_rank_starts(layout, message):
    cfg, params, input_ids, targets = model(4, 4)
    job = ParallelJob(params, cfg, input_ids, targets, "full", Layout(**layout))
    with pytest.raises(ValueError, match=message):
        checked_job(job, "cpu", job.world_size)


def test_zb_h1_refuses_a_mixture_of_experts():
    cfg = Config(**{**BASE, "dropout": 0.0}, layers=4, experts=4, experts_per_token=2)
    params, (input_ids, targets) = init_params(cfg, seed=1), make_batch(cfg, 4, SEQ, "cpu", seed=1)
    with pytest.raises(ValueError, match="zb-h1.*experts"):
        checked_job(ParallelJob(params, cfg, input_ids, targets, "full", Layout(pp=2, microbatches=2, schedule="zb-h1")),
                    "cpu", 2)

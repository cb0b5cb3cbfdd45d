"""Pipeline and data parallelism with recomputation, on 2 and 4 gloo ranks against the single-process
engine: the same loss and gradients (fp64 rel <= 1e-10, fp32 rel <= 1e-5) for P = 2 and 4, M in
{1, P, 2P+1}, both schedules, every policy, with dropout and ignored targets, combined with dp = 2 and
tp = 2; every stage's stored peak, stored bytes per micro-batch, FLOPs and point-to-point, tensor- and
data-parallel bytes equal their closed forms (picockpt/parallel/pp_forms.py); the stage-aware budget
fits every stage and recomputes no more than the best uniform policy that fits.

Each world size is one launch whose ranks run every job in turn (run_jobs); each job may
have its own layout (dp x pp x tp); the jobs are a covering set, not the whole cross product
(jobs_for). Relative error of a gradient: max |g - g_single| / max |g_single|.
"""
import itertools
import multiprocessing

import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import chain_sizes
from picockpt.measurement.measure import make_batch
from picockpt.parallel import Layout, ParallelJob, run_jobs
from picockpt.parallel.pipeline_parallel.pp_forms import ChunkForms, stage_chain, uniform_schedules
from picockpt.parallel.pipeline_parallel.pp_schedules import bubble_fraction, stage_layers, unequal_bubble
from picockpt.parallel.pipeline_parallel.pp_plan import end_of_forward_bytes
from picockpt.planning.planner import replay

from nccl_order import nccl_order_completes
from processes import no_process_left_behind  # noqa: F401 (a fixture)

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
SEQ = 8
MODELS = {  # L=4 for two stages, L=5 (split 2, 1, 1, 1) for four
    "fp64 dropout": dict(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, max_seq=64, dtype="float64",
                         dropout=0.1),
    "fp32 tied chunked": dict(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, max_seq=64, dtype="float32",
                              dropout=0.1, tie_embeddings=True, loss_chunk=5),
    "fp64 five layers": dict(vocab=64, hidden=32, layers=5, heads=4, kv_heads=2, ffn=64, max_seq=64, dtype="float64",
                             dropout=0.1),
}
POLICIES = ["none", "full", "every:2", "selective", "cheap", "every:2+selective", "budget"]
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}

pytestmark = pytest.mark.usefixtures("no_process_left_behind")


def model(name, batch):
    """A config, params and a batch whose targets leave some positions out of the loss (IGNORE_INDEX)."""
    cfg = Config(**MODELS[name])
    params = init_params(cfg, seed=1)
    input_ids, targets = make_batch(cfg, batch, SEQ, "cpu", seed=batch)
    targets = targets.clone()
    targets[0, :3] = -100
    if batch > 2:
        targets[1, :] = -100  # a sequence (a micro-batch, when b = 1) with no counted target
    return cfg, params, input_ids, targets


def budget(cfg, batch, pp, microbatches, schedule, dp=1):
    """budget:SIZE that every stage can meet but not by keeping everything: the largest stage's peak under
    'every:2', the uniform policy a user would try first."""
    B, peaks = batch, []
    for stage in range(pp):
        peaks.append(ChunkForms(cfg, B, SEQ, "every:2",
                                Layout(dp=dp, pp=pp, microbatches=microbatches, schedule=schedule), stage).peak_bytes)
    return f"budget:{max(peaks)}"


def relative(value, reference):
    return ((value.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


def jobs_for(world):
    """(label, ParallelJob, single-process (loss, grads, generator state after)) of every job of one launch."""
    out, single = [], {}

    def add(name, batch, policy, **layout):
        cfg, params, input_ids, targets = model(name, batch)
        torch.manual_seed(7)
        state = torch.get_rng_state()
        if (name, batch) not in single:
            loss, grads = loss_and_grads(params, cfg, input_ids, targets, "none")
            single[name, batch] = (loss, grads, torch.get_rng_state())
        if policy == "budget":
            policy = budget(cfg, batch, layout.get("pp", 1), layout["microbatches"], layout.get("schedule", "1f1b"),
                            layout.get("dp", 1))
        job = ParallelJob(params, cfg, input_ids, targets, policy, Layout(**layout), rng_state=state)
        out.append((name, job, single[name, batch]))

    rotating = itertools.cycle(["full", "every:2", "selective", "cheap", "every:2+selective"])
    if world == 2:
        # A covering set of the cross product (2 models x M in {1, 2, 5} x both schedules x 7 policies, 84 jobs).
        # fp64 dropout: every policy under AFAB (M = 2: w = M on both stages) and 1F1B (M = 5, the budget's rivals
        # below), and at every other (M, schedule) none (the in-flight closed form), budget (planned for its
        # micro-batches in flight) and one other policy in turn. fp32 tied chunked (the tied head's gradient summed
        # across the stages, the chunked loss, fp32): every policy at M = 2, 1F1B; none, budget and one other at
        # M = 5, AFAB; none and one other at M = 1.
        cases = [("fp64 dropout", M, schedule, POLICIES if (M, schedule) in ((2, "afab"), (5, "1f1b"))
                  else ["none", next(rotating), "budget"]) for M in (1, 2, 5) for schedule in ("afab", "1f1b")]
        cases += [("fp32 tied chunked", 1, "1f1b", ["none", next(rotating)]),
                  ("fp32 tied chunked", 2, "1f1b", POLICIES),
                  ("fp32 tied chunked", 5, "afab", ["none", next(rotating), "budget"])]
        for name, M, schedule, policies in cases:
            for policy in policies:
                add(name, 10, policy, pp=2, microbatches=M, schedule=schedule)
        for M in (1, 5):  # data parallel alone, with and without overlap
            for policy, overlap in (("full", True), ("every:2+selective", False), ("budget", True)):
                add("fp64 dropout", 10, policy, dp=2, microbatches=M, overlap=overlap)
        add("fp64 dropout", 10, "full", pp=2, microbatches=5, recompute_early=True)
        add("fp64 dropout", 10, "every:2", pp=2, microbatches=2, schedule="afab", recompute_early=True)
        add("fp64 dropout", 10, "full", tp=2, microbatches=2)  # gradient accumulation under tensor parallelism
        for rival in ("full+selective", "every:2+cheap", "full+cheap"):  # the budget's rivals, beside POLICIES above
            add("fp64 dropout", 10, rival, pp=2, microbatches=5)
    else:
        # A covering set of 3 M x both schedules x (4 or 7) policies (30 jobs): every policy under AFAB at M = P and
        # under 1F1B at M > P; at each other (M, schedule) none, budget and one of the other policies in turn.
        every_policy = {(4, "afab"), (9, "1f1b")}
        for M in (1, 4, 9):
            for schedule in ("afab", "1f1b"):
                for policy in (POLICIES if (M, schedule) in every_policy else ["none", next(rotating), "budget"]):
                    add("fp64 five layers", M, policy, pp=4, microbatches=M, schedule=schedule)
        add("fp64 five layers", 9, "full", pp=4, microbatches=9, recompute_early=True)
        # pp x dp: budget at every M (its plan per stage, on B / (dp M) rows), full and every:2+selective alternating
        for M, policies in ((1, ("full", "budget")), (2, ("every:2+selective", "budget")), (5, ("full", "budget"))):
            for policy in policies:
                add("fp64 dropout", 2 * M, policy, pp=2, dp=2, microbatches=M, schedule="1f1b" if M != 2 else "afab")
        add("fp32 tied chunked", 10, "full", pp=2, dp=2, microbatches=5, overlap=False)
        add("fp64 dropout", 4, "every:2", pp=2, tp=2, sp=True, microbatches=2)
        add("fp64 dropout", 4, "full", pp=2, tp=2, sp=False, microbatches=4, schedule="afab")
    return out


@pytest.fixture(scope="module", params=[2, 4])
def launch(request):
    world = request.param
    jobs = jobs_for(world)
    results = run_jobs([job for _, job, _ in jobs], world, start_method=START, timeout_s=120)
    runs = [(name, job, single, *result) for (name, job, single), result in zip(jobs, results)]
    return world, runs, torch.get_rng_state()


def where(job, report=None):
    layout = job.layout
    return (job.cfg.dtype, job.policy,
            f"pp={layout.pp} M={layout.microbatches} {layout.schedule} dp={layout.dp} tp={layout.tp}",
            None if report is None else f"rank {report['rank']} stage {report['stage']}")


@pytest.mark.ranks
def test_gradients_and_loss_equal_the_single_process_engine(launch):
    _, runs, _ = launch
    for name, job, (loss0, grads0, _), loss, grads, _ in runs:
        tolerance = TOLERANCE[job.cfg.dtype]
        assert abs(loss.item() - loss0.item()) <= tolerance * abs(loss0.item()), where(job)
        assert list(grads) == list(grads0)
        for key in grads0:
            assert grads[key].shape == grads0[key].shape and grads[key].dtype == grads0[key].dtype
            assert relative(grads[key], grads0[key]) <= tolerance, (where(job), key, relative(grads[key], grads0[key]))


@pytest.mark.ranks
def test_the_generator_is_left_where_the_single_process_leaves_it(launch):
    """The caller's generator after the launch is where the single process's step of its last job leaves it
    (dropout: the last stage's generator after its layers' masks)."""
    _, runs, after_launch = launch
    name, job, (_, _, after), *_ = runs[-1]
    assert job.cfg.dropout > 0 and not torch.equal(job.rng_state, after)  # the step drew masks
    assert torch.equal(after_launch, after), where(job)


@pytest.mark.ranks
def test_every_stage_stores_exactly_its_closed_form(launch):
    _, runs, _ = launch
    for _, job, _, _, _, reports in runs:
        assert sorted(r["rank"] for r in reports) == list(range(job.layout.dp * job.layout.pp * job.layout.tp))
        for r in reports:
            assert r["peak_activation_bytes"] == r["predicted_activation_bytes"], where(job, r)
            assert r["microbatch_stored_bytes"] == r["predicted_microbatch_stored_bytes"], where(job, r)
            assert r["flops"] == r["predicted_flops"], where(job, r)
            assert r["peak_live_bytes"] >= r["peak_activation_bytes"], where(job, r)


@pytest.mark.ranks
def test_the_closed_form_is_in_flight_copies_of_the_layer_inventory(launch):
    """Written from picockpt/planning/step_forms.py, not pp_forms.py: under 'none' a micro-batch of b sequences
    stores n A (+ F on the last stage), and a stage holds w of them, w = M (AFAB) or min(P - s, M) (1F1B)."""
    _, runs, _ = launch
    for _, job, _, _, _, reports in runs:
        if job.policy != "none" or job.layout.tp > 1:
            continue
        b = job.input_ids.shape[0] // (job.layout.dp * job.layout.microbatches)
        _, A, F = chain_sizes(job.cfg, b, SEQ)
        for r in reports:
            n = r["layers"][1] - r["layers"][0] + 1
            M = job.layout.microbatches
            w = M if job.layout.schedule == "afab" else min(job.layout.pp - r["stage"], M)
            assert r["microbatches_in_flight"] == w, where(job, r)
            held = n * A + (F if r["stage"] == job.layout.pp - 1 else 0)
            assert (r["microbatch_stored_bytes"], r["peak_activation_bytes"]) == (held, w * held), where(job, r)


@pytest.mark.ranks
def test_point_to_point_and_collective_bytes_equal_their_closed_forms(launch):
    _, runs, _ = launch
    for _, job, _, _, _, reports in runs:
        for r in reports:
            assert r["p2p_bytes"] == r["predicted_p2p_bytes"], where(job, r)
            assert r["comm_bytes"] == r["predicted_comm_bytes"], where(job, r)
            assert r["dp_bytes"] == r["predicted_dp_bytes"], where(job, r)
            if job.layout.pp > 1 and r["stage"] > 0:  # one micro-batch's activation per receive, M of them
                S = job.input_ids.shape[0] // (job.layout.dp * job.layout.microbatches) * SEQ * job.cfg.hidden // (
                    job.layout.tp if job.layout.sp and job.layout.tp > 1 else 1) * \
                    torch.empty((), dtype=job.cfg.torch_dtype).element_size()
                assert r["p2p_bytes"]["forward"]["receive"] == job.layout.microbatches * S, where(job, r)


def test_the_nccl_order_checker_finds_the_one_by_one_deadlock():  # the test below can fail
    one_by_one = {0: [[("send", 1)], [("send", 1)], [("recv", 1)], [("recv", 1)]],  # 1F1B, sends posted alone
                  1: [[("recv", 0)], [("send", 0)], [("recv", 0)], [("send", 0)]]}
    paired = {0: [[("send", 1)], [("send", 1), ("recv", 1)], [("recv", 1)]],
              1: [[("recv", 0)], [("send", 0), ("recv", 0)], [("send", 0)]]}
    assert not nccl_order_completes(one_by_one) and nccl_order_completes(paired)


@pytest.mark.ranks
def test_every_schedule_posts_its_sends_and_receives_in_an_order_nccl_completes(launch):
    _, runs, _ = launch
    for _, job, _, _, _, reports in runs:
        posted = {r["rank"]: [[tuple(op) for op in group] for group in r["p2p_posted"]] for r in reports}
        assert nccl_order_completes(posted), where(job)
        pp, M = job.layout.pp, job.layout.microbatches
        if pp > 1 and job.layout.schedule == "1f1b" and M > pp:  # the steady state pairs sends
            assert any(len(group) == 2 for groups in posted.values() for group in groups), where(job)


@pytest.mark.ranks
def test_recompute_early_changes_neither_results_nor_the_stored_peak(launch):
    _, runs, _ = launch
    plain = {(name, job.policy, job.layout.pp, job.layout.microbatches, job.layout.schedule): (grads, reports)
             for name, job, _, _, grads, reports in runs
             if not job.layout.recompute_early and job.layout.dp == job.layout.tp == 1}
    early = [(name, job, grads, reports) for name, job, _, _, grads, reports in runs if job.layout.recompute_early]
    assert early
    for name, job, grads, reports in early:
        grads0, reports0 = plain[name, job.policy, job.layout.pp, job.layout.microbatches, job.layout.schedule]
        for key in grads0:
            assert torch.equal(grads[key], grads0[key]), (where(job), key)
        for r, r0 in zip(sorted(reports, key=lambda r: r["rank"]), sorted(reports0, key=lambda r: r["rank"])):
            assert r["peak_activation_bytes"] == r0["peak_activation_bytes"], where(job, r)
            assert r["flops"] == r0["flops"], where(job, r)  # the same recomputation, done earlier


@pytest.mark.ranks
def test_timeline_totals_add_up_and_every_micro_batch_runs_each_phase(launch):
    _, runs, _ = launch
    for _, job, _, _, _, reports in runs:
        for r in reports:
            seconds = r["timeline_seconds"]
            kinds = ("forward", "recompute", "backward", "wait", "send", "reduce", "idle")
            parts = sum(seconds[kind] for kind in kinds)
            assert parts == pytest.approx(seconds["total"], rel=1e-9), where(job, r)
            forwards = {m for kind, m, _, _ in r["timeline"] if kind == "forward"}
            backwards = {m for kind, m, _, _ in r["timeline"] if kind == "backward"}
            assert forwards == backwards == set(range(job.layout.microbatches)), where(job, r)
            P, M = job.layout.pp, job.layout.microbatches
            assert 0 <= r["bubble"] < 1 and r["predicted_bubble"] == (P - 1) / (M + P - 1)


@pytest.mark.ranks
def test_stage_aware_budget_fits_every_stage_and_recomputes_no_more_than_the_best_uniform_policy(launch):
    world, runs, _ = launch
    if world != 2:
        pytest.skip("the rivals run on two ranks")
    rivals = {}
    for name, job, _, _, _, reports in runs:
        layout = job.layout
        if (layout.pp, layout.microbatches, layout.schedule, name) == (2, 5, "1f1b", "fp64 dropout") \
                and not layout.recompute_early:
            rivals[job.policy] = reports
    budgets = [policy for policy in rivals if policy.startswith("budget:")]
    assert budgets
    for policy in budgets:
        size = int(policy.split(":")[1])
        planned = rivals[policy]
        assert all(r["peak_activation_bytes"] <= size for r in planned), [r["peak_activation_bytes"] for r in planned]
        fitting = [sum(r["flops"]["recompute"] for r in reports) for name, reports in rivals.items()
                   if not name.startswith("budget:") and all(r["peak_activation_bytes"] <= size for r in reports)]
        assert fitting, policy
        assert sum(r["flops"]["recompute"] for r in planned) <= min(fitting), (policy, fitting)


def test_uniform_schedules_are_what_the_policies_run():
    """The budget planner's uniform rivals (pp_forms.uniform_schedules) have the bytes and FLOPs of the
    policies of the same names on the same stage."""
    cfg = Config(**MODELS["fp64 dropout"])
    chain = stage_chain(cfg, 2, SEQ, 2, True)
    named = dict(uniform_schedules(chain))
    for policy in ("none", "selective", "cheap", "full", "every:2", "full+selective"):
        forms = ChunkForms(cfg, 2, SEQ, policy, Layout(pp=2), 1)
        rival_chain = stage_chain(cfg, 2, SEQ, 2, True, unstored=forms.policy.unstored)
        expected = (end_of_forward_bytes(rival_chain, forms.local_schedule), *replay(rival_chain, forms.local_schedule))
        mine = named[policy]
        assert (end_of_forward_bytes(chain, mine), *replay(chain, mine)) == expected, policy
    assert [len(layers) for layers in stage_layers(5, 4)] == [2, 1, 1, 1]


def test_the_paced_bubble_is_narayanans_with_equal_stages_and_the_slowest_stage_sets_the_pace():
    for stages, microbatches in ((2, 1), (2, 4), (4, 8), (8, 3)):
        for bubble in unequal_bubble([3.0] * stages, microbatches):
            assert bubble == pytest.approx(bubble_fraction(stages, microbatches), abs=1e-12)
    # P = 2, M = 4, stage 1 twice as slow per micro-batch (1 s vs 2 s): the step is 1 + 2 + 3 * 2 = 9 s,
    # stage 0 computes 4 of them, stage 1 computes 8, and the slow stage idles less than the formula says
    assert unequal_bubble([4.0, 8.0], 4) == pytest.approx([5 / 9, 1 / 9], abs=1e-12)

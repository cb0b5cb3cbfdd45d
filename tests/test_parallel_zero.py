"""ZeRO stages 1/2/3 with recomputation, on 2 and 4 gloo ranks against the single-process engine: the same
loss and gradients (fp32 rel <= 1e-5), every policy bitwise equal to none within a stage, every rank's
parameter, gradient, optimizer, activation and gathered bytes and its all-gathers / reduce-scatters per
phase equal to their closed forms (picockpt/parallel/data_parallel/zero_forms.py), keep_gathered's
one gather fewer per recomputed layer, AdamW on the shards equal to the single process's after 3 steps,
training on a new batch each step (zero_train) equal to picockpt/measurement/train.py's, and torch's FSDP2 beside it.

One launch of 2 ranks runs every dp=2 job and the training runs in turn (parallel.step.run_collected: the one rank
step of every layout, rank.py), one of 4 ranks the dp=4 jobs; one launch of 2 ranks runs torch's FSDP2, both nestings of
checkpoint and FSDP unit. hidden=30, vocab=65, ffn=25: units of 1950, 4710 and 1980 elements, so at dp=4
the embedding and every layer are padded and shards cut through parameters. Relative error:
max |g - g_single| / max |g_single| over the tensor.
"""
import functools
import multiprocessing

import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import predicted_peak_bytes
from picockpt.measurement.measure import make_batch
from picockpt.ops.cross_entropy import IGNORE_INDEX
from picockpt.model.params import param_shapes
from picockpt.parallel import Layout, ParallelJob, run_ranks
from picockpt.parallel.data_parallel.fsdp_peer import fsdp2_rank_step, fsdp2_rank_steps
from picockpt.parallel.data_parallel.dp_check import check_zero
from picockpt.parallel.data_parallel.zero_forms import zero_paper_bytes
from picockpt.parallel.pipeline_parallel.pp_forms import ChunkForms
from picockpt.parallel.report_forms import zero_stage_forms
from picockpt.parallel.step import run_collected
from picockpt.measurement.train import MarkovTask, make_optimizer, train_step

from processes import no_process_left_behind  # noqa: F401 (a fixture)

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
BATCH, SEQ, STEPS = 4, 8, 3
BASE = dict(vocab=65, hidden=30, layers=3, heads=3, kv_heads=1, ffn=25, max_seq=64)
MODELS = {"fp32 ignored targets": {}, "dropout": dict(dropout=0.1)}
POLICIES = ["none", "full", "every:2", "selective", "budget"]
pytestmark = pytest.mark.usefixtures("no_process_left_behind", "one_thread")  # conftest.py: one torch thread


def model(name):
    cfg = Config(**BASE, **MODELS[name])
    params = init_params(cfg, seed=1)
    input_ids, targets = make_batch(cfg, BATCH, SEQ, "cpu", seed=1)
    if name == "fp32 ignored targets":  # unequal shares: rank 0 of 2 counts 11 targets, rank 1 16
        targets = targets.clone()
        targets[0, 3:] = -100
    return cfg, params, input_ids, targets


def budget(cfg, dp):
    """A budget between full and none for the rank's rows: the planner recomputes some layers, not all."""
    full, none = (predicted_peak_bytes(cfg, BATCH // dp, SEQ, p) for p in ("full", "none"))
    return f"budget:{int(full + 0.3 * (none - full))}"


def job(name, policy, zero, dp, keep=False, prefetch=True, steps=1):
    cfg, params, input_ids, targets = model(name)
    return ParallelJob(params, cfg, input_ids, targets, budget(cfg, dp) if policy == "budget" else policy,
                       Layout(dp=dp, zero=zero, keep_gathered=keep, prefetch=prefetch),
                       rng_state=torch.manual_seed(7).get_state(), lr=3e-3, weight_decay=0.1, steps=steps)


def name_of(j):
    return "dropout" if j.cfg.dropout else "fp32 ignored targets"


def jobs_for(dp):
    if dp == 4:
        return [job("fp32 ignored targets", p, z, 4, keep) for z, p, keep in
                ((1, "none", False), (2, "every:2", False), (3, "full", False), (3, "full", True), (3, "budget", True))]
    recomputes = lambda z, p: z == 3 and p != "none"  # noqa: E731  keep_gathered keeps what a recompute gathers
    jobs = [job("fp32 ignored targets", p, z, 2, keep) for z in (1, 2, 3) for p in POLICIES
            for keep in ((False, True) if recomputes(z, p) else (False,))]
    jobs += [job("fp32 ignored targets", p, 3, 2, keep, prefetch=False) for p in ("none", "full", "every:2")
             for keep in ((False, True) if recomputes(3, p) else (False,))]
    jobs += [job("dropout", p, z, 2) for z, p in ((1, "none"), (3, "none"), (3, "every:2"))]
    jobs += [job("fp32 ignored targets", "full", z, 2, keep=z == 3, steps=STEPS) for z in (1, 2, 3)]
    return jobs


@functools.lru_cache(maxsize=None)
def single(name, steps):
    """The single process on the whole batch: loss and gradients of the first step, params after `steps`
    (picockpt/measurement/train.py's AdamW), and where its generator is then. The same for every job of a model."""
    j = job(name, "none", 1, 2, steps=steps)
    torch.set_rng_state(j.rng_state)
    loss, grads = loss_and_grads(j.params, j.cfg, j.input_ids, j.targets, "none")
    params = {name: tensor.clone() for name, tensor in j.params.items()}
    torch.set_rng_state(j.rng_state)
    optimizer = make_optimizer(params, j.lr, j.weight_decay)
    for _ in range(steps):
        train_step(params, optimizer, j.cfg, j.input_ids, j.targets, "none")
    return loss, grads, params, torch.get_rng_state()


FSDP2_CFG = dict(BASE, hidden=32, heads=4, kv_heads=2, vocab=64, ffn=24)  # every dim even: no padding at dp=2
FSDP2_VARIANTS = [(None, True), (None, False), (True, True), (False, True),  # (reshard_after_forward, checkpoint
                  (None, True, "ac(fsdp(layer))")]                            # [, nesting]): torchtitan's by default


TRAINING = [(1, "none", False), (2, "none", False), (3, "none", False), (3, "full", True)]  # zero, policy, keep


def training_jobs():
    """zero_train's runs (dp=2, 3 steps): MarkovTask batches, a new one each step, with dropout (the
    masks of every step the single process's); step 1 counts 3 targets of its first row: unequal shares."""
    cfg = Config(**BASE, dropout=0.1, dtype="float64")  # fp64: why, in the test below
    task = MarkovTask(cfg.vocab, seed=3)
    batches = [task.batch(BATCH, SEQ) for _ in range(STEPS)]
    targets = batches[1][1].clone()  # (ids and targets are views of one stream)
    targets[0, 3:] = IGNORE_INDEX
    batches[1] = (batches[1][0], targets)
    params = init_params(cfg, seed=1)
    return [ParallelJob(params, cfg, *batches[0], policy, Layout(dp=2, zero=zero, keep_gathered=keep), batches=batches,
                        lr=3e-3, weight_decay=0.1, rng_state=torch.manual_seed(7).get_state())
            for zero, policy, keep in TRAINING]


@pytest.fixture(scope="module")
def launched():
    """Two launches: 2 ranks run the dp=2 jobs and the training runs, 4 ranks the dp=4 jobs."""
    jobs, train_jobs = {dp: jobs_for(dp) for dp in (2, 4)}, training_jobs()
    pair = run_collected(jobs[2] + train_jobs, start_method=START, timeout_s=120)
    four = run_collected(jobs[4], start_method=START, timeout_s=120)
    out = {"train": list(zip(train_jobs, pair[len(jobs[2]):]))}
    for dp, runs in ((2, pair[:len(jobs[2])]), (4, four)):
        out[dp] = [(j, run["loss"], run["grads"], run["params"], run["reports"], run["rng_state"])
                   for j, run in zip(jobs[dp], runs)]
    return out


@pytest.fixture(scope="module")
def fsdp2_launched():
    """torch's FSDP2 on the reference model, every variant of FSDP2_VARIANTS, one launch of 2 ranks."""
    cfg = Config(**FSDP2_CFG)
    params, (input_ids, targets) = init_params(cfg, seed=1), make_batch(cfg, BATCH, SEQ, "cpu", seed=1)
    results = run_ranks(fsdp2_rank_steps, 2, params, cfg, input_ids, targets, FSDP2_VARIANTS, start_method=START,
                        timeout_s=120)
    return cfg, params, input_ids, targets, results[0]


@pytest.fixture(params=[2, 4], ids=["dp2", "dp4"])
def launch(request, launched):
    return request.param, launched[request.param]


def zero_comm_bytes(cfg, policy, keep=False):
    """ZeRO-3's collectives per phase on one of 2 ranks (predictions.zero_stage_forms on the one stage's rank)."""
    layout = Layout(dp=2, zero=3, keep_gathered=keep)
    return zero_stage_forms(cfg, ChunkForms(cfg, BATCH, SEQ, policy, layout, 0), layout, steps=0)["zero_bytes_by_kind"]


def relative(value, reference):
    scale = reference.double().abs().max().item()
    return (value.double() - reference.double()).abs().max().item() / (scale or 1.0)


@pytest.mark.ranks
def test_loss_gradients_and_updated_parameters_equal_the_single_process(launch):
    _, runs = launch
    for j, loss, grads, params, _, rng_state in runs:
        where = (name_of(j), j.layout.zero, j.policy, j.layout.keep_gathered, j.layout.prefetch, j.steps)
        loss0, grads0, params0, rng_state0 = single(name_of(j), j.steps)
        if j.steps == 1:  # the first step's (later ones start from parameters updated a little differently)
            assert abs(loss.item() - loss0.item()) <= 1e-5 * abs(loss0.item()), where
            assert set(grads) == set(grads0)
            for name in grads0:
                assert grads[name].shape == grads0[name].shape, (where, name)
                assert relative(grads[name], grads0[name]) <= 1e-5, (where, name, relative(grads[name], grads0[name]))
        for name in params0 if params is not None else ():
            assert relative(params[name], params0[name]) <= 1e-5, (where, name, relative(params[name], params0[name]))
        assert torch.equal(rng_state, rng_state0), where  # the generator left where the single process leaves it


@pytest.mark.ranks
def test_every_policy_keep_and_prefetch_is_bitwise_equal_to_none_within_a_stage(launch):
    _, runs = launch
    none = {(name_of(j), j.layout.zero): (loss, grads, params) for j, loss, grads, params, *_ in runs
            if j.policy == "none" and j.steps == 1}
    for j, loss, grads, params, *_ in runs:
        if j.steps != 1 or (name_of(j), j.layout.zero) not in none:
            continue
        loss0, grads0, params0 = none[(name_of(j), j.layout.zero)]
        where = (name_of(j), j.layout.zero, j.policy, j.layout.keep_gathered, j.layout.prefetch)
        assert torch.equal(loss, loss0), where
        for name in grads0:
            assert torch.equal(grads[name], grads0[name]), (where, name)
            assert torch.equal(params[name], params0[name]), (where, name)


@pytest.mark.ranks
def test_model_state_and_activations_per_rank_equal_their_closed_forms(launch):
    dp, runs = launch
    for j, *_, reports, _ in runs:
        for r in reports:
            where = (name_of(j), j.layout.zero, j.policy, j.layout.keep_gathered, r["rank"])
            for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "gathered_peak_bytes"):
                assert r[key] == r[f"predicted_{key}"], (where, key, r[key], r[f"predicted_{key}"])
            assert r["peak_activation_bytes"] == r["predicted_activation_bytes"], where
            assert r["peak_activation_bytes"] == predicted_peak_bytes(j.cfg, BATCH // dp, SEQ, j.policy), where
    # written from the shapes, not from zero_forms: fp32, 4 bytes an element, units padded to dp
    cfg = runs[0][0].cfg
    units = [cfg.vocab * cfg.hidden] + [sum(torch.Size(s).numel() for n, s in param_shapes(cfg).items()
                                            if n.startswith(f"model.layers.{k}."))
                                        for k in range(cfg.layers)] + [cfg.hidden + cfg.vocab * cfg.hidden]
    shards = sum(-(-n // dp) for n in units)
    for j, *_, reports, _ in runs:
        r = reports[0]
        assert r["param_bytes"] == 4 * (shards if j.layout.zero == 3 else shards * dp)
        assert r["grad_bytes"] == 4 * (shards if j.layout.zero >= 2 else shards * dp)
        assert r["optimizer_bytes"] == 4 * 2 * shards + 4 * len(units)  # exp_avg, exp_avg_sq, one step each


@pytest.mark.ranks
def test_communication_per_phase_equals_its_closed_form(launch):
    _, runs = launch
    for j, *_, reports, _ in runs:
        for r in reports:
            where = (name_of(j), j.layout.zero, j.policy, j.layout.keep_gathered, j.layout.prefetch, r["rank"])
            assert r["zero_bytes_by_kind"] == r["predicted_zero_bytes_by_kind"], where
            assert r["dp_bytes"] == r["predicted_dp_bytes"], where


@pytest.mark.ranks
def test_stage_3_recompute_gathers_each_layer_once_and_keep_gathered_saves_the_backward_gather(launch):
    """From the shapes alone: under full, the recompute phase gathers every layer once and the backward
    gathers each again; with keep_gathered the backward gathers none, one gather fewer per layer in total.
    Without prefetch, keep_gathered holds a whole sweep: every:2 holds 2 layers where it held 1."""
    dp, runs = launch
    cfg = runs[0][0].cfg
    layer = 4 * dp * -(-sum(torch.Size(s).numel() for n, s in param_shapes(cfg).items()
                            if n.startswith("model.layers.0.")) // dp)  # one layer's gathered fp32 bytes
    found = {}
    for j, *_, reports, _ in runs:
        if j.layout.zero == 3 and name_of(j) == "fp32 ignored targets" and j.steps == 1:
            found[(j.policy, j.layout.keep_gathered, j.layout.prefetch)] = reports[0]
    for prefetch in (True, False) if dp == 2 else (True,):
        plain, kept = found[("full", False, prefetch)], found[("full", True, prefetch)]
        assert plain["zero_bytes_by_kind"]["recompute"] == {"all_gather": cfg.layers * layer}
        assert kept["zero_bytes_by_kind"]["recompute"] == {"all_gather": cfg.layers * layer}
        assert plain["zero_bytes_by_kind"]["backward"]["all_gather"] == cfg.layers * layer
        assert "all_gather" not in kept["zero_bytes_by_kind"]["backward"]
        assert plain["dp_bytes"] - kept["dp_bytes"] == cfg.layers * layer
        assert plain["zero_calls_by_kind"]["backward"]["all_gather"] == cfg.layers
    if dp == 2:
        plain, kept = found[("every:2", False, False)], found[("every:2", True, False)]
        assert plain["gathered_peak_bytes"]["recompute"] == layer
        assert kept["gathered_peak_bytes"]["recompute"] == 2 * layer  # the sweep's 2 layers, held at once
        assert found[("full", True, False)]["gathered_peak_bytes"] == found[("full", False, False)][
            "gathered_peak_bytes"]  # a sweep of one layer: held no longer than the backward needs it


def test_the_zero_papers_example_and_what_stage_3_moves():
    gb = {stage: round(n / 1e9, 1) for stage, n in zero_paper_bytes(7.5e9, K=12, N_d=64).items()}
    assert gb == {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    cfg = Config(**BASE)
    none, full = (zero_comm_bytes(cfg, p) for p in ("none", "full"))
    assert "all_gather" not in none["recompute"] and full["recompute"]["all_gather"] == full["backward"]["all_gather"]


def test_clear_errors_before_any_rank_starts():
    cfg = Config(**BASE)
    for kwargs, words in ((dict(zero=3, dp=1), "nothing to shard"), (dict(zero=0, dp=2), "stages are 1"),
                          (dict(zero=4, dp=2), "stages are 1"), (dict(zero=True, dp=2), "stages are 1"),
                          (dict(zero=2, dp=2, keep_gathered=True), "only stage 3 gathers"),
                          (dict(zero=3, dp=2, prefetch="yes"), "prefetch='yes'"),
                          (dict(zero=3, dp=3), "batch=4 is not divisible by dp=3"),
                          (dict(zero=3, dp=2, cfg=cfg.replace(dtype="bf16")), "mixed precision"),
                          (dict(zero=1, dp=2, cfg=cfg.replace(tie_embeddings=True)), "tie_embeddings")):
        args = {"cfg": cfg, "batch": BATCH, **kwargs}
        with pytest.raises(ValueError, match=words):
            check_zero(args.pop("zero"), args.pop("dp"), args.pop("cfg"), args.pop("batch"), **args)


@pytest.mark.ranks
def test_fsdp2_gathers_beside_picockpts(fsdp2_launched):
    """torch's FSDP2 on the reference model at dp=2 (no dim padded, so the bytes compare), both nestings of
    checkpoint and FSDP unit: forward every unit once; backward every layer again with its default
    reshard_after_forward (the root kept), and the checkpoint adds no gather (its recompute shares the
    backward's): picockpt's full + keep_gathered. torchtitan's fsdp(ac(layer)) recomputes without running the
    unit's forward (FSDP's hooks); ac(fsdp(layer)) runs it in every recompute; either finds the layer gathered."""
    cfg, params, input_ids, targets, (default, plain, always, never, outside) = fsdp2_launched
    ours, ours_plain = (zero_comm_bytes(cfg, "full", keep) for keep in (True, False))
    L = cfg.layers
    for nesting, run in (("fsdp(ac(layer))", default), ("ac(fsdp(layer))", outside)):
        assert (run["forward"]["calls"], run["forward"]["bytes"]) == (1 + L, ours["forward"]["all_gather"]), nesting
        assert (run["backward"]["calls"], run["backward"]["bytes"]) == (L, ours["recompute"]["all_gather"]), nesting
        assert run["backward"]["recomputes"] == run["backward"]["recomputes_found_gathered"] == L, nesting
        assert run["forward"]["unit_forwards"] == L and run["forward"]["recomputes"] == 0, nesting
    assert default["backward"]["unit_forwards"] == 0 and outside["backward"]["unit_forwards"] == L
    assert (plain["backward"]["calls"], plain["backward"]["recomputes"]) == (L, 0)  # no checkpoint: no recompute
    assert "all_gather" not in ours["backward"]
    assert ours_plain["backward"]["all_gather"] == default["backward"]["bytes"]  # picockpt's third gather
    gathers = lambda run, phase: (run[phase]["calls"], run[phase]["bytes"])  # noqa: E731
    assert gathers(always, "backward") == gathers(always, "forward") and gathers(never, "backward") == (0, 0)
    _, grads0 = loss_and_grads(params, cfg, input_ids, targets, "none")
    for run in (default, outside):
        for name in grads0:
            assert relative(run["grads"][name], grads0[name]) <= 1e-5, name
    with pytest.raises(ValueError, match="nesting='fsdp_outside' is unknown: use 'fsdp\\(ac\\(layer\\)\\)'"):
        fsdp2_rank_step(None, params, cfg, input_ids, targets, None, True, "fsdp_outside")


@pytest.mark.ranks
def test_training_with_zero_equals_training_in_one_process(launched):
    """zero_train's runs (stages 1, 2, 3; full with keep_gathered under 3; dropout; a new batch each step) against
    picockpt/measurement/train.py's train_step and make_optimizer on the same batches, lr and weight decay, from the same
    generator state: every step's loss and the parameters after 3 steps within fp64 rel 1e-10 (measured: the
    parameters 2.1e-15, the losses 2.1e-16), the last step's model state and bytes moved equal to their closed forms.
    Not bitwise: a rank's gradient is the sum over its B/2 rows, scaled by its share of the counted targets,
    and the collective adds the two ranks' (a + b), where the single process sums all B rows in one reduction;
    the loss, likewise, is the ranks' shares added. No gradient tensor is bitwise; of the parameters only norm
    weights are (here 6 of the 7: near 1, where one ulp is larger than the updates' differences). AdamW is not a
    cause: on a flat shard it is elementwise (foreach=False), the same bits per element as per tensor given the
    same gradients. Bitwise: the four runs to each other (at dp=2 every element of a reduced gradient is one
    addition, whichever collective makes it, and a recomputed forward repeats the same operations on the same
    inputs and masks).
    Why fp64: AdamW divides each gradient element by the root of its own running square, so an element whose
    gradient is near zero steps by a sizeable part of lr in the direction its last bits say. In fp32 these runs
    agree to 2.2e-6 (losses 1.1e-7), but the `small` preset at batch 4 x 64 differs by 7.2e-3 after 3 steps (one
    embedding row whose gradient is -1.5e-9 in one process): fp32 1e-5 would hold by luck of the data."""
    runs = launched["train"]
    job = runs[0][0]
    params0 = {name: tensor.clone() for name, tensor in job.params.items()}
    optimizer = make_optimizer(params0, job.lr, job.weight_decay)
    torch.set_rng_state(job.rng_state)
    losses0 = [train_step(params0, optimizer, job.cfg, ids, targets, "none") for ids, targets in job.batches]
    for job, run in runs:
        losses, params, reports = run["losses"], run["params"], run["reports"]
        where = (job.layout.zero, job.policy, job.layout.keep_gathered)
        assert len(losses) == STEPS and all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(losses, losses0)), where
        for name in params0:
            assert relative(params[name], params0[name]) <= 1e-10, (where, name, relative(params[name], params0[name]))
            assert torch.equal(params[name], runs[0][1]["params"][name]), (where, name)
        for r in reports:
            assert len(r["seconds_per_step"]) == STEPS, where
            for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "zero_bytes_by_kind", "gathered_peak_bytes"):
                assert r[key] == r[f"predicted_{key}"], (where, key)
            assert r["peak_activation_bytes"] == r["predicted_activation_bytes"], where


@pytest.mark.ranks
def test_stages_are_bitwise_equal_to_each_other_at_dp_2(launched):
    """At dp=2 every element of a reduced gradient is one addition, a + b, whichever collective makes it
    (all-reduce under stage 1, reduce-scatter under 2 and 3): the same bits, and AdamW on shards is elementwise,
    so 3 steps of training end in the same parameters. (Against the single process they differ in the last
    bits: the batch's two halves are summed apart, then added.)"""
    trained = {j.layout.zero: params for j, _, _, params, *_ in launched[2] if j.steps == STEPS}
    none = {j.layout.zero: grads for j, _, grads, *_ in launched[2] if j.steps == 1 and j.policy == "none"
            and name_of(j) == "fp32 ignored targets" and j.layout.prefetch}
    for zero in (2, 3):
        for name in trained[1]:
            assert torch.equal(trained[zero][name], trained[1][name]), (zero, name)
            assert torch.equal(none[zero][name], none[1][name]), (zero, name)

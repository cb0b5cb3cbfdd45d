"""The dimensions stacked in the one rank step (picockpt/parallel/rank.py): ZeRO 1/2/3 under tensor (with sequence
parallelism), pipeline, context and expert parallelism, and triples (zero3 x cp x tp, zero3 x tp x pp), each against
the single process (loss, every gradient, and after one AdamW step on the shards the updated parameters) with
unequal shares of the mean (ignored targets), every rank's activation, layer-collective, point-to-point,
data-parallel, parameter, gradient, optimizer and gathered bytes equal to their closed forms.

Experts beside tensor parallelism: attention, the dense weights and the head split over tp, each expert split over
ep and its f over tp as well (Megatron's expert tensor parallelism, by default the tp size), the router whole.

One launch of 4 ranks runs every 4-rank job in turn; one launch of 8 ranks the 8-rank ones.
"""
import functools
import multiprocessing

import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.measurement.measure import make_batch
from picockpt.parallel import ParallelJob
from picockpt.model.params import EMBED
from picockpt.parallel.step import run_collected
from picockpt.parallel.tensor_parallel.tp_shard import shard_params
from picockpt.measurement.train import make_optimizer, train_step

from processes import no_process_left_behind  # noqa: F401 (a fixture)
from picockpt.parallel import Layout

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
BATCH, SEQ = 8, 8
BASE = dict(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=24, max_seq=64, dtype="float64")  # why: below
MODELS = {"dense": {}, "tiled": dict(attention="tiled"), "moe": dict(experts=4, experts_per_token=2),
          "moe shared": dict(experts=4, experts_per_token=2, shared_expert_ffn=8, dropout=0.1)}
# (model, policy, layout): every ZeRO stage beside each dimension, two triples
FOUR = [("dense", "none", dict(zero=1, dp=2, tp=2, sp=True)),
        ("dense", "full", dict(zero=2, dp=2, tp=2, sp=True)),
        ("dense", "every:2", dict(zero=3, dp=2, tp=2, sp=False, keep_gathered=True)),
        ("dense", "full", dict(zero=1, dp=2, pp=2, microbatches=2)),
        ("dense", "every:2", dict(zero=3, dp=2, pp=2, microbatches=2, schedule="afab")),
        ("dense", "full", dict(zero=3, dp=2, pp=2, microbatches=2, keep_gathered="step")),
        ("tiled", "full", dict(zero=2, dp=2, cp=2)),
        ("tiled", "full", dict(zero=3, dp=1, cp=2, tp=2)),  # sharded over the cp ranks alone (dp_shard_cp)
        ("moe", "none", dict(zero=1, dp=2, ep=2)),
        ("moe", "full", dict(zero=3, dp=2, ep=2)),
        ("moe", "every:2", dict(ep=2, tp=2, sp=True)),  # experts beside tp: each expert's f split over tp too
        ("moe shared", "full", dict(ep=2, tp=2, sp=False, pp=1))]
EIGHT = [("dense", "full", dict(zero=3, dp=2, tp=2, pp=2, microbatches=2)),
         ("moe", "full", dict(dp=2, ep=2, tp=2, sp=True)),
         ("moe", "every:2", dict(zero=2, ep=2, tp=2, pp=2, microbatches=2))]
KEYS = ("dp_bytes", "comm_bytes", "p2p_bytes", "layer_stored_bytes", "microbatch_stored_bytes", "head_stored_bytes",
        "flops")
ZERO_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "gathered_peak_bytes", "zero_bytes_by_kind")
EXPERT_KEYS = ("received_rows", "all_to_all_sent_bytes")
pytestmark = pytest.mark.usefixtures("no_process_left_behind", "one_thread")  # conftest.py: one torch thread


def model(name):
    cfg = Config(**BASE, **MODELS[name])
    params = init_params(cfg, seed=1)
    input_ids, targets = make_batch(cfg, BATCH, SEQ, "cpu", seed=2)
    targets = targets.clone()
    targets[0, 3:] = -100  # the first replica's first micro-batch counts fewer targets: unequal shares
    targets[5, :6] = -100
    return cfg, params, input_ids, targets


def job(name, policy, layout):
    cfg, params, input_ids, targets = model(name)
    steps = int(bool(layout.get("zero")))  # one AdamW step on the shards (ZeRO's)
    return ParallelJob(params, cfg, input_ids, targets, policy, Layout(**layout), steps=steps, lr=3e-3,
                       weight_decay=0.1, rng_state=torch.manual_seed(7).get_state())


@functools.lru_cache(maxsize=None)
def single(name):
    """The single process: loss and gradients, and the parameters after one AdamW step."""
    cfg, params, input_ids, targets = model(name)
    torch.manual_seed(7)  # the jobs' generator state: the same dropout masks
    loss, grads = loss_and_grads(params, cfg, input_ids, targets, "none")
    trained = {key: tensor.clone() for key, tensor in params.items()}
    torch.manual_seed(7)
    train_step(trained, make_optimizer(trained, 3e-3, 0.1), cfg, input_ids, targets, "none")
    return loss, grads, trained


TRAINING = dict(zero=3, dp=2, tp=2, sp=True)  # zero_train's job on a stacked layout: a new batch each step


def training_batches(cfg):
    return [make_batch(cfg, BATCH, SEQ, "cpu", seed=seed) for seed in (3, 4)]


@pytest.fixture(scope="module")
def launched():
    out = []
    for world, cases in ((4, FOUR), (8, EIGHT)):
        jobs = [job(*case) for case in cases]
        if world == 4:  # and the training run, in the same launch
            cfg, params, *_ = model("dense")
            batches = training_batches(cfg)
            jobs.append(ParallelJob(params, cfg, *batches[0], "full", Layout(**TRAINING), batches=batches, lr=3e-3,
                                    weight_decay=0.1, rng_state=torch.manual_seed(7).get_state()))
        runs = run_collected(jobs, start_method=START, timeout_s=180)
        out += list(zip(cases, runs))
        if world == 4:
            out.append((("training", "full", TRAINING), runs[-1]))
    return out


@pytest.mark.ranks
def test_training_a_stacked_layout_equals_training_in_one_process(launched):
    """zero_train's job (ParallelJob with batches: one AdamW step on each) on ZeRO-3 x tp x sp: every step's loss
    and the parameters after 2 steps as picockpt/measurement/train.py's train_step reaches them (fp64, rel 1e-10)."""
    run = dict((case[0], run) for case, run in launched)["training"]
    cfg, params, *_ = model("dense")
    trained = {key: tensor.clone() for key, tensor in params.items()}
    optimizer = make_optimizer(trained, 3e-3, 0.1)
    torch.manual_seed(7)
    losses = [train_step(trained, optimizer, cfg, ids, tgt, "none") for ids, tgt in training_batches(cfg)]
    assert all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(run["losses"], losses)) and len(run["losses"]) == 2
    for key in trained:
        assert relative(run["params"][key], trained[key]) <= 1e-10, key


def relative(value, reference):
    scale = reference.double().abs().max().item()
    return (value.double() - reference.double()).abs().max().item() / (scale or 1.0)


@pytest.mark.ranks
def test_stacked_layouts_equal_the_single_process(launched):
    """fp64, rel 1e-10: AdamW's first step moves an element by about lr times the sign of its gradient, so an
    element whose gradient is near zero in fp32 steps where its last bits say (tests/test_parallel_zero.py's
    training test measures it); in fp64 the ranks' sums and the single process's agree far below that."""
    for (name, policy, layout), run in launched:
        if name == "training":
            continue
        loss0, grads0, trained0 = single(name)
        where = (name, policy, layout)
        assert abs(run["loss"].item() - loss0.item()) <= 1e-10 * abs(loss0.item()), where
        assert set(run["grads"]) == set(grads0), where
        for key in grads0:
            assert relative(run["grads"][key], grads0[key]) <= 1e-10, (where, key)
            if run["params"] is not None:
                assert relative(run["params"][key], trained0[key]) <= 1e-10, (where, key)


@pytest.mark.ranks
def test_every_ranks_bytes_equal_their_closed_forms(launched):
    for (name, policy, layout), run in launched:
        for r in run["reports"]:  # (the training run's: its last step's)
            where = (name, policy, layout, r["rank"])
            assert r["peak_activation_bytes"] == r["predicted_activation_bytes"], where
            keys = KEYS + (ZERO_KEYS if layout.get("zero") else ()) + (EXPERT_KEYS if layout.get("ep") else ())
            for key in keys:
                assert r[key] == r[f"predicted_{key}"], (where, key, r[key], r[f"predicted_{key}"])


@pytest.mark.ranks
def test_zero_shards_what_each_rank_holds_over_its_group(launched):
    """Written from the shapes: under tp a rank's units are its tp slices (tp_shard.py), each sharded over the 2
    replicas (ceil(n / 2) elements of 8 bytes); under ep stage 1 all-reduces every gradient (the experts' over
    their 2 dp ranks, the rest over dp x ep = 4) and gathers the updated shards back."""
    by_layout = {(name, tuple(sorted(layout.items()))): run for (name, _, layout), run in launched}
    cfg, params, *_ = model("dense")
    tp3 = by_layout[("dense", tuple(sorted(dict(zero=3, dp=2, tp=2, sp=False, keep_gathered=True).items())))]
    for r in tp3["reports"]:
        mine = shard_params(params, r["tp_rank"], 2)
        units = [[EMBED]] + [[n for n in mine if n.startswith(f"model.layers.{k}.")] for k in range(cfg.layers)]
        units.append([n for n in mine if not n.startswith("model.layers.") and n != EMBED])
        shards = sum(-(-sum(mine[n].numel() for n in unit) // 2) for unit in units)
        assert r["param_bytes"] == r["grad_bytes"] == 8 * shards, r["rank"]
        assert r["zero_bytes_by_kind"]["backward"]["reduce_scatter"] == 2 * 8 * shards
    moe = by_layout[("moe", tuple(sorted(dict(zero=1, dp=2, ep=2).items())))]
    for r in moe["reports"]:
        assert set(r["zero_bytes_by_kind"]["backward"]) == {"all_reduce"}
        assert r["zero_bytes_by_kind"]["optimizer"] == {"all_gather": r["param_bytes"]}


@pytest.mark.ranks
def test_keeping_a_stages_units_gathered_for_the_step_gathers_each_once(launched):
    """keep_gathered="step" (torchtitan's default beside pp): a stage's rank gathers each of its units once, at its
    first use, whatever the micro-batches and the recomputation: its forward gathers every unit's whole padded bytes,
    dp = 2 times its shard bytes, and nothing is gathered again in the recompute or the backward; without it every
    micro-batch's forward, recompute and backward gather them again."""
    runs = {(name, tuple(sorted(layout.items()))): run for (name, _, layout), run in launched}
    once = runs[("dense", tuple(sorted(dict(zero=3, dp=2, pp=2, microbatches=2, keep_gathered="step").items())))]
    for r in once["reports"]:
        assert r["zero_bytes_by_kind"]["forward"] == {"all_gather": 2 * r["param_bytes"]}, r["rank"]
        assert "all_gather" not in r["zero_bytes_by_kind"]["recompute"] | r["zero_bytes_by_kind"]["backward"]

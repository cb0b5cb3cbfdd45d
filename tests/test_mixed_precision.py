"""Mixed precision (bf16, fp16) on the CPU: 16-bit activations and matmuls, fp32 master weights,
statistics and gradients. Against autograd in the same dtype and against an fp64 truth; every
policy bitwise equal to none; stored bytes equal to the closed form; the train command."""
import importlib.util

import pytest
import torch

from picockpt import loss_and_grads, param_shapes
from picockpt.measurement import peers
from picockpt.planning.step_forms import head_inventory, layer_inventory, predicted_peak_bytes
from picockpt.measurement.measure import measured_inventory
from picockpt.measurement.reference import ReferenceLlama
from picockpt.measurement.tracker import Tracker

from commands import picockpt as run_command
from conftest import setup

DTYPES = ["bfloat16", "float16"]
SHAPES = {
    "mha": dict(hidden=32, heads=4, kv_heads=4, layers=2),
    "gqa": dict(hidden=48, heads=6, kv_heads=2, layers=3, ffn=72),
    "tied": dict(hidden=32, heads=4, kv_heads=2, layers=2, tie_embeddings=True),
}
# Unit roundoff u of each dtype (half its machine epsilon): bf16 keeps 8 significant bits, fp16 11.
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
# Each gradient goes through a few dozen 16-bit roundings (matmul outputs, activations, casts), and
# picockpt and autograd round in slightly different places (grouped-query matmuls vs repeat_kv, the
# order of sums). Independent roundings add like a random walk: the norm-wise distance between the
# two is a few u. Measured: at most 2.5u in bf16. fp16 has 3 more bits but a narrow exponent: at
# this scale activation gradients (~1e-5) fall below its smallest normal number (6e-5) and lose
# bits as subnormals -- the reason fp16 training needs loss scaling -- so it is measured at 9.4u.
# Tolerances: 4u for bf16 (0.016) and 16u for fp16 (0.0078), about 1.6x the worst seen.
GRAD_TOLERANCE = {"bfloat16": 4 * UNIT_ROUNDOFF["bfloat16"], "float16": 16 * UNIT_ROUNDOFF["float16"]}
# The loss is an fp32 mean over B*T positions of log-sum-exps of the same 16-bit logits, up to a rare
# one-ulp difference in a logit; such differences average out: measured 2.3e-7 relative, and a 16-bit
# forward sits 5e-6 (fp16) to 5e-5 (bf16) away from the fp64 truth. 1e-5 relative sits between.
LOSS_RTOL = 1e-5
# And against the fp64 truth, gradient by gradient, picockpt's error is autograd's own in the same
# dtype, within 1.5x (measured worst 1.31x): the hand-written backward loses no accuracy.
VS_AUTOGRAD_ERROR = 1.5


@pytest.fixture(autouse=True)
def _one_thread():
    """Ops this small, 16-bit ones above all, run many times faster on one thread than on
    several that share a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def reference_loss_and_grads(cfg, params, input_ids, targets, seed):
    model = ReferenceLlama(cfg, params)
    torch.manual_seed(seed)
    loss = model(input_ids, targets)
    loss.backward()
    return loss.detach(), model.grads()


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_and_every_gradient_match_autograd(dtype, shape, dropout):
    cfg, params, ids, targets = setup(batch=2, seq=37, dtype=dtype, dropout=dropout, **SHAPES[shape])
    torch.manual_seed(7)
    loss, grads = loss_and_grads(params, cfg, ids, targets)
    ref_loss, ref_grads = reference_loss_and_grads(cfg, params, ids, targets, seed=7)
    truth_cfg = cfg.replace(dtype="float64")
    _, truth = reference_loss_and_grads(truth_cfg, {k: v.double() for k, v in params.items()}, ids, targets, seed=7)
    assert loss.dtype == torch.float32  # statistics in fp32
    torch.testing.assert_close(loss, ref_loss, rtol=LOSS_RTOL, atol=0)
    assert set(grads) == set(params)
    for name in params:
        assert grads[name].dtype == params[name].dtype == torch.float32, name  # fp32 master gradients
        assert relative_error(grads[name], ref_grads[name]) < GRAD_TOLERANCE[dtype], name
        ours, autograd = relative_error(grads[name], truth[name]), relative_error(ref_grads[name], truth[name])
        assert ours <= VS_AUTOGRAD_ERROR * autograd, (name, ours, autograd)


POLICIES = ["none", "full", "every:2", "every:3", "selective", "cheap", "every:2+selective", "full+cheap",
            "every:3+cheap"]


@pytest.mark.parametrize("dropout", [0.0, 0.15])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_policy_bitwise_equal_to_none(dtype, dropout):
    """Recomputation repeats the same 16-bit ops on the same inputs: the same bits, not just close."""
    cfg, params, ids, targets = setup(batch=2, seq=19, layers=5, dtype=dtype, dropout=dropout)
    torch.manual_seed(0)
    loss0, grads0 = loss_and_grads(params, cfg, ids, targets, "none")
    for policy in POLICIES[1:]:
        torch.manual_seed(0)
        loss, grads = loss_and_grads(params, cfg, ids, targets, policy)
        assert torch.equal(loss, loss0), policy
        for name in grads0:
            assert torch.equal(grads[name], grads0[name]), (policy, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_bytes_equal_the_closed_form(dtype):
    """2 bytes per 16-bit activation, 4 per fp32 norm statistic, 1 per dropout mask element."""
    cfg, params, ids, targets = setup(batch=2, seq=24, layers=4, dtype=dtype, dropout=0.1)
    measured = measured_inventory(cfg, 2, 24)
    closed = {(0, name): row for name, row in layer_inventory(cfg, 2, 24).items()}
    closed.update({(None, name): row for name, row in head_inventory(cfg, 2, 24).items()})
    assert {key: measured[key] for key in closed} == {key: nbytes for key, (_, _, nbytes) in closed.items()}
    assert closed[(0, "attn.q")][1] == dtype and closed[(0, "attn_norm.rstd")][1] == "float32"
    planner = importlib.util.find_spec("picockpt.planning.planner") is not None
    for policy in POLICIES + (["budget:100KiB"] if planner else []):
        with Tracker(physical=False, flops=False) as tracker:  # the store's bytes only
            loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
        assert tracker.peak_logical == predicted_peak_bytes(cfg, 2, 24, policy), policy


def test_reference_casts_each_weight_once_per_step():
    """As picockpt's compute_weights does: one 16-bit copy of every weight per step, shared by every use, a
    checkpoint's recomputation included. The tracker counts exactly those copies as "weights"."""
    cfg, params, ids, targets = setup(batch=2, seq=16, layers=3, dtype="bfloat16")
    model = ReferenceLlama(cfg, params)
    for run_layers in (peers.autograd, peers.per_layer, peers.selective(16)):
        with Tracker() as tracker:
            loss = model(ids, targets, run_layers=run_layers)
            for copy in model.casts.copies.values():
                tracker.mark(copy, "weights")
            loss.backward()
        weights = [sid for sid, category in tracker.categories.items() if category == "weights"]
        assert len(weights) == len(param_shapes(cfg))
        assert sum(tracker.sizes[sid] for sid in weights) == 2 * cfg.num_params()
        model.release_weights()
        model.zero_grad(set_to_none=True)


def test_peers_and_bridge_give_autograd_gradients_bitwise_in_bf16():
    """The shared 16-bit copies carry every gradient back to the fp32 weights, checkpointed or not."""
    from picockpt.recompute.bridge import segmented_backward
    cfg, params, ids, targets = setup(batch=2, seq=19, layers=4, dtype="bfloat16", dropout=0.1)
    model = ReferenceLlama(cfg, params)

    def grads_of(how):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        if isinstance(how, int):
            model.cast_weights()
            segmented_backward(model.model.layers, model.embed(ids), lambda y: model.head_loss(y, targets), how)
        else:
            model(ids, targets, run_layers=how).backward()
        model.release_weights()
        return {name: grad.clone() for name, grad in model.grads().items()}

    expected = grads_of(peers.autograd)
    for how in (peers.per_layer, peers.sequential(2), peers.selective(19), peers.save_matmuls(19), 1, 2):
        got = grads_of(how)
        assert all(torch.equal(got[name], expected[name]) for name in expected), how


def picockpt(*args):
    return run_command(*args, env={"OMP_NUM_THREADS": "1"})


def test_train_in_bf16_runs():
    out = picockpt("train", "--preset", "tiny", "--dtype", "bf16", "--steps", "3", "--policy", "every:2",
                   "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "(bfloat16)" in out.stdout and "tokens/s" in out.stdout


def test_train_in_fp16_is_a_one_line_error():
    out = picockpt("train", "--preset", "tiny", "--dtype", "fp16", "--steps", "1", "--device", "cpu")
    assert out.returncode == 2
    assert "--dtype fp16" in out.stderr and "loss scaling" in out.stderr and "Traceback" not in out.stderr

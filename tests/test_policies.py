"""Every policy: bitwise the same loss and gradients as storing everything, and exactly the
peak bytes and recompute FLOPs the closed forms predict."""
import pytest
import torch

from picockpt import loss_and_grads, parse_policy
from picockpt.planning.step_forms import predicted_peak_bytes, step_flops
from picockpt.measurement.tracker import Tracker

from conftest import setup

POLICIES = ["none", "full", "every:2", "every:3", "selective", "cheap", "every:2+selective", "full+cheap",
            "every:3+cheap"]


def run(cfg, params, ids, targets, policy, seed=0, tracker=None):
    torch.manual_seed(seed)
    return loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)


@pytest.mark.parametrize("dropout", [0.0, 0.15])
@pytest.mark.parametrize("policy", POLICIES)
def test_bitwise_equal_to_none(policy, dropout):
    cfg, params, ids, targets = setup(batch=2, seq=19, layers=5, dropout=dropout)
    loss0, grads0 = run(cfg, params, ids, targets, "none")
    loss, grads = run(cfg, params, ids, targets, policy)
    assert torch.equal(loss, loss0)
    for name in grads0:
        assert torch.equal(grads[name], grads0[name]), name


def test_without_replaying_the_rng_recomputation_is_wrong(monkeypatch):
    """Recomputed dropout masks must equal the first ones; skip the replay and they do not."""
    import contextlib
    from picockpt.recompute import engine
    cfg, params, ids, targets = setup(batch=2, seq=19, layers=4, dropout=0.2)
    _, grads0 = run(cfg, params, ids, targets, "none")
    monkeypatch.setattr(engine, "replay_rng", lambda generator, state: contextlib.nullcontext())
    _, grads = run(cfg, params, ids, targets, "full")
    worst = max((grads[k] - grads0[k]).abs().max().item() for k in grads0)
    assert worst > 1e-3


SHAPES = [
    (dict(layers=5), 2, 19),                                      # L=5 not divisible by C=2, 3
    (dict(layers=7, hidden=48, heads=6, kv_heads=2, ffn=72), 3, 37),
    (dict(layers=4, dropout=0.1, dtype="float64"), 1, 23),
    (dict(layers=6, dtype="bfloat16", kv_heads=1), 2, 16),
]


@pytest.mark.parametrize("fields,batch,seq", SHAPES)
def test_peak_and_flops_equal_the_closed_forms(fields, batch, seq):
    cfg, params, ids, targets = setup(batch=batch, seq=seq, **fields)
    for policy in POLICIES + [f"every:{cfg.layers}", f"every:{cfg.layers - 1}"]:
        with Tracker() as tracker:
            run(cfg, params, ids, targets, policy, tracker=tracker)
        assert tracker.peak_logical == predicted_peak_bytes(cfg, batch, seq, policy), policy
        flops = step_flops(cfg, batch, seq, policy)
        assert {k: tracker.flops[k] for k in flops} == flops, policy


def test_recompute_costs_one_extra_forward():
    cfg, params, ids, targets = setup(batch=2, seq=32, preset="small", layers=4)
    measured = {}
    for policy in ("none", "full", "every:2", "selective"):
        with Tracker() as tracker:
            run(cfg, params, ids, targets, policy, tracker=tracker)
        measured[policy] = dict(tracker.flops)
    head = 2 * 2 * 32 * cfg.hidden * cfg.vocab
    forward = measured["none"]["forward"]
    for policy in ("full", "every:2"):  # every layer's forward once more; the LM head is not recomputed
        assert measured[policy]["recompute"] == forward - head
        total = sum(measured[policy].values()) / sum(measured["none"].values())
        assert 1.25 < total <= 4 / 3, total
    assert 0 < measured["selective"]["recompute"] < 0.1 * forward  # only q k^T again


def physical_peak(policy, seq, layers=6):
    cfg, params, ids, targets = setup(batch=2, seq=seq, preset="small", layers=layers)
    with Tracker() as tracker:
        run(cfg, params, ids, targets, policy, tracker=tracker)
    return tracker.peak_physical


def test_physical_peaks_are_in_the_order_a_reader_expects():
    peaks = {p: physical_peak(p, 64) for p in ("none", "full", "every:6", "selective")}
    assert peaks["full"] < peaks["every:6"] <= peaks["none"]
    assert peaks["selective"] < peaks["none"]
    saving = {T: physical_peak("none", T) - physical_peak("selective", T) for T in (32, 64, 128)}
    assert saving[32] < saving[64] < saving[128]  # the s^2 term grows with the sequence


def test_memory_is_flat_over_repeated_steps():
    from picockpt.measurement.train import make_optimizer, train_step
    cfg, params, ids, targets = setup(batch=2, seq=16, layers=3)
    optimizer = make_optimizer(params)
    retained, store_peaks = [], []
    for step in range(20):
        with Tracker() as tracker:
            train_step(params, optimizer, cfg, ids, targets, "every:2+cheap", tracker)
        retained.append(tracker.retained_bytes())
        store_peaks.append(tracker.peak_physical)
    assert len(set(retained[1:])) == 1 and retained[-1] <= 8  # nothing but the loss scalar outlives a step
    assert len(set(store_peaks[1:])) == 1


@pytest.mark.parametrize("text,match", [
    ("every:0", "C >= 1"), ("every:", "C >= 1"), ("every:x", "C >= 1"), ("every:9", "larger than the number"),
    ("sometimes", "unknown part 'sometimes'"), ("full+every:2", "both layer-level"),
    ("selective+cheap", "one of selective or cheap"), ("", "empty"), ("budget:lots", "size 'lots'"),
    ("full+", "an empty part beside a '\\+'"), ("+full", "an empty part"), ("full++selective", "an empty part"),
    ("budget:0", r"^policy 'budget:0': in budget:SIZE, size '0' must be positive"),
])
def test_malformed_policies_are_clear_errors(text, match):
    cfg, *_ = setup(layers=8)
    with pytest.raises(ValueError, match=match):
        parse_policy(text, cfg)


def test_policy_spellings():
    assert parse_policy("every:1").text == "full"
    assert parse_policy(" Every:2 + Selective ").text == "every:2+selective"
    assert parse_policy("none+cheap").text == "cheap"
    assert parse_policy("budget:1.5GiB").budget == int(1.5 * 2**30)


def test_a_policy_parsed_without_a_model_is_still_checked_where_it_meets_one():
    """Parsed once, passed on as a Policy: the model it reaches still refuses what does not fit it."""
    from picockpt.recompute.policy import as_policy
    cfg, params, ids, targets = setup(layers=2)
    with pytest.raises(ValueError, match=r"C=9 is larger than the number of layers L=2"):
        loss_and_grads(params, cfg, ids, targets, parse_policy("every:9"))
    assert as_policy(parse_policy("every:2"), cfg).segment == 2

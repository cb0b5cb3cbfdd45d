"""The planner's third choice: keep the 16-bit weight copies or recast them, priced by their bytes against
the recomputation the room they free saves; a budget with offloading reaching the three-action planner."""
import pytest
import torch

from picockpt import loss_and_grads
from picockpt.measurement.alloc_trace import live_peak, only, trace_of
from picockpt.cli import main
from picockpt.model.config import Config
from picockpt.recompute.engine import Model
from picockpt.model.params import copy_bytes
from picockpt.planning.planner import least_budget, model_chain
from picockpt.planning.planner_copies import layer_casts, layer_params, options, plan_copies
from picockpt.planning.planner_offload import plan_offload
from picockpt.recompute.policy import parse_policy
from picockpt.measurement.tracker import Tracker

from conftest import setup

SHAPE = dict(batch=2, seq=16, layers=4, dtype="bfloat16")


def casts_in_a_step(cfg, params, ids, targets, policy, monkeypatch):
    """How many times the engine fetches a layer's weights (under recast: how many casts)."""
    calls = []
    fetch = Model.layer_weights_for
    monkeypatch.setattr(Model, "layer_weights_for", lambda self, k: calls.append(k) or fetch(self, k))
    loss_and_grads(params, cfg, ids, targets, policy)
    monkeypatch.undo()
    return len(calls)


def test_layer_casts_count_what_the_engine_casts(monkeypatch):
    cfg, params, ids, targets = setup(**SHAPE)
    for text in ("none", "full", "every:2", "selective", "budget:30KiB", "budget:60KiB"):
        policy = parse_policy(text + "+recast", cfg)
        schedule = policy.schedule(cfg, 2, 16)
        expected = layer_casts(schedule, cfg.layers, True)
        assert casts_in_a_step(cfg, params, ids, targets, policy.text, monkeypatch) == expected, text
    assert layer_casts(parse_policy("full").schedule(cfg, 2, 16), cfg.layers, False) == cfg.layers
    assert layer_casts(parse_policy("full").schedule(cfg, 2, 16), cfg.layers, True) == 3 * cfg.layers


def test_recast_is_chosen_where_only_its_room_fits_and_keep_where_both_store_everything():
    cfg = Config.from_preset("tiny", layers=4, dtype="bfloat16")
    least = least_budget(model_chain(cfg, 2, 16))
    tight = least + copy_bytes(cfg, True)  # recast's copies and the store's least: keep cannot fit
    chosen, both = plan_copies(cfg, 2, 16, tight)
    keep, recast = both
    assert keep.plan is None and recast.plan is not None and chosen is recast
    assert chosen.policy == f"budget:{least}+recast" and chosen.store_budget == least
    roomy = 10 * (least + copy_bytes(cfg))  # both store everything: no recompute, so fewer casts wins
    chosen, (keep, recast) = plan_copies(cfg, 2, 16, roomy)
    assert keep.plan.recompute_flops == recast.plan.recompute_flops == 0 and chosen is keep
    assert keep.cast_bytes == cfg.layers * 6 * layer_params(cfg) < recast.cast_bytes


def test_the_choice_follows_the_prices():
    """Between the two fits: recasting frees room (fewer recomputed FLOPs) for cast bytes; a slow memory
    makes the casts dear (keep), a slow compute makes recomputation dear (recast)."""
    cfg = Config.from_preset("tiny", layers=4, dtype="bfloat16")
    least = least_budget(model_chain(cfg, 2, 16))
    total = least + copy_bytes(cfg) + (copy_bytes(cfg) - copy_bytes(cfg, True)) // 2
    keep, recast = options(cfg, 2, 16, total)
    assert keep.plan is not None and recast.plan.recompute_flops < keep.plan.recompute_flops
    assert not plan_copies(cfg, 2, 16, total, rate=1e15, bandwidth=1e3)[0].recast
    assert plan_copies(cfg, 2, 16, total, rate=1e3, bandwidth=1e15)[0].recast


def test_the_chosen_policy_measures_as_planned():
    cfg, params, ids, targets = setup(**SHAPE)
    least = least_budget(model_chain(cfg, 2, 16))
    for total in (least + copy_bytes(cfg, True), 10 * (least + copy_bytes(cfg))):
        chosen, _ = plan_copies(cfg, 2, 16, total)
        with Tracker() as tracker:
            loss_and_grads(params, cfg, ids, targets, chosen.policy, tracker=tracker)
        assert tracker.peak_logical == chosen.plan.peak_bytes
        assert live_peak(only(trace_of(tracker), ("weights",))) == chosen.copy_bytes
        assert tracker.peak_logical + chosen.copy_bytes <= total


def test_refusals():
    cfg = Config.from_preset("tiny", layers=4, dtype="bfloat16")
    with pytest.raises(ValueError, match="no 16-bit copies to keep or recast"):
        plan_copies(cfg.replace(dtype="float32"), 2, 16, 2**30)
    with pytest.raises(ValueError, match="give at least"):
        plan_copies(cfg, 2, 16, 1000)
    with pytest.raises(ValueError, match="bandwidth=0"):
        plan_copies(cfg, 2, 16, 2**30, bandwidth=0)


def test_plan_with_copies_command(capsys):
    cfg = Config.from_preset("tiny", layers=4, dtype="bfloat16")
    tight = least_budget(model_chain(cfg, 2, 16)) + copy_bytes(cfg, True)
    args = ["plan", "--preset", "tiny", "--layers", "4", "--dtype", "bf16", "--batch", "2", "--seq", "16",
            "--budget", str(tight), "--with-copies"]
    assert main(args + ["--measure", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "+recast" in out and "DIFFERS" not in out and "equal" in out
    assert main(["plan", "--preset", "tiny", "--budget", "1MiB", "--with-copies"]) != 0
    assert "--with-copies" in capsys.readouterr().err  # fp32: no copies


def test_a_budget_with_offloading_runs_the_three_action_plan():
    """budget:SIZE+offload is the three-action planner's plan (keep, recompute or offload), not the
    two-action one's: at a Llama-sized layer, where moving a layer's tensors beats recomputing it."""
    cfg = Config(hidden=4096, ffn=14336, heads=32, kv_heads=8, layers=3, vocab=1024, max_seq=2048, dtype="bfloat16")
    budget = 2 * least_budget(model_chain(cfg, 1, 1024))
    schedule = parse_policy(f"budget:{budget}+offload", cfg).schedule(cfg, 1, 1024)
    assert schedule == plan_offload(cfg, 1, 1024, budget).schedule
    assert schedule.host is not None and any(schedule.host)

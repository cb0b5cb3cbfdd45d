"""The planner: binomial optimum on the uniform chain, exhaustive search on small chains, and
budget schedules run in the engine (exact peak and FLOPs, bitwise the same gradients)."""
import itertools
import json
import random

import pytest
import torch

from picockpt import loss_and_grads
from picockpt.planning.step_forms import predicted_peak_bytes, step_flops
from picockpt.planning.planner import Stage, frontier, least_budget, model_chain, plan_chain, plan_model, replay
from picockpt.planning.planner_uniform import binomial_forward_steps, forward_steps_table, plan_uniform
from picockpt.recompute.policy import parse_policy
from picockpt.measurement.tracker import Tracker

from commands import picockpt as run_command
from conftest import setup


# ---- the uniform chain: Griewank & Walther's binomial optimum ----------------------------------
def test_uniform_chain_equals_the_binomial_formula():
    table = forward_steps_table(200, 10)  # every l <= 200, s <= 10 from one table
    for length in range(1, 201):
        for slots in range(1, 11):
            assert table[length, slots] == binomial_forward_steps(length, slots)[0], (length, slots)
    assert binomial_forward_steps(10, 3) == (15, 2) and binomial_forward_steps(200, 1)[0] == 199 * 200 // 2


@pytest.mark.parametrize("length,slots", [(1, 1), (2, 1), (10, 3), (17, 2), (40, 4), (60, 10)])
def test_uniform_schedule_is_a_valid_revolve_run(length, slots):
    """Play the actions: every step reversed once, top down, from the right state; never more than
    `slots` states stored; the advances add up to forward_steps."""
    plan = plan_uniform(length, slots)
    stored, hand, advances, reversed_steps = set(), 0, 0, []
    for action in plan.actions:
        kind = action["action"]
        if kind == "store":
            stored.add(action["state"])
            assert len(stored) <= slots and hand == action["state"]
        elif kind == "restore":
            assert action["state"] in stored
            hand = action["state"]
        elif kind == "advance":
            assert hand == action["from"] < action["to"]
            advances += action["to"] - action["from"]
            hand = action["to"]
        else:
            step = action["step"]
            assert hand == step and step == length - 1 - len(reversed_steps)
            reversed_steps.append(step)
            stored.discard(step)
            hand = None
    assert advances == plan.forward_steps == binomial_forward_steps(length, slots)[0]
    assert not stored and len(reversed_steps) == length


def test_uniform_chain_is_the_planners_equal_step_case():
    """The general planner on equal steps of 1 slot each reproduces revolve when its stage-whole
    size is a 'tape' too big to hold twice (K slots more), and it gets one slot more: revolve
    does not count the state in hand, the engine stores the input of the layer it records."""
    for slots in (1, 2, 3):
        K = slots + 1
        for length in range(1, 13):
            chain = tuple(Stage(1, 1, (("all", 1 + K, 0),)) for _ in range(length))
            plan = plan_chain(chain, slots + 1 + K)
            assert plan.recompute_flops == binomial_forward_steps(length, slots)[0], (length, slots)


# ---- heterogeneous chains: the DP against every schedule the engine can run --------------------
def every_run(chain):
    """{(peak bytes, recompute)} of every schedule the engine's loop can run on `chain` (the last
    stage is the head, stored at the end of the first forward). Written from engine.py, not the planner."""
    L = len(chain) - 1
    modes = [["none", "input"] + [mode for mode, _, _ in stage.variants] for stage in chain]
    results = set()

    def forward(state, first, last, mode_of, counted):
        inputs, whole, live, peak, cost = state
        inputs, whole = set(inputs), dict(whole)
        for k in range(first, last + 1):
            mode = mode_of[k - first]
            if mode != "none" and k not in inputs:
                inputs.add(k)
                live += chain[k].input_bytes
            if mode.startswith("all"):
                if k in whole:
                    return None  # the engine would refuse to store it twice
                whole[k] = next(v for v in chain[k].variants if v[0] == mode)
                live += whole[k][1] - chain[k].input_bytes
            peak = max(peak, live)
            if counted:  # a recompute sweep's last layer stops before its tail (engine's stop_early)
                cost += chain[k].forward_flops - (chain[k].tail_flops if k == last else 0)
        return inputs, whole, live, peak, cost

    def backward(state, i):
        if i < 0:
            results.add((state[3], state[4]))
            return
        inputs, whole = state[0], state[1]
        if i in whole:
            candidates = [state]
        else:
            j = max(k for k in inputs if k <= i)
            candidates = [forward(state, j, i, list(sweep) + [last], True)
                          for sweep in itertools.product(*modes[j:i]) for last in modes[i][2:]]
        for inputs, whole, live, peak, cost in filter(None, candidates):
            whole = dict(whole)
            _, a, r = whole.pop(i)
            backward((inputs - {i}, whole, live - a, peak, cost + r), i - 1)

    for first in itertools.product(*modes[:L]):
        if first[0] != "none":
            inputs, whole, live, peak, cost = forward((set(), {}, 0, 0, 0), 0, L - 1, first, False)
            for _, head, _ in chain[L].variants:  # the head stored whole, in any of its variants
                backward((inputs, whole, live, max(peak, live + head), cost), L - 1)
    return results


def random_chain(rng, layers, variants):
    chain = []
    for _ in range(layers):
        x = rng.randint(1, 4)
        options = sorted(rng.sample(range(x + 1, x + 12), variants), reverse=True)  # bigger: cheaper
        costs = sorted(rng.sample(range(0, 6), variants))
        forward = rng.randint(1, 9)
        chain.append(Stage(forward, x, tuple((f"all:{n}" if n else "all", a, r)
                                             for n, (a, r) in enumerate(zip(options, costs))),
                           tail_flops=rng.randint(0, forward - 1)))
    x = rng.randint(1, 4)
    heads = sorted(rng.sample(range(x, x + 9), 2), reverse=True)  # two ways to store the head
    return tuple(chain) + (Stage(0, x, (("all", heads[0], 0), ("all:cheap", heads[1], 0))),)


@pytest.mark.parametrize("seed,layers,variants", [(0, 3, 2), (1, 3, 2), (2, 4, 1), (3, 4, 2), (4, 2, 3), (6, 5, 2)])
def test_dp_equals_exhaustive_search(seed, layers, variants):
    chain = random_chain(random.Random(seed), layers, variants)
    runs = every_run(chain)
    least = min(peak for peak, _ in runs)
    assert least_budget(chain) == least
    for budget in range(least, max(peak for peak, _ in runs) + 2):
        best = min(cost for peak, cost in runs if peak <= budget)
        plan = plan_chain(chain, budget)
        assert plan.recompute_flops == best, (budget, plan)
        assert plan.peak_bytes <= budget and (plan.peak_bytes, plan.recompute_flops) in runs
        assert replay(chain, plan.schedule) == (plan.peak_bytes, plan.recompute_flops)


def test_frontier_is_every_pareto_point_of_the_exhaustive_search():
    chain = random_chain(random.Random(7), 4, 2)
    runs = every_run(chain)
    pareto = sorted({(peak, cost) for peak, cost in runs
                     if not any(p <= peak and c <= cost and (p, c) != (peak, cost) for p, c in runs)}, reverse=True)
    assert [(plan.peak_bytes, plan.recompute_flops) for plan in frontier(chain)] == pareto


def test_a_coarse_grid_never_goes_over_budget():
    chain = random_chain(random.Random(5), 6, 3)
    least = least_budget(chain)
    exact = [plan_chain(chain, budget) for budget in range(least, least + 40)]
    for budget, plan in zip(range(least, least + 40), exact):
        coarse = plan_chain(chain, budget, max_slots=7)
        assert coarse.peak_bytes <= budget and not coarse.exact_grid
        assert coarse.recompute_flops >= plan.recompute_flops  # rounding sizes up can only cost more


# ---- picockpt's model: the plan runs in the engine, exactly as predicted ---------------------------
def budgets(cfg, batch, seq, unstored, count=6):
    least = least_budget(model_chain(cfg, batch, seq, unstored))
    most = predicted_peak_bytes(cfg, batch, seq, "none")
    return sorted({least, least + 1} | {least + (most - least) * k // count for k in range(1, count + 1)})


@pytest.mark.parametrize("op_level,dropout", [("", 0.0), ("+selective", 0.0), ("", 0.1), ("+cheap", 0.1)])
def test_budget_runs_as_planned(op_level, dropout):
    cfg, params, ids, targets = setup(batch=2, seq=19, layers=5, dropout=dropout)
    torch.manual_seed(0)
    loss0, grads0 = loss_and_grads(params, cfg, ids, targets, "none")
    unstored = parse_policy("none" + op_level).unstored
    for budget in budgets(cfg, 2, 19, unstored):
        policy = f"budget:{budget}{op_level}"
        plan = plan_model(cfg, 2, 19, budget, unstored)
        torch.manual_seed(0)
        with Tracker() as tracker:
            loss, grads = loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
        assert tracker.peak_logical == plan.peak_bytes == predicted_peak_bytes(cfg, 2, 19, policy) <= budget
        assert tracker.flops["recompute"] == plan.recompute_flops == step_flops(cfg, 2, 19, policy)["recompute"]
        assert torch.equal(loss, loss0)
        for name in grads0:
            assert torch.equal(grads[name], grads0[name]), (policy, name)


def test_the_planner_is_never_beaten_by_a_fixed_policy():
    """At the peak of every fixed policy, the planner (same op level) recomputes no more."""
    cfg, *_ = setup(layers=6)
    for layer_level in ["none", "full", "every:2", "every:3", "every:4", "every:6"]:
        for op_level in ["", "+selective", "+cheap"]:
            policy = parse_policy(layer_level + op_level, cfg)
            peak = predicted_peak_bytes(cfg, 3, 23, policy)
            plan = plan_model(cfg, 3, 23, peak, policy.unstored)
            assert plan.recompute_flops <= step_flops(cfg, 3, 23, policy)["recompute"], policy.text


@pytest.mark.parametrize("max_slots", [50, 400])
def test_a_coarse_grid_still_matches_every_fixed_policy(max_slots):
    """Sizes rounded up to coarse slots would make `none` or `cheap` look over their own peak; the
    extra slots and the exact replay keep the planner on or below them anyway."""
    cfg, *_ = setup(layers=6)
    for layer_level in ["none", "full", "every:2", "every:3", "every:6"]:
        for op_level in ["", "+selective", "+cheap"]:
            policy = parse_policy(layer_level + op_level, cfg)
            peak = predicted_peak_bytes(cfg, 3, 23, policy)
            plan = plan_model(cfg, 3, 23, peak, policy.unstored, max_slots=max_slots)
            assert not plan.exact_grid and plan.peak_bytes <= peak
            assert plan.recompute_flops <= step_flops(cfg, 3, 23, policy)["recompute"], policy.text


def test_a_budget_below_the_least_is_a_clear_error():
    cfg, params, ids, targets = setup(batch=2, seq=19, layers=4)
    least = least_budget(model_chain(cfg, 2, 19))
    with pytest.raises(ValueError, match=rf"budget=1,024 bytes .* least feasible budget .* {least:,} bytes"):
        loss_and_grads(params, cfg, ids, targets, "budget:1KiB")
    with pytest.raises(ValueError, match="MiB"):
        plan_model(cfg, 2, 19, least - 1)
    assert plan_model(cfg, 2, 19, least).peak_bytes == least


# ---- the command ----------------------------------------------------------------------------------
def picockpt(*args, check=True):
    return run_command(*args, check=check)


def test_plan_command_uniform_chain():
    out = json.loads(picockpt("plan", "--chain", "uniform", "--length", "10", "--slots", "3", "--json").stdout)
    assert out["forward_steps"] == out["binomial_formula"] == 15
    assert out["actions"][0] == "store x0 in slot 1" and len(out["actions"]) > 10
    text = picockpt("plan", "--chain", "uniform", "--length", "10", "--slots", "3").stdout
    assert "15 forward steps" in text and "reverse step 9" in text


def test_plan_command_model_budget():
    out = json.loads(picockpt("plan", "--preset", "tiny", "--layers", "4", "--seq", "16", "--batch", "2",
                              "--budget", "100KiB", "--measure", "--device", "cpu", "--json").stdout)
    cfg, *_ = setup(layers=4)
    plan = plan_model(cfg, 2, 16, 100 * 1024)
    assert out["peak_bytes"] == plan.peak_bytes == out["measured_peak_bytes"] <= 100 * 1024
    assert out["recompute_flops"] == plan.recompute_flops == out["measured_recompute_flops"] > 0
    assert out["forward"] == list(plan.schedule.forward) and out["policy"] == "budget:100KiB"
    error = picockpt("plan", "--preset", "tiny", "--budget", "1KiB", check=False)
    assert error.returncode == 2 and "least feasible budget" in error.stderr and "Traceback" not in error.stderr

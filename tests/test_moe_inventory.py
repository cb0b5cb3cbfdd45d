"""What a mixture-of-experts layer stores, by routing: the closed form with the step's per-expert token
counts equals the store to the byte, for balanced, skewed and all-to-one routing set by the weights."""
import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import (balanced_counts, counts_from_puts, expert_bytes, layer_inventory, predicted_peak_bytes,
                                step_flops, total)
from picockpt.measurement.measure import PutRecorder
from picockpt.model.routing import route_by_token, step_routing, token_counts
from picockpt.planning.planner import plan_model
from picockpt.recompute.policy import parse_policy
from picockpt.measurement.tracker import Tracker

B, T = 2, 16  # N = 32 tokens


pytestmark = pytest.mark.usefixtures("one_thread")


def pattern(name, E):
    """Token ids whose classes (id mod E) make the routing: every class alike, a skew, all one class."""
    if name == "balanced":
        classes = torch.arange(B * T) % E
    elif name == "skewed":  # half the tokens in class 0, a quarter in class 1, the rest spread
        classes = torch.tensor([0] * 16 + [1] * 8 + [e % E for e in range(2, 10)])
    else:  # all to one
        classes = torch.zeros(B * T, dtype=torch.long)
    spread = torch.randint(0, 64 // E, (B * T,), generator=torch.Generator().manual_seed(0))
    return (classes + E * spread).view(B, T)  # ids below the vocabulary (64), each of its class


@pytest.mark.parametrize("routing", ["balanced", "skewed", "all-to-one"])
@pytest.mark.parametrize("fields", [dict(experts=4, experts_per_token=2, shared_expert_ffn=24),
                                    dict(experts=4, experts_per_token=1, router_jitter=0.05, dropout=0.1),
                                    dict(experts=8, experts_per_token=2, dtype="bfloat16")],
                         ids=["E4k2-shared", "E4k1-jitter", "E8k2-bf16"])
def test_stored_bytes_equal_the_closed_form_for_each_routing(routing, fields):
    cfg = Config.from_preset("tiny", **fields)
    params = route_by_token(init_params(cfg), cfg)
    ids = pattern(routing, cfg.experts)
    targets = torch.roll(ids, 1, dims=1)
    counts = token_counts(cfg, ids)  # known before any step: the weights route by token id
    expected = {"balanced": [B * T * cfg.experts_per_token // cfg.experts] * cfg.experts,
                "all-to-one": [B * T] * cfg.experts_per_token + [0] * (cfg.experts - cfg.experts_per_token)}
    assert counts == expected.get(routing, counts) and sum(counts) == B * T * cfg.experts_per_token
    torch.manual_seed(0)
    assert step_routing(params, cfg, ids) == [counts] * cfg.layers  # what the routers really do

    for policy in ("none", "moe_act", "cheap+moe"):
        unstored = parse_policy(policy).unstored
        recorder = PutRecorder()
        torch.manual_seed(0)
        loss_and_grads(params, cfg, ids, targets, policy, tracker=recorder)
        for layer in range(cfg.layers):
            if policy != "cheap+moe":  # the store's own record of the routing (moe keeps no expert rows)
                assert counts_from_puts(cfg, recorder.puts, layer) == counts
            measured = {name: nbytes for (lay, name), nbytes in recorder.puts.items() if lay == layer}
            closed = {name: nbytes for name, (_, _, nbytes) in layer_inventory(cfg, B, T, unstored, counts).items()}
            assert measured == closed, (policy, layer)
    for policy in ("none", "full", "every:2+moe", "selective+moe_act"):
        with Tracker("cpu", physical=False) as tracker:
            torch.manual_seed(0)
            loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
        routing_of_step = [counts] * cfg.layers
        assert tracker.peak_logical == predicted_peak_bytes(cfg, B, T, policy, routing_of_step), policy
        assert tracker.peak_logical == predicted_peak_bytes(cfg, B, T, policy)  # balanced assumed: same total
        assert {phase: tracker.flops[phase] for phase in ("forward", "recompute", "backward")} == \
            step_flops(cfg, B, T, policy), policy


def test_routing_moves_bytes_between_experts_not_in_or_out_of_the_layer():
    cfg = Config.from_preset("tiny", experts=4, experts_per_token=2)
    f, e = cfg.ffn, 4  # fp32
    balanced, skewed, one = [16, 16, 16, 16], [24, 20, 10, 10], [32, 32, 0, 0]
    assert balanced_counts(cfg, B, T) == balanced
    per_expert = {name: expert_bytes(cfg, B, T, counts) for name, counts in
                  (("balanced", balanced), ("skewed", skewed), ("one", one))}
    assert per_expert["balanced"] == [16 * 3 * f * e] * 4  # gate_up (n, 2f) and act (n, f) of each expert
    assert per_expert["one"] == [32 * 3 * f * e] * 2 + [0, 0]  # two experts hold all, two nothing
    assert len({sum(v) for v in per_expert.values()}) == 1  # the layer's experts hold B*T*k*3f*e in every case
    assert {total(layer_inventory(cfg, B, T, counts=c)) for c in (balanced, skewed, one)} == \
        {total(layer_inventory(cfg, B, T))}
    # the layer by hand: the dense part, then the router (fp32 probs, int64 index), then the experts
    N, h = B * T, cfg.hidden
    attention = (6 * N * h + 2 * N * cfg.kv_dim + B * cfg.heads * T * T) * e + 2 * N * 4
    assert total(layer_inventory(cfg, B, T)) == attention + N * 4 * 4 + N * 2 * 8 + N * 2 * 3 * f * e


def test_budget_plans_for_moe_layers_run_as_planned():
    cfg = Config.from_preset("tiny", layers=4, experts=4, experts_per_token=2, shared_expert_ffn=24)
    params = init_params(cfg, seed=1)
    ids = pattern("skewed", 4)
    targets = torch.roll(ids, 1, dims=1)
    full = predicted_peak_bytes(cfg, B, T, "none")
    for budget in (full, full * 45 // 100, full * 30 // 100, full // 8):
        plan = plan_model(cfg, B, T, budget)
        assert plan.peak_bytes <= budget
        with Tracker("cpu", physical=False) as tracker:
            loss_and_grads(params, cfg, ids, targets, f"budget:{budget}", tracker=tracker)
        assert tracker.peak_logical == plan.peak_bytes
        assert tracker.flops["recompute"] == plan.recompute_flops
    modes = set(plan_model(cfg, B, T, full * 30 // 100).schedule.forward)
    assert "all:cheap+moe" in modes, modes  # the planner recomputes whole experts where that pays
    modes = set(plan_model(cfg, B, T, full * 45 // 100).schedule.forward)
    assert any(mode.endswith("+router") for mode in modes), modes  # and the router's few bytes where they tip it

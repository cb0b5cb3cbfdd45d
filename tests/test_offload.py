"""Offloading to host memory (picockpt/recompute/offload.py, store.py, host_walk.py, planner_offload.py): exactness against none,
byte-exact device and host peaks against their closed forms, the three-action planner, clear errors."""
import json

import pytest
import torch

from picockpt import ActivationStore, Config, init_params, loss_and_grads
from picockpt.cli import main
from picockpt.recompute.engine import Model, Step
from picockpt.planning.step_forms import chain_sizes, predicted_host_bytes, predicted_peak_bytes
from picockpt.measurement.measure import make_batch, measure_policy
from picockpt.recompute.offload import HostTier
from picockpt.planning.planner import least_budget, model_chain
from picockpt.planning.host_walk import check_rates, model_costs, walk
from picockpt.planning.planner_offload import plan_offload
from picockpt.recompute.policy import parse_policy
from picockpt.measurement.tracker import Tracker

B, T = 2, 16
POLICIES = ("offload", "none+offload", "every:2+offload", "offload:mlp.gate,mlp.up", "cheap+offload",
            "every:3+selective+offload", "none+cheap+offload", "offload:input")


def setup(**fields):
    cfg = Config.from_preset("tiny", layers=4, **fields)
    return cfg, init_params(cfg, seed=0), *make_batch(cfg, B, T, "cpu", 0)


@pytest.mark.parametrize("fields", [dict(attention="eager", dropout=0.1), dict(attention="tiled", attention_tile=8),
                                    dict(attention="fused", loss_chunk=8)])
def test_every_offload_policy_is_bitwise_none_and_its_bytes_are_the_closed_forms(fields):
    cfg, params, ids, targets = setup(**fields)
    torch.manual_seed(0)
    base_loss, base = loss_and_grads(params, cfg, ids, targets, "none")
    for policy in POLICIES:
        torch.manual_seed(0)
        with Tracker("cpu", flops=False) as tracker:
            loss, grads = loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
        assert torch.equal(loss, base_loss), policy
        assert [k for k in grads if not torch.equal(grads[k], base[k])] == [], policy
        assert tracker.peak_logical == predicted_peak_bytes(cfg, B, T, policy), policy
        assert tracker.peak_host == predicted_host_bytes(cfg, B, T, policy) > 0, policy
        assert tracker.peak_host_live == tracker.peak_host, policy  # the host copies, counted apart from the device's
        moved = {way: sum(phase[way] for phase in tracker.copy_bytes.values()) for way in ("to_host", "to_device")}
        assert moved["to_host"] == moved["to_device"] == tracker.copy_bytes["forward"]["to_host"], policy


def test_device_and_host_peaks_of_full_and_none_offload_in_closed_form():
    cfg = Config.from_preset("tiny", layers=4)
    X, A, F = chain_sizes(cfg, B, T)
    L = cfg.layers
    assert predicted_peak_bytes(cfg, B, T, "offload") == max(F + X, A + X)
    assert predicted_host_bytes(cfg, B, T, "offload") == L * X
    assert predicted_peak_bytes(cfg, B, T, "none+offload") == max(F + A, 2 * A)
    assert predicted_host_bytes(cfg, B, T, "none+offload") == L * A
    # every:C: a segment's C layers recomputed (its checkpoint among them); the next checkpoint comes back
    # while the segment's first layer runs its backward, when the others are gone already
    assert predicted_peak_bytes(cfg, B, T, "every:2+offload") == max(F + X, 2 * A, A + X)
    assert predicted_host_bytes(cfg, B, T, "every:2+offload") == 2 * X


def test_store_host_tier_counts_and_events():
    store = ActivationStore(host=HostTier("cpu"))
    store.host.rule = lambda layer, name: name == "a"
    a, b = torch.ones(4, 8), torch.zeros(2, 8)
    store.put(0, "a", a)
    store.put(0, "b", b)
    assert (store.bytes, store.host_bytes) == (b.nbytes, a.nbytes)
    assert [(e.kind, e.where, e.live_bytes, e.host_bytes) for e in store.events] == [
        ("put", "host", 0, 128), ("put", "device", 64, 128)]
    a[0, 0] = 5  # the host copy is a real copy, made at the put
    store.prefetch(0)
    assert (store.bytes, store.host_bytes) == (a.nbytes + b.nbytes, 0)
    assert store.pop(0, "a").sum().item() == 32 and store.events[-2].kind == "prefetch"
    store.host.rule = lambda layer, name: True
    store.put(1, "c", b)
    assert store.has(1, "c") and store.names(1) == ["c"]
    assert torch.equal(store.get(1, "c"), b) and store.events[-2].kind == "fetch"  # never prefetched: fetched then


def test_three_action_plan_is_never_slower_and_strictly_faster_at_realistic_rates():
    """A Llama-3-8B-like layer (bf16, fused attention, 1 x 2048 tokens) at the defaults: PCIe Gen5 x16, H200 BF16."""
    cfg = Config(vocab=128256, hidden=4096, layers=4, heads=32, kv_heads=8, ffn=14336, max_seq=2048, dtype="bfloat16",
                 attention="fused")
    chain = model_chain(cfg, 1, 2048)
    least, none = least_budget(chain), predicted_peak_bytes(cfg, 1, 2048, "none")
    faster = 0
    for step in range(9):
        plan = plan_offload(cfg, 1, 2048, least + (none - least) * step // 8)
        assert plan.peak_bytes <= plan.budget
        assert plan.walk.seconds <= plan.two_action_walk.seconds
        faster += plan.walk.seconds < plan.two_action_walk.seconds
    assert faster >= 3


def test_planned_offload_replays_exactly_in_the_engine():
    cfg, params, ids, targets = setup()
    chain = model_chain(cfg, B, T)
    none = predicted_peak_bytes(cfg, B, T, "none")
    plan = plan_offload(cfg, B, T, (least_budget(chain) + none) // 2, bandwidth=1e10, rate=1e11)  # a slow device
    assert plan.walk.host_peak > 0 and plan.walk.seconds < plan.two_action_walk.seconds
    torch.manual_seed(0)
    base = loss_and_grads(params, cfg, ids, targets, "none")[1]
    with Tracker("cpu", flops=False) as tracker, torch.no_grad():
        step = Step(Model(params, cfg, ids, targets), plan.schedule, frozenset(), tracker)
        step.forward()
        grads = step.backward()
    assert (tracker.peak_logical, tracker.peak_host) == (plan.peak_bytes, plan.walk.host_peak)
    assert all(torch.equal(grads[k], base[k]) for k in base)
    assert walk(chain, plan.schedule, model_costs(cfg, B, T), 1e10, 1e11) == plan.walk


def test_measure_row_and_plan_json(capsys):
    cfg = Config.from_preset("tiny", layers=2)
    row = measure_policy(cfg, "offload", 2, 16, repeats=1)
    assert row["peak_activation_bytes"] == row["predicted_activation_bytes"]
    assert row["host_peak_bytes"] == row["predicted_host_bytes"] > 0
    assert row["copy_bytes"]["forward"]["to_host"] == row["predicted_copy_bytes"]["to_host"]
    assert row["modelled_exposed_copy_seconds"] >= 0 and "measured_exposed_copy_seconds" not in row  # CPU: modelled
    main(["plan", "--preset", "tiny", "--batch", "2", "--seq", "16", "--budget", "60KiB", "--host-bandwidth", "1e9",
          "--compute-rate", "1e10", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["peak_bytes"] <= 60 * 1024 and len(out["layers"]) == 2
    assert all(layer["action"] and layer["why"] for layer in out["layers"])


@pytest.mark.parametrize("policy,words", [
    ("every:2+offload:mlp.gate", "nowhere to offload"), ("selective+offload:attn.probs", "nowhere to offload"),
    ("offload:attn.nonsense", "never stores"), ("offload+offload", "twice"), ("offload:", "names separated")])
def test_offload_with_nowhere_to_offload_is_refused(policy, words):
    with pytest.raises(ValueError, match=words):
        parse_policy(policy, Config.from_preset("tiny"))


def test_probabilities_are_nowhere_under_fused_attention():
    with pytest.raises(ValueError, match="never stores"):
        parse_policy("offload:attn.probs", Config.from_preset("tiny", attention="fused"))


@pytest.mark.parametrize("bandwidth,rate", [(0, 1e12), (-1.0, 1e12), (6e10, 0), (6e10, float("inf"))])
def test_bandwidth_and_rate_must_be_positive(bandwidth, rate):
    with pytest.raises(ValueError, match="positive"):
        check_rates(bandwidth, rate)


def test_plan_cli_refuses_a_zero_bandwidth(capsys):
    assert main(["plan", "--preset", "tiny", "--budget", "1MiB", "--host-bandwidth", "0"]) != 0
    assert "--host-bandwidth=0" in capsys.readouterr().err


def test_compare_puts_save_on_cpu_beside_the_offload_policies():
    from picockpt.measurement.compare import compare
    names = ["picockpt full+offload", "picockpt none+offload", "autograd + save_on_cpu",
             "torch checkpoint per layer + save_on_cpu"]
    rows = {r["name"]: r for r in compare(Config.from_preset("tiny"), 2, 16, repeats=1, log=None, only=names)}
    assert all(rows[name]["grad_ok"] and rows[name]["host_peak_bytes"] > 0 for name in names)
    host = {name: rows[name]["host_peak_bytes"] for name in names}
    assert host["torch checkpoint per layer + save_on_cpu"] == host["picockpt full+offload"]  # the L layer inputs
    assert rows["autograd"]["host_peak_bytes"] == rows["picockpt none"]["host_peak_bytes"] == 0

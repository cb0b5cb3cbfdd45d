"""The cost model (picockpt/planning/cost.py) against hand calculations, the planner priced by it, and plan --cost."""
import json
import os
import subprocess
import sys

import pytest

from picockpt import Config
from picockpt.cli import main
from picockpt.planning.layer_forms import layer_flops
from picockpt.planning.cost import (HARDWARE, Op, bubble_idle, layer_ops, plan_priced, price_chain, roofline_op_seconds,
                           roofline_seconds)
from picockpt.planning.hardware import H100_SXM_BF16, H100_SXM_HBM
from picockpt.planning.op_times import layer_op_calls
from picockpt.planning.planner import least_budget, model_chain, plan_chain, replay

H100 = HARDWARE["h100"]


def test_roofline_takes_the_slower_of_math_and_memory_per_kernel():
    matmul, elementwise = (2e12, 1e9), (0, 6e9)  # 2.02 ms of math vs 0.30 ms of bytes; 0 vs 1.79 ms
    op = Op("two", (matmul, elementwise))
    assert roofline_seconds(op, H100) == pytest.approx(2e12 / H100_SXM_BF16 + 6e9 / H100_SXM_HBM, rel=1e-12)
    assert op.flops == 2e12 and op.bytes == 7e9


@pytest.mark.parametrize("attention", ["eager", "fused", "tiled"])
@pytest.mark.parametrize("t", [1, 2])
def test_layer_ops_count_the_layers_matmul_flops(attention, t):
    cfg = Config.from_preset("small", attention=attention)
    ops = layer_ops(cfg, 4, 64, t=t, sp=t > 1)
    forward = [op for op in ops if op.name != "probs"]
    assert sum(op.flops for op in forward) == sum(layer_flops(cfg, 4, 64).values()) // t
    assert [op.name for op in forward] == [name for name in layer_op_calls(cfg, 1, 8, "cpu") if name not in (
        "final_norm", "logits", "loss", "probs")]  # the measured profile times the same ops
    swiglu = next(op for op in ops if op.name == "swiglu")  # reads gate and up, writes their product
    assert swiglu.bytes == 3 * 4 * 4 * 64 * (cfg.ffn // t) and swiglu.flops == 0


def test_bubble():
    assert bubble_idle(16, 16) == 15 / 31  # 48%: Llama 3's p = 16 with 16 micro-batches under plain 1F1B
    assert bubble_idle(16, 16, "interleaved", 2) == 15 / 47
    assert bubble_idle(1, 8) == 0


def _budgets(chain, n=25):
    lo, hi = least_budget(chain), sum(max(a for _, a, _ in s.variants) for s in chain)
    return sorted({lo + (hi - lo) * i // (n - 1) for i in range(n)})


@pytest.mark.parametrize("attention", ["eager", "fused"])
def test_a_profile_proportional_to_flops_gives_the_flop_plans(attention):
    cfg, B, T = Config.from_preset("small", attention=attention), 2, 64
    ops = layer_ops(cfg, B, T)
    seconds = {op.name: op.flops * 1e-12 for op in ops}
    seconds.update(final_norm=0.0, logits=1.0, loss=0.0)
    chain = model_chain(cfg, B, T)
    priced = price_chain(chain, cfg, B, T, seconds)
    for budget in _budgets(chain):
        by_flops, by_time = plan_chain(chain, budget), plan_priced(chain, priced, budget)
        assert by_time.recompute_flops == by_flops.recompute_flops
        assert by_time.recompute_seconds == pytest.approx(by_flops.recompute_flops * 1e-12)


PRICED = """
from dataclasses import replace
from picockpt import Config
from picockpt.planning.cost import HARDWARE, price_chain, roofline_op_seconds
from picockpt.planning.planner import model_chain
cfg, hw = Config.from_preset("small", layers=4), replace(HARDWARE["h100"], matmul=2e11, memory=2e10)
seconds = roofline_op_seconds(cfg, 2, 64, hw)
seconds["swiglu"] *= 100  # cheap's three rebuilding ops: a sum whose order shows in its last bit
chain = price_chain(model_chain(cfg, 2, 64), cfg, 2, 64, seconds)
print([float(r).hex() for stage in chain for _, _, r in stage.variants])
"""


def test_priced_chains_are_the_same_to_the_last_bit_under_every_hash_seed():
    """A set's order follows Python's hash seed: a rebuild's seconds summed over one would round differently from
    run to run, and break the planner's ties differently."""
    runs = [subprocess.Popen([sys.executable, "-c", PRICED], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}) for seed in ("0", "2")]  # side by side
    printed = [run.communicate(timeout=120)[0] for run in runs]
    assert all(run.returncode == 0 for run in runs) and printed[0] and printed[0] == printed[1]


def test_dear_elementwise_ops_change_the_plan_and_the_priced_plan_is_never_dearer():
    cfg, B, T = Config.from_preset("small", attention="fused"), 2, 64
    seconds = roofline_op_seconds(cfg, B, T, H100)
    seconds.update(swiglu=seconds["swiglu"] * 100, attn_norm=seconds["attn_norm"] * 100,
                   mlp_norm=seconds["mlp_norm"] * 100)  # rebuilding cheap's drops is now dear
    chain = model_chain(cfg, B, T)
    priced = price_chain(chain, cfg, B, T, seconds)
    differ = 0
    for budget in _budgets(chain):
        by_flops, by_time = plan_chain(chain, budget), plan_priced(chain, priced, budget)
        assert by_time.peak_bytes <= budget and by_time.recompute_flops >= by_flops.recompute_flops
        assert by_time.recompute_seconds <= replay(priced, by_flops.schedule)[1] * (1 + 1e-12)
        differ += by_time.schedule != by_flops.schedule
    assert differ > 0


def test_plan_cost_measured_uses_the_measured_profile(monkeypatch, capsys):
    import picockpt.planning.op_times as op_times
    from picockpt.planning.op_times import Profile
    cfg = Config.from_preset("small", attention="fused")
    roof = roofline_op_seconds(cfg, 2, 64, H100)
    args = ["plan", "--budget", "6MiB", "--batch", "2", "--seq", "64", "--attention", "fused", "--json"]
    assert main(args) == 0
    flops = json.loads(capsys.readouterr().out)
    dear = {**roof, "swiglu": roof["swiglu"] * 100, "attn_norm": roof["attn_norm"] * 100,
            "mlp_norm": roof["mlp_norm"] * 100}
    monkeypatch.setattr(op_times, "measure_op_seconds",
                        lambda *a, **k: Profile(dear, {n: (v, v) for n, v in dear.items()}, "cpu", 7))
    assert main(args + ["--cost", "measured", "--device", "cpu"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["op_seconds"] == dear and measured["cost"] == "measured"
    assert measured["forward"] != flops["forward"] and not measured["flops_plan"]["same_schedule"]
    assert measured["flops_plan"]["recompute_flops"] == flops["recompute_flops"] <= measured["recompute_flops"]
    assert measured["recompute_seconds"] < measured["flops_plan"]["recompute_seconds"]


@pytest.mark.parametrize("flags,message", [
    (["--hardware", "h100"], "--hardware h100: only --cost roofline reads it"),
    (["--cost", "roofline", "--compute-rate", "1e12"], "--compute-rate with --cost roofline"),
    (["--cost", "measured", "--hardware", "h100"], "--hardware h100 with --cost measured"),
    (["--cost", "roofline", "--experts", "4", "--experts-per-token", "2"], "--experts 4"),
    (["--cost", "roofline", "--device", "cpu"], "--device"),
])
def test_plan_cost_refuses_what_it_would_ignore(flags, message, capsys):
    assert main(["plan", "--budget", "6MiB", *flags]) != 0
    assert message in capsys.readouterr().err


def test_the_offload_planner_times_compute_by_the_same_prices():
    """Its walk's compute clock is the priced chain's: every layer's forward and backward (2x), the head's, and the
    recompute, in seconds; the FLOPs it reports stay exact."""
    from picockpt.planning.planner_offload import plan_offload
    cfg, B, T = Config.from_preset("small", attention="fused"), 2, 64
    prices = roofline_op_seconds(cfg, B, T, H100)
    chain = model_chain(cfg, B, T)
    priced = price_chain(chain, cfg, B, T, prices)
    budget = (least_budget(chain) + sum(max(a for _, a, _ in s.variants) for s in chain)) // 2
    plan = plan_offload(cfg, B, T, budget, seconds=tuple(sorted(prices.items())))
    layer, head = priced[0].forward_flops, sum(prices[n] for n in ("final_norm", "logits", "loss"))
    recompute = replay(priced, plan.schedule)[1]
    assert plan.walk.compute_seconds == pytest.approx(cfg.layers * 3 * layer + 3 * head + recompute)
    assert plan.recompute_flops == replay(chain, plan.schedule)[1]


def test_replay_counts_the_heads_rebuild_as_the_recurrence_does():
    """A head stored "all:cheap" drops the final norm's output: free in FLOPs, its op's seconds in a priced chain;
    replay (what a plan's recompute_seconds and the FLOP plan's price come from) counts it as the recurrence does."""
    from picockpt.recompute.schedule import Schedule
    cfg, B, T = Config.from_preset("small", attention="fused"), 2, 64
    chain = model_chain(cfg, B, T)
    seconds = roofline_op_seconds(cfg, B, T, H100)
    priced = price_chain(chain, cfg, B, T, seconds)
    cheap, plain = (Schedule(forward=("all",) * cfg.layers, head=head, stop_early=True) for head in ("all:cheap", "all"))
    assert replay(priced, cheap)[1] == pytest.approx(replay(priced, plain)[1] + seconds["final_norm"])
    assert replay(chain, cheap)[1] == replay(chain, plain)[1]  # FLOPs: the norm is elementwise
    for budget in _budgets(chain, 16):  # what plan_priced minimised is what replay prices
        plan = plan_priced(chain, priced, budget)
        assert plan.recompute_seconds == pytest.approx(replay(priced, plan.schedule)[1])
        assert plan.recompute_seconds <= replay(priced, plan_chain(chain, budget).schedule)[1] * (1 + 1e-9)

"""The memory explorer (lessons/00_memory_explorer, lessons/_explorer.py): every number it shows is a
closed form of picockpt's, and its widgets' callbacks show the numbers of the setup they are set to."""
import sys

import pytest

from picockpt.device import step_bytes
from picockpt.inventory import predicted_peak_bytes, step_flops
from picockpt.parallel.inventory import rank_chain, rank_peak_bytes
from picockpt.planner import least_budget, model_chain, plan_chain
from picockpt.reproduce import LESSONS, run_percent

sys.path.insert(0, str(LESSONS))
from _explorer import (CAPACITIES, GIB, PARTS, Setup, cheapest_fit, gib, memory_parts, segment_curve,  # noqa: E402
                       shape_of, stage_config)

STORED = PARTS[3:7]  # stored activations, checkpoints, the segment being recomputed, the head


def stored(parts):
    return sum(parts[part] for part in STORED)


@pytest.mark.parametrize("model", ["tiny", "small", "llama3-8b", "mixtral-8x7b"])
@pytest.mark.parametrize("policy", ["none", "full", "every:2", "selective", "cheap", "every:2+selective"])
def test_stored_activations_are_predicted_peak_bytes(model, policy):
    setup = Setup(model=model, seq=64 if model in ("tiny", "small") else 4096, batch=2)
    cfg = stage_config(setup)
    assert stored(memory_parts(setup, policy)) == predicted_peak_bytes(cfg, 2, setup.seq, policy)


@pytest.mark.parametrize("policy", ["none", "full", "selective", "every:4+cheap"])
@pytest.mark.parametrize("tp,sp", [(2, False), (8, True)])
def test_stored_activations_per_rank_are_rank_peak_bytes(policy, tp, sp):
    setup = Setup(model="llama3-70b", **shape_of("llama3-70b"), seq=8192, tp=tp, sp=sp)
    cfg = stage_config(setup)
    assert stored(memory_parts(setup, policy)) == rank_peak_bytes(cfg, 1, 8192, policy, tp, sp)


def test_model_states_working_memory_and_the_multipliers():
    setup = Setup(model="llama3-8b", seq=8192, dtype="bf16")
    cfg = stage_config(setup)
    parts = memory_parts(setup, "full")
    parameters = cfg.num_params()
    assert (parts["weights"], parts["gradients"], parts["optimizer state"]) == (6 * parameters, 4 * parameters,
                                                                                  8 * parameters)
    assert parts["working memory"] == step_bytes(cfg, 1, 8192, "full")["working"]  # device.py's estimate
    zero = memory_parts(setup.replace(dp=8, zero=2), "full")
    assert (zero["weights"], zero["gradients"], zero["optimizer state"]) == (6 * parameters, 4 * parameters // 8,
                                                                             8 * parameters // 8)
    piped = memory_parts(setup.replace(stages=4, in_flight=3), "full")
    quarter = stage_config(setup.replace(stages=4))
    assert quarter.layers == 8
    assert stored(piped) == 3 * predicted_peak_bytes(quarter, 1, 8192, "full")


def test_the_segment_curve_is_every_c():
    setup = Setup(model="llama3-8b", seq=4096, op_level="selective")
    cfg = stage_config(setup)
    curve = segment_curve(setup)
    assert list(curve) == list(range(1, 33))
    assert curve == {C: predicted_peak_bytes(cfg, 1, 4096, f"every:{C}+selective") for C in curve}


def test_the_cheapest_fit_is_the_planners():
    setup = Setup(model="llama3-8b", seq=8192, dp=8, zero=3, capacity=CAPACITIES["80 GB (A100, H100)"])
    fit = cheapest_fit(setup)
    others = sum(memory_parts(setup, "full")[part] for part in ("weights", "gradients", "optimizer state",
                                                               "working memory"))
    assert fit["room"] == setup.capacity - others
    chain = model_chain(stage_config(setup), 1, 8192)
    assert fit["least"] == least_budget(chain)
    assert fit["plan"].recompute_flops == plan_chain(chain, fit["room"]).recompute_flops
    assert fit["plan"].peak_bytes <= fit["room"]
    fitting = {policy: row for policy, row in fit["named_rows"].items() if row[0] <= fit["room"]}
    assert fit["named"] == "cheap" == min(fitting, key=lambda policy: fitting[policy][1:] + fitting[policy][:1])
    assert fit["named_rows"]["selective"][0] > fit["room"]  # it would be cheaper, and does not fit
    assert fit["model_flops"] == sum(step_flops(stage_config(setup), 1, 8192).values())
    tight = cheapest_fit(setup.replace(model="llama3-70b", **shape_of("llama3-70b"), dp=1, zero=0))
    assert tight["plan"] is None and tight["named"] is None and tight["room"] < 0


def test_bad_setups_say_why():
    with pytest.raises(ValueError) as error:
        memory_parts(Setup(model="mixtral-8x7b", tp=2))
    assert str(error.value).startswith("Config.experts=8: tensor parallelism here splits the dense MLP")
    with pytest.raises(ValueError) as error:
        memory_parts(Setup(model="llama3-8b", stages=40))
    assert str(error.value) == "stages=40: use 1 to L=32 pipeline stages"
    with pytest.raises(ValueError) as error:
        memory_parts(Setup(model="llama3-8b", dp=8, zero=4))
    assert str(error.value) == "dp=8, zero=4: use dp >= 1 and a ZeRO stage 0, 1, 2 or 3"


@pytest.fixture(scope="module")
def explorer():
    """The explorer notebook's cells, run as a script (no kernel: the widgets work, nothing is drawn)."""
    namespace = run_percent(LESSONS / "00_memory_explorer.py", ["--fast", "--device", "cpu"])
    return namespace


def test_the_widgets_show_the_closed_forms(explorer, monkeypatch):
    controls, readout = explorer["controls"], explorer["readout"]
    start = explorer["current_setup"]()
    assert start == Setup(model="llama3-8b", seq=8192, dp=8, zero=3, capacity=80 * GIB)
    total = sum(memory_parts(start).values())
    assert f"<b>{gib(total)}</b>" in readout.value and "does not fit" in readout.value

    controls["seq"].value = 16384
    controls["layer_level"].value = "full"
    setup = explorer["current_setup"]()
    assert (setup.seq, setup.policy) == (16384, "full")
    parts = memory_parts(setup)
    cfg = stage_config(setup)
    assert stored(parts) == predicted_peak_bytes(cfg, 1, 16384, "full")
    assert f"<b>{gib(sum(parts.values()))}</b>" in readout.value
    assert f"<td>segment being recomputed</td><td style='text-align:right'>{gib(parts['segment being recomputed'])}" \
        in readout.value

    controls["model"].value = "llama3-70b"  # a preset fills the shape fields, once
    assert (controls["layers"].value, controls["hidden"].value, controls["layers"].disabled) == (80, 8192, True)
    controls["tp"].value = 8
    controls["sp"].value = True
    setup = explorer["current_setup"]()
    rank = rank_peak_bytes(stage_config(setup), 1, 16384, "full", 8, True)
    assert stored(memory_parts(setup)) == rank
    assert f"<b>{gib(sum(memory_parts(setup).values()))}</b>" in readout.value

    controls["layer_level"].value = "budget"
    fit = cheapest_fit(explorer["current_setup"]())
    assert fit["plan"] is not None
    assert f"<b>budget:{fit['plan'].peak_bytes}</b>" in readout.value
    assert fit["plan"].recompute_flops == plan_chain(rank_chain(stage_config(setup), 1, 16384, 8, True),
                                                     fit["room"]).recompute_flops

    controls["gpu"].value = "custom"
    assert not controls["custom_gib"].disabled
    controls["custom_gib"].value = 8.0
    assert "nothing fits: even the least feasible schedule stores" in readout.value

    controls["model"].value = "custom"  # an impossible shape: the reason, in red, instead of numbers
    controls["heads"].value = 7
    assert readout.value.startswith("<p style='color:#C44E52'>Config.hidden=8192 is not divisible by heads=7")

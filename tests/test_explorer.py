"""The memory explorer (lessons/01_memory_explorer, lessons/_explorer.py): every number it shows is a
closed form of picockpt's, and its widgets' callbacks show the numbers of the setup they are set to."""
import sys

import pytest

from picockpt.planning.fit import step_bytes
from picockpt.planning.step_forms import predicted_peak_bytes, step_flops
from picockpt.parallel.tensor_parallel.tp_forms import rank_chain, rank_peak_bytes
from picockpt.planning.planner import least_budget, model_chain, plan_chain
from picockpt.teaching.reproduce import LESSONS, run_percent

sys.path.insert(0, str(LESSONS))
from _explorer import (CAPACITIES, GIB, STORED, WORKING_T2_BYTES, Setup, cheapest_fit, gib, headline,  # noqa: E402
                       memory_parts, model_config, model_state_by_stage, segment_curve, shape_of, stage_config,
                       working_margin, zero_text)
from picockpt import Config, init_params, loss_and_grads  # noqa: E402
from picockpt.measurement.measure import make_batch  # noqa: E402
from picockpt.parallel.pipeline_parallel.pp_forms import ChunkForms  # noqa: E402
from picockpt.measurement.tracker import Tracker  # noqa: E402
from picockpt.parallel import Layout


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
    quarter = stage_config(setup.replace(stages=4))
    assert quarter.layers == 8


@pytest.mark.parametrize("policy", ["none", "full", "every:3+selective", "budget"])
@pytest.mark.parametrize("model,parallel", [("llama3-8b", {}), ("llama3-70b", dict(tp=8, sp=True))])
def test_a_pipeline_stage_stores_w_minus_one_E_plus_its_own_peak(policy, model, parallel):
    """Stage 0 of 1F1B as lesson 16 measures it, (w - 1)·E + one micro-batch's peak: the pipeline's own closed
    form (ChunkForms), to the byte, for the fixed policies and for the planner at the explorer's room."""
    setup = Setup(model=model, **shape_of(model), seq=4096, stages=4, in_flight=4, capacity=80 * GIB, **parallel)
    t, sp = parallel.get("tp", 1), parallel.get("sp", False)
    if policy == "budget":
        fit = cheapest_fit(setup)
        policy = f"budget:{fit['room']}"
        assert fit["plan"].peak_bytes <= fit["room"]
        assert stored(memory_parts(setup, "budget")) == fit["plan"].peak_bytes
    forms = ChunkForms(model_config(setup), 8, 4096, policy, Layout(pp=4, tp=t, microbatches=8, sp=sp), 0)
    assert forms.in_flight == setup.in_flight
    if not policy.startswith("budget"):
        assert stored(memory_parts(setup, policy)) == forms.peak_bytes
    else:
        assert cheapest_fit(setup)["plan"].recompute_flops == forms.recompute_flops


def working_square_term(dtype):
    """Bytes per B·H·T² element of the engine's working memory at its live peak (CPU), from the second
    difference over T = 128, 256, 384: exact for a quadratic."""
    cfg = Config(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64, max_seq=384, dtype=dtype)
    params, working = init_params(cfg, seed=0), []
    for T in (128, 256, 384):
        ids, targets = make_batch(cfg, 1, T, "cpu", 0)
        with Tracker("cpu", flops=False) as tracker:
            loss_and_grads(params, cfg, ids, targets, "full", tracker=tracker)
        peak = max(tracker.timeline, key=lambda event: event["physical"])
        working.append(peak["physical"] - peak["logical"])
    return (working[2] - 2 * working[1] + working[0]) / (2 * 128**2) / cfg.heads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_working_memory_margin_is_measured_per_dtype(dtype):
    assert working_square_term(dtype) == WORKING_T2_BYTES[dtype]
    cfg = stage_config(Setup(model="llama3-8b", seq=8192, dtype=dtype))
    assert working_margin(cfg, 1, 8192) == pytest.approx(16 / WORKING_T2_BYTES[dtype] - 1)  # the estimate errs high
    assert working_margin(cfg.replace(attention="fused"), 1, 8192) is None  # no T x T term to compare


def test_the_segment_curve_is_every_c():
    setup = Setup(model="llama3-8b", seq=4096, op_level="selective")
    cfg = stage_config(setup)
    curve = segment_curve(setup)
    assert list(curve) == list(range(1, 33))
    assert curve == {C: predicted_peak_bytes(cfg, 1, 4096, f"every:{C}+selective") for C in curve}


def test_the_cheapest_fit_is_the_planners():
    setup = Setup(model="llama3-8b", seq=8192, dp=8, zero=3, capacity=CAPACITIES["80 GiB (A100, H100)"])
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
    assert str(error.value).startswith("Config.experts=8: these tensor-parallel closed forms split the dense MLP")
    with pytest.raises(ValueError) as error:
        memory_parts(Setup(model="llama3-8b", stages=40))
    assert str(error.value) == "stages=40: use 1 to L=32 pipeline stages"
    with pytest.raises(ValueError) as error:
        memory_parts(Setup(model="llama3-8b", dp=8, zero=4))
    assert str(error.value) == "dp=8, zero=4: use dp >= 1 and a ZeRO stage 0, 1, 2 or 3"


@pytest.fixture(scope="module")
def explorer():
    """The explorer notebook's cells, run as a script (no kernel: the widgets work, nothing is drawn)."""
    namespace = run_percent(LESSONS / "01_memory_explorer.py", ["--fast", "--device", "cpu"])
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


def test_the_zero_stage_is_explicit_and_named():
    setup = Setup(model="llama3-8b", seq=8192, dp=8, zero=3)
    parameters = stage_config(setup).num_params()
    by_stage = model_state_by_stage(setup)  # 6 + 4 + 8 bytes a parameter, each part over 8 from its stage on
    assert by_stage == {0: 18 * parameters, 1: 10 * parameters + 8 * parameters // 8,
                        2: 6 * parameters + 4 * parameters // 8 + 8 * parameters // 8,
                        3: 6 * parameters // 8 + 4 * parameters // 8 + 8 * parameters // 8}
    assert by_stage[3] == sum(memory_parts(setup)[part] for part in ("weights", "gradients", "optimizer state"))
    assert zero_text(setup) == "ZeRO-3 over 8 data-parallel ranks (weights, gradients and optimizer state sharded, " \
                               "as FSDP)"
    assert headline(setup).endswith(", ZeRO-3 over 8") and headline(setup.replace(zero=0)).endswith(", no ZeRO")
    assert zero_text(setup.replace(dp=1)).startswith("ZeRO-3 over 1 rank (nothing sharded")
    assert model_state_by_stage(setup.replace(dp=1)) == dict.fromkeys(range(4), 18 * parameters)

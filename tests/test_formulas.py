"""The published formulas: the Playbook's Llama 3.1 figures, Table 2's variants, the FLOP counts,
Chen's optimum, and the measured U-curve of every:C against picockpt's exact formula."""
import math
from fractions import Fraction

import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.model.attention_flops import ATTENTION_FLOPS
from picockpt.model.config import PRESETS
from picockpt.planning.published import (GIB, PLAYBOOK_PUBLISHED_GIB, PLAYBOOK_WIDGET_PRESET, chen_memory, chen_optimum,
                               exact_segment_curve, korthikanti_flops, korthikanti_layer_bytes,
                               playbook_activation_bytes, playbook_widget_bytes)
from picockpt.planning.step_forms import chain_sizes, layer_inventory, step_flops, total
from picockpt.measurement.measure import make_batch, measured_inventory
from picockpt.recompute.policy import SELECTIVE
from picockpt.measurement.tracker import Tracker


@pytest.fixture
def one_thread():
    """Tiny tensors: extra threads only add overhead (and fight the other processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the Ultra-Scale Playbook's Llama 3.1 charts ---------------------------------------------------
@pytest.mark.parametrize("model,recompute", list(PLAYBOOK_PUBLISHED_GIB))
def test_playbook_llama31_figures(model, recompute):
    shape = PRESETS[model]
    for seq, published in PLAYBOOK_PUBLISHED_GIB[model, recompute].items():
        ours = playbook_activation_bytes(shape["layers"], seq, 1, shape["hidden"], shape["heads"], recompute) / GIB
        assert ours == pytest.approx(published, rel=0.005)   # within the charts' rounding
        assert ours == pytest.approx(published, rel=1e-12)   # in fact the same number


def test_the_three_quoted_8b_figures():
    L, h, a = 32, 4096, 32
    quoted = {"none": 97.02, "selective": 17.02, "full": 1.02}
    for recompute, gib in quoted.items():
        assert round(playbook_activation_bytes(L, 4096, 1, h, a, recompute) / GIB, 2) == gib


def test_widget_preset_is_the_61_gb():
    parts = playbook_widget_bytes(**PLAYBOOK_WIDGET_PRESET)
    assert round(parts["total"] / GIB, 2) == 61.09
    assert parts["layers"] == 60 * GIB  # 32 layers of exactly 1.875 GiB at this shape
    assert parts["total"] == parts["layers"] + sum(parts[k] for k in ("embedding_dropout", "final_norm",
                                                                      "projection", "cross_entropy_fp32_logits"))
    full = playbook_widget_bytes(**{**PLAYBOOK_WIDGET_PRESET, "recomputation": "full"})
    assert full["layers"] == 2 * 256 * 32 * 4096 * 32  # only the layer inputs, 2sbh each


# ---- Korthikanti et al. 2022, Table 2 --------------------------------------------------------------
def table_2(s, b, h, a, t, row):
    """Table 2 as printed, in exact fractions."""
    sbh, t = s * b * h, Fraction(t)
    return {"none": sbh * (34 + Fraction(5 * a * s, h)),
            "tp": sbh * (10 + 24 / t + Fraction(5 * a * s, h) / t),
            "tp+sp": sbh * (34 / t + Fraction(5 * a * s, h) / t),
            "tp+selective": sbh * (10 + 24 / t),
            "tp+sp+selective": sbh * 34 / t,
            "full": 2 * sbh}[row]


@pytest.mark.parametrize("s,b,h,a,t", [(2048, 1, 12288, 96, 8), (4096, 2, 4096, 32, 4), (1000, 3, 768, 12, 3)])
def test_korthikanti_variants_match_table_2(s, b, h, a, t):
    assert korthikanti_layer_bytes(s, b, h, a) == table_2(s, b, h, a, 1, "none")
    assert korthikanti_layer_bytes(s, b, h, a, t) == table_2(s, b, h, a, t, "tp")
    assert korthikanti_layer_bytes(s, b, h, a, t, sp=True) == table_2(s, b, h, a, t, "tp+sp")
    assert korthikanti_layer_bytes(s, b, h, a, t, recompute="selective") == table_2(s, b, h, a, t, "tp+selective")
    assert korthikanti_layer_bytes(s, b, h, a, t, True, "selective") == table_2(s, b, h, a, t, "tp+sp+selective")
    assert korthikanti_layer_bytes(s, b, h, a, t, recompute="full") == table_2(s, b, h, a, t, "full")


def test_korthikanti_variants_relations():
    s, b, h, a, t = 4096, 1, 8192, 64, 8
    sbh, core = s * b * h, 5 * a * s * s * b
    none = korthikanti_layer_bytes(s, b, h, a)
    assert none == 34 * sbh + core
    for sp in (False, True):  # t = 1: parallelism changes nothing
        assert korthikanti_layer_bytes(s, b, h, a, 1, sp) == none
    # selective drops exactly the attention core (its t-th part under tensor parallelism)
    assert korthikanti_layer_bytes(s, b, h, a, t) - korthikanti_layer_bytes(s, b, h, a, t, recompute="selective") \
        == core / t
    # sequence parallelism splits the 10sbh tensor parallelism leaves replicated
    assert korthikanti_layer_bytes(s, b, h, a, t) - korthikanti_layer_bytes(s, b, h, a, t, sp=True) \
        == 10 * sbh * (1 - 1 / t)
    assert korthikanti_layer_bytes(s, b, h, a, t, sp=True) == none / t
    assert korthikanti_layer_bytes(s, b, h, a, t, recompute="full") == 2 * sbh
    assert korthikanti_layer_bytes(s, b, h, a, t, sp=True, recompute="full") == 2 * sbh / t
    with pytest.raises(ValueError, match="recompute='some'"):
        korthikanti_layer_bytes(s, b, h, a, recompute="some")
    with pytest.raises(ValueError, match="t=0"):
        korthikanti_layer_bytes(s, b, h, a, t=0)


def gpt_shaped(**overrides):
    """A picockpt layer shaped like the paper's: multi-head attention, dropout, 16-bit, and a SwiGLU of
    width f = 8h/3, whose three f-wide tensors take the bytes of GeLU's two 4h-wide ones."""
    return Config(**{**dict(vocab=64, hidden=48, layers=2, heads=4, kv_heads=4, ffn=128, max_seq=64,
                            dropout=0.1, dtype="bf16"), **overrides})


@pytest.mark.parametrize("policy,extra_per_element", [("none", 0), ("selective", 1)])
def test_a_layer_shaped_like_the_paper_measures_korthikanti(policy, extra_per_element):
    """Measured: Korthikanti's bytes, plus RMSNorm's two fp32 statistics per token (8 bytes), plus,
    under selective, the 1-byte dropout mask of the probabilities that picockpt keeps (it replays
    the mask from it; Megatron replays the random generator instead)."""
    cfg, s, b = gpt_shaped(), 32, 2
    stored = measured_inventory(cfg, b, s, policy)
    layer_0 = sum(nbytes for (layer, _), nbytes in stored.items() if layer == 0)
    expected = korthikanti_layer_bytes(s, b, cfg.hidden, cfg.heads, recompute=policy) + 8 * s * b
    assert layer_0 == expected + extra_per_element * cfg.heads * s * s * b


def test_llama3_8b_selective_layer_is_34_sbh_plus_the_statistics():
    """For Llama 3 8B the differences cancel: GQA -3sbh, SwiGLU +5sbh, no dropout masks -2sbh."""
    cfg, s = Config.from_preset("llama3-8b", dtype="bf16"), 4096
    ours = total(layer_inventory(cfg, 1, s, SELECTIVE))
    assert ours == korthikanti_layer_bytes(s, 1, cfg.hidden, cfg.heads, recompute="selective") + 8 * s


# ---- FLOPs -----------------------------------------------------------------------------------------
def test_korthikanti_flops_closed_forms():
    L, s, b, h, V = 96, 2048, 1, 12288, 51200  # GPT-3 175B
    model = korthikanti_flops(L, s, b, h, V)
    assert model["forward"] + model["backward"] == pytest.approx(
        72 * b * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L)), rel=1e-12)
    full = korthikanti_flops(L, s, b, h, V, "full")
    assert sum(full.values()) == pytest.approx(96 * b * L * s * h * h * (1 + s / (6 * h) + V / (16 * h * L)),
                                               rel=1e-12)
    assert 0.30 < full["recompute"] / (full["forward"] + full["backward"]) < 1 / 3  # one forward, minus the head


def test_gpt_shaped_picockpt_flops_are_korthikanti_measured(one_thread):
    """FlopCounterMode on a GPT-shaped picockpt model counts exactly the paper's forward, backward and
    full-recompute FLOPs; picockpt's selective rebuild does half the paper's (q k^T only: it keeps
    the attention's output, Megatron recomputes the whole core including P v)."""
    cfg, b, s = gpt_shaped(dropout=0.0, dtype="float32"), 2, 16
    params = init_params(cfg, seed=0)
    input_ids, targets = make_batch(cfg, b, s, "cpu", 0)
    for policy, recompute in (("full", "full"), ("selective", "selective")):
        with Tracker("cpu", physical=False) as tracker:
            loss_and_grads(params, cfg, input_ids, targets, policy, tracker=tracker)
        paper = korthikanti_flops(cfg.layers, s, b, cfg.hidden, cfg.vocab, recompute)
        assert tracker.flops["forward"] == paper["forward"]
        assert tracker.flops["backward"] == paper["backward"]
        factor = 1 if recompute == "full" else Fraction(1, 2)
        assert tracker.flops["recompute"] == paper["recompute"] * factor
        assert step_flops(cfg, b, s, policy)["recompute"] == tracker.flops["recompute"]


def test_the_trackers_flops_are_flop_counter_modes(one_thread):
    """The Tracker applies FlopCounterMode's formulas in its own dispatch mode (no module hooks, no
    decompositions): the same totals as FlopCounterMode, for picockpt's engine under every attention kind and
    with experts, and for an nn.Module model under autograd, plain and with torch.utils.checkpoint."""
    from torch.utils.flop_counter import FlopCounterMode
    from picockpt.measurement.peers import autograd, per_layer
    from picockpt.measurement.reference import ReferenceLlama
    base = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, max_seq=64)
    kinds = [dict(dtype="float64", dropout=0.1), dict(attention="tiled", attention_tile=4),
             dict(attention="fused", loss_chunk=5), dict(experts=4, experts_per_token=2)]
    for extra in kinds:
        cfg = Config(**base, **extra)
        params = init_params(cfg, seed=0)
        ids, targets = make_batch(cfg, 2, 16, "cpu", 0)
        for policy in ("none", "full"):
            torch.manual_seed(0)
            with Tracker("cpu", physical=False) as tracker:
                loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
            torch.manual_seed(0)
            with FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS) as counter:
                loss_and_grads(params, cfg, ids, targets, policy)
            assert sum(tracker.flops.values()) == counter.get_total_flops() > 0, (extra, policy)
    model = ReferenceLlama(cfg, params)
    for run_layers in (autograd, per_layer):
        counts = []
        for mode in (Tracker("cpu", physical=False), FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS)):
            with mode:
                model(ids, targets, run_layers).backward()
            model.zero_grad(set_to_none=True)
            counts.append(sum(mode.flops.values()) if isinstance(mode, Tracker) else mode.get_total_flops())
        assert counts[0] == counts[1] > 0, run_layers.__name__


# ---- Chen et al. 2016 ------------------------------------------------------------------------------
def test_chen_optimum():
    assert chen_optimum(100, 7.0, 7.0) == 10.0  # equal sizes: sqrt(L)
    L, x, A = 64, 1.0, 11.0
    best = chen_optimum(L, x, A)
    assert best == pytest.approx(math.sqrt(L * x / A))
    assert chen_memory(L, best, x, A) == pytest.approx(2 * math.sqrt(L * x * A))
    for C in (best * 0.9, best * 1.1, 1, L):
        assert chen_memory(L, C, x, A) > chen_memory(L, best, x, A)
    with pytest.raises(ValueError, match="C=0"):
        chen_memory(L, 0, x, A)


@pytest.mark.slow
def test_measured_u_curve_minimum_is_where_the_exact_formula_puts_it(one_thread, u_curve):
    """Every C of a 64-layer model of tiny width: the store's measured peak equals picockpt's exact
    formula for each C, the measured minimum is the formula's, and Chen's continuous optimum
    sqrt(L x / A) lies within one layer of it (between the two integers around it). The sweep is
    test_lessons.py's deepest (conftest.py's u_curve: lesson 04's model, measured once for both files)."""
    s = 8
    cfg, b, measured = u_curve(64, 32, 32, s)  # C -> the store's peak under every:C, a Tracker over loss_and_grads
    exact = exact_segment_curve(cfg, b, s)
    assert measured == exact
    lowest = min(measured.values())
    best = [C for C, peak in measured.items() if peak == lowest]
    assert best == [C for C, peak in exact.items() if peak == min(exact.values())]
    assert measured[1] > lowest < measured[cfg.layers]  # a U, not a slope
    X, A, _ = chain_sizes(cfg, b, s)
    chen = chen_optimum(cfg.layers, X, A)
    assert all(math.floor(chen) <= C <= math.ceil(chen) for C in best), (best, chen)

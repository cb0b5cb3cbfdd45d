"""Lesson 29's statements against the code: the numbers its prose states (the ridge point, the bubble shares, the
collectives' crossovers, the pipeline's send) recomputed, and what it says holds in all three Table 4 cases (the
reported MFU below the modelled one, context parallelism in the model's best at 8K, what the published split must
recompute to fit); the roofline's bound for a matmul, the K/V projections and SwiGLU at the lesson's
shape; and layout_search.search() on a tiny model held to an independent enumeration of its space, layout by
layout, so that a change to the space or its filters shows."""
import dataclasses
import itertools
import math
import re
import statistics

import pytest

from picockpt import Config, cost
from picockpt.cost import HARDWARE, bubble_idle, collective_seconds, layer_ops
from picockpt.layout_search import (LLAMA3_405B_TABLE_4, POLICIES, SCHEDULES, ZERO_STAGES, evaluate, rank_of,
                                    search)
from picockpt.notebooks import cells
from picockpt.reproduce import LESSONS, load

PATH = next(LESSONS.glob("29_*.py"))
H100 = HARDWARE["h100"]
GIB = 2**30

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def lesson():
    return load(PATH)


@pytest.fixture(scope="module")
def prose():
    """The lesson's markdown, every cell joined, each run of whitespace one space (sentences span lines)."""
    return re.sub(r"\s+", " ", " ".join(cell.source for cell in cells(PATH) if cell.kind == "markdown"))


def sentence(text, words):
    """The one sentence of `text` that holds `words`."""
    found = [s for s in re.split(r"(?<=[.:])\s+(?=[A-Z*(-])", text) if words in s]
    assert len(found) == 1, f"{len(found)} sentences hold {words!r}: {found}"
    return found[0]


def numbers(text):
    """The numbers of a sentence, in order (thousands separators dropped)."""
    return [float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*\.?\d*", text)]


@pytest.fixture(scope="module")
def cfg():
    return Config.from_preset("llama3-405b", dtype="bf16")


@pytest.fixture(scope="module")
def table_4(cfg):
    """{(gpus, seq): (rows that fit, rank of the published split, its row, reported MFU)} at 80 GiB on H100s."""
    out = {}
    for gpus, seq, layout, _, reported in LLAMA3_405B_TABLE_4:
        rows, _ = search(cfg, seq, gpus, 2**24, 80 * GIB, H100)
        rank, row = rank_of(rows, layout)
        out[gpus, seq] = rows, rank, row, reported
    return out


# ---- one op's roofline -------------------------------------------------------------------------------------------

def test_the_ridge_point_is_the_datasheets_ratio(prose):
    ridge = H100.matmul / H100.memory
    assert math.isclose(ridge, 989.5e12 / 3.35e12)
    assert round(ridge) in numbers(sentence(prose, "The ridge is"))


def test_matmuls_are_compute_bound_and_swiglu_memory_bound_at_the_lessons_shape(lesson, cfg):
    """tp 8 with sequence parallelism, 8,192 tokens: the MLP's matmuls far above the ridge, the K/V projections (one
    K/V head of 128 a rank) below it, every elementwise kernel memory-bound; the lesson's labels agree."""
    ridge = H100.matmul / H100.memory
    ops = {op.name: op for op in layer_ops(cfg.replace(attention="fused"), 1, 8192, 8, True, 1, causal_skip=True)}
    for name in ("gate_up", "down", "o_proj", "attention"):
        for flops, nbytes in ops[name].kernels:
            assert flops / nbytes > ridge, name
    assert all(round(f / b) == 3000 for f, b in ops["gate_up"].kernels + ops["down"].kernels)  # ten times the ridge
    q, k, v = ops["qkv"].kernels
    assert q[0] / q[1] > ridge > k[0] / k[1] == v[0] / v[1]
    n = cfg.kv_heads // 8 * cfg.head_dim  # 128 columns
    by_hand = 2 * 8192 * cfg.hidden * n / (2 * (8192 * cfg.hidden + cfg.hidden * n + 8192 * n))
    assert math.isclose(k[0] / k[1], by_hand) and round(by_hand) == 125
    assert ops["swiglu"].flops == 0 and ops["swiglu"].bytes == 3 * 2 * 8192 * cfg.ffn // 8
    labels = {row[0].name: row[4] for row in lesson.layer_table(cfg.replace(attention="fused"), 8192, 8, H100)}
    assert labels["gate_up"] == labels["down"] == "compute"
    assert labels["swiglu"] == labels["attn_norm"] == labels["mlp_norm"] == "memory"
    assert labels["qkv"] == "mixed: compute, memory, memory"


def test_the_prose_states_the_kv_projections_intensity(prose, cfg):
    ops = {op.name: op for op in layer_ops(cfg.replace(attention="fused"), 1, 8192, 8, True, 1, causal_skip=True)}
    flops, nbytes = ops["qkv"].kernels[1]
    said = numbers(sentence(prose, "an intensity of"))
    assert 128 in said and round(flops / nbytes) in said


# ---- one collective and the bubble ------------------------------------------------------------------------------

def test_the_crossovers_the_prose_states(lesson, prose):
    tp = lesson.crossover_bytes("all_gather", 8, H100, False)
    dp = lesson.crossover_bytes("reduce_scatter", 128, H100, True)
    for nbytes, kind, ranks, across in ((tp, "all_gather", 8, False), (dp, "reduce_scatter", 128, True)):
        alpha = collective_seconds(kind, 0, ranks, H100, across)  # at the crossover the bandwidth term is alpha
        assert math.isclose(collective_seconds(kind, nbytes, ranks, H100, across), 2 * alpha)
    said = numbers(sentence(prose, "Latency dominates below the crossover"))
    assert round(tp / 1e6, 1) in said and round(dp / 1e6, 1) in said


def test_the_pipeline_send_the_prose_states(lesson, prose):
    """33.6 MB over one network hop: alpha is one step's (22 us: NCCL's 14.0 us network step since 2.18.1), the
    crossover about a megabyte."""
    kind, nbytes, ranks, across = "p2p", 8192 * 16384 * 2 // 8, 2, True  # the lesson's: s h / t bf16 elements
    alpha, band = lesson.split(kind, nbytes, ranks, H100, across)
    said = sentence(prose, "A pipeline's send of one activation")
    assert f"{nbytes / 1e6:.1f} MB" in said and f"{alpha * 1e6:.0f} µs" in said and band > alpha
    assert 0.9e6 < lesson.crossover_bytes(kind, ranks, H100, across) < 1.2e6 and "about a megabyte" in said


def test_the_elementwise_kernels_are_a_few_percent_of_the_layer(lesson, cfg):
    table = lesson.layer_table(cfg.replace(attention="fused"), 8192, 8, H100)
    layer = [row for row in table if row[0].name not in ("final_norm", "logits", "loss")]
    elementwise = sum(row[5] for row in layer if row[0].flops == 0)
    assert 0.01 < elementwise / sum(row[5] for row in layer) < 0.1


def test_the_bubble_shares_the_prose_states(prose):
    assert math.isclose(bubble_idle(16, 16, "1f1b"), 15 / 31)
    assert round(100 * bubble_idle(16, 16, "1f1b"), 1) in numbers(sentence(prose, "idles 48.4% of the step"))
    assert round(100 * bubble_idle(16, 16, "interleaved", 4), 1) in numbers(sentence(prose, "brings it to"))


# ---- the three cases of Table 4 -------------------------------------------------------------------------------

def test_the_two_things_the_prose_says_hold_in_every_case(prose, table_4):
    """The reported MFU is below the modelled one in every case, and at 8K tokens the model's best has cp > 1."""
    assert "The reported MFU is below the modelled one" in sentence(prose, "The reported MFU is below")
    for (gpus, seq), (rows, rank, row, reported) in table_4.items():
        assert row["mfu"] > reported and rows[0]["mfu"] >= row["mfu"]
        if seq == 8192:
            assert rows[0]["cp"] > 1 and row["cp"] == 1
            assert rows[0]["policy"] in ("none", "cheap")  # "store everything or rebuild only the elementwise outputs"


def test_every_row_fits_sorted_and_the_published_split_is_among_them(table_4):
    for rows, rank, row, _ in table_4.values():
        assert rank is not None and rows[rank - 1] is row
        assert all(r["fits"] and r["peak_bytes"] <= 80 * GIB for r in rows)
        assert [r["step_seconds"] for r in rows] == sorted(r["step_seconds"] for r in rows)


def test_the_published_split_recomputes_something_or_takes_zero_3(lesson, cfg, prose, table_4):
    """At 16,384 GPUs and 8K tokens, TP8 CP1 PP16 DP128: without recomputation only ZeRO 3 with 1F1B fits (every other
    `none` variant is over 80 GiB); `cheap` fits, and its rebuild costs hundredths of a second; the best variant
    recomputes something, as the prose says."""
    _, _, row, _ = table_4[16384, 8192]
    assert row["policy"] != "none"
    variants = lesson.split_variants(cfg, 8192, 16384, (8, 1, 16, 128))
    assert len(variants) == len({(r["zero"], r["schedule"], r["virtual_stages"], r["policy"]) for r in variants})
    fitting_none = [r for r in variants if r["policy"] == "none" and r["fits"]]
    assert [(r["zero"], r["schedule"]) for r in fitting_none] == [("3", "1f1b")]
    assert "the one `none` variant that fits shards its weights with ZeRO 3" in prose
    assert all(r["peak_bytes"] > 80 * GIB for r in variants if r["policy"] == "none" and r["zero"] != "3")
    cheap = [r for r in variants if r["policy"] == "cheap" and r["fits"]]
    assert cheap and all(0 < r["terms_seconds"]["recompute"] < 0.1 for r in cheap)  # "hundredths of a second"
    assert "hundredths of a second" in sentence(prose, "`cheap` rebuilds the norms' outputs")


def test_the_split_variants_are_the_searchs_rows(lesson, cfg, table_4):
    """The lesson's split_variants() is the search's space for one split: the fitting ones are the search's rows."""
    rows, _, _, _ = table_4[16384, 8192]
    mine = {(r["zero"], r["schedule"], r["virtual_stages"], r["policy"])
            for r in lesson.split_variants(cfg, 8192, 16384, (8, 1, 16, 128)) if r["fits"]}
    theirs = {(r["zero"], r["schedule"], r["virtual_stages"], r["policy"]) for r in rows
              if (r["tp"], r["cp"], r["pp"], r["dp"]) == (8, 1, 16, 128)}
    assert mine == theirs


def test_the_step_is_the_bubble_formula_plus_the_exposed_traffic(table_4):
    """layout_search's docstring: step = t_mb (M + (p-1)/V) + what of dp does not hide; ZB-H1 t_mb (M + (p-1)/3)."""
    for rows, _, row, _ in table_4.values():
        for r in (rows[0], row):
            t = r["terms_seconds"]
            M, p = r["microbatches"], r["pp"]
            V = 3 if r["schedule"] == "zb-h1" else r["virtual_stages"]
            per_mb = sum(t[k] for k in ("compute", "recompute", "tp_comm", "cp_comm", "pp_comm")) / M
            assert math.isclose(r["step_seconds"], per_mb * (M + (p - 1) / V) + t["dp_exposed"], rel_tol=1e-9)


# ---- search() against an independent enumeration of its space --------------------------------------------------

TINY = Config.from_preset("tiny", layers=6, heads=8, kv_heads=4, hidden=64, ffn=128, vocab=96, dtype="bfloat16",
                          max_seq=64)


def enumerate_space(cfg, seq, gpus, tokens, node):
    """Every (tp, cp, pp, dp, M, zero, schedule, V, policy) the search's docstrings allow, written out anew."""
    sequences = tokens // seq
    out = []
    for tp, cp, pp, dp in itertools.product(range(1, gpus + 1), repeat=4):
        if tp * cp * pp * dp != gpus or tp > node or pp > cfg.layers or sequences % dp:
            continue
        if any(n % tp for n in (cfg.heads, cfg.kv_heads, cfg.ffn, cfg.vocab)):
            continue
        if seq % (2 * cp) or (seq // cp) % tp:  # whole zigzag chunks, split by sequence parallelism
            continue
        M = sequences // dp
        for zero in ("0", "1", "2", "3", "3+keep"):
            if zero != "0" and dp * cp == 1:  # nothing to shard over
                continue
            for schedule, V in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1)):
                if schedule == "interleaved" and (pp == 1 or M % pp or pp * V > cfg.layers):
                    continue
                if schedule == "zb-h1" and (pp == 1 or M < pp):  # a pipeline, every stage busy once warm
                    continue
                for policy in ("none", "cheap", "full"):
                    out.append((tp, cp, pp, dp, M, zero, schedule, V, policy))
    return out


def key(row):
    return (row["tp"], row["cp"], row["pp"], row["dp"], row["microbatches"], row["zero"], row["schedule"],
            row["virtual_stages"], row["policy"])


def test_the_space_is_the_one_written_here():
    assert ZERO_STAGES == ("0", "1", "2", "3", "3+keep")
    assert SCHEDULES == (("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1))
    assert POLICIES == ("none", "cheap", "full")


@pytest.mark.parametrize("node", [8, 2])
def test_search_returns_exactly_the_enumerated_layouts_that_fit(node):
    hw = dataclasses.replace(H100, node=node)
    seq, gpus, tokens = 32, 8, 32 * 16
    space = enumerate_space(TINY, seq, gpus, tokens, node)
    run = TINY.replace(attention="fused")
    peaks = {layout: evaluate(run, seq, gpus, tokens, 1.0, hw, *layout[:5], *layout[5:])["peak_bytes"]
             for layout in space}
    capacity = statistics.median(peaks.values())  # about half of the space fits
    rows, considered = search(TINY, seq, gpus, tokens, capacity, hw)
    assert considered == len(space) == len(set(space))
    expected = {layout for layout, peak in peaks.items() if peak <= capacity}
    assert 0 < len(expected) < len(space)
    assert {key(r) for r in rows} == expected and len(rows) == len(expected)
    assert [r["step_seconds"] for r in rows] == sorted(r["step_seconds"] for r in rows)
    assert max(r["tp"] for r in rows) <= node


# ---- the sources: NCCL's constants, the paper's own word, Megatron's fused projection, the H200's memory -------

def test_nccls_network_step_is_tuning_ccs_since_2_18_1(lesson, prose):
    """NVIDIA/nccl src/graph/tuning.cc: hwLat[NET][RING][SIMPLE] is 9.6 us in 2.17.1 and 14.0 us from 2.18.1 on."""
    assert cost.NCCL_NETWORK_STEP == 14.0e-6 and "14.0 us a step over the network, NCCL 2.18.1 on" in cost.__doc__
    said = sentence(prose, "The latencies are NCCL's own constants")
    assert "`src/graph/tuning.cc`" in said and "14.0 µs over the network" in said and "2.18.1" in said
    assert "PAT" in prose and "2.23" in prose
    alpha, _ = lesson.split("reduce_scatter", 0, 128, H100, True)
    assert alpha == pytest.approx(8.4e-6 + 127 * 14.0e-6)
    assert f"spends {alpha * 1e3:.1f} ms on latency" in prose and "9.6 µs a step" not in prose


def test_the_paper_pre_trained_at_8k_without_activation_checkpointing(prose):
    """The Llama 3 paper, sec. 3.3.2: its pipeline improvements let it pre-train 8K sequences without activation
    checkpointing; the lesson says so and says its model is wrong there."""
    assert "nothing here says which" not in prose
    said = sentence(prose, "It does say what the 8K runs recomputed: nothing.")
    assert said
    paper = sentence(prose, "*without activation checkpointing*")
    assert "Section 3.3.2" in paper
    assert "the model above is wrong where it says the published split must recompute to fit" in prose


def test_megatron_fuses_q_k_and_v_into_one_projection(prose, cfg):
    """megatron/core/transformer/attention.py: SelfAttention's linear_qkv has query_projection_size +
    2 * kv_projection_size outputs, one column-parallel matmul."""
    said = sentence(prose, "`linear_qkv`")
    columns = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim // 8
    assert f"{columns:,} columns" in said and "megatron/core/transformer/attention.py" in said
    assert "only in an unfused layer" in prose


def test_the_h200_exercise_gives_what_nvidia_smi_reports(lesson, prose):
    """nvidia-smi: 143,771 MiB on an H200, 140.4 GiB; lesson 01's explorer rounds it down to 140."""
    assert "131.3" not in prose and "`--hardware h200 --gpu-gib 140`" in prose and "143,771 MiB" in prose
    assert lesson.H200_GIB == 143771 // 1024
    explorer = load(LESSONS / "_explorer.py")
    assert explorer.CAPACITIES["140 GiB (H200)"] == lesson.H200_GIB * GIB

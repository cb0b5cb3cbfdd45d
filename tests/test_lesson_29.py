"""Lesson 29's statements against the code: the numbers its prose states (the ridge point, the bubble shares, the
collectives' crossovers and NCCL's choices, the pipeline's send) recomputed, and what it says holds in all three
Table 4 cases (the reported MFU below the modelled one, context parallelism in the model's best at 8K, the paper's
choices as its split's best variant, the ranks as each correction is turned on, the 8K split without
recomputation); the roofline's bound for a matmul, the K/V projections and SwiGLU at the lesson's shape; and
layout_search.search() on a tiny model held to an independent enumeration of its space, layout by layout, so
that a change to the space or its filters shows."""
import dataclasses
import itertools
import math
import re
import statistics

import pytest

from picockpt import Config
from picockpt.planning import collectives
from picockpt.planning.collectives import algorithm_seconds
from picockpt.parallel.pipeline_parallel.pp_schedules import in_flight
from picockpt.planning.cost import HARDWARE, bubble_idle, layer_ops
from picockpt.planning.layout_memory import ZERO_STAGES, splits_for
from picockpt.planning.layout_search import POLICIES, SCHEDULES, evaluate, runs, search
from picockpt.teaching.notebooks import cells
from picockpt.teaching.reproduce import LESSONS, load
from picockpt.parallel import Layout

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
def cases(lesson, cfg):
    """The lesson's three Table 4 cases under the full model (table_4_cases)."""
    return lesson.table_4_cases(cfg)


@pytest.fixture(scope="module")
def table_4(cases):
    """{(gpus, seq): (distinct splits, rank of the published split, its row, reported MFU)}: the lesson's own."""
    return {(c["gpus"], c["seq"]): (c["splits"], c["rank"], c["published"], c["reported"]) for c in cases}


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
    tp = lesson.crossover_bytes("all_gather", 8, H100, 8)
    dp = lesson.crossover_bytes("reduce_scatter", 128, H100, 1)
    for nbytes, kind, ranks, per_node in ((tp, "all_gather", 8, 8), (dp, "reduce_scatter", 128, 1)):
        alpha = algorithm_seconds(kind, 0, ranks, H100, per_node)["ring"]  # at the crossover the ring's bandwidth
        assert math.isclose(algorithm_seconds(kind, nbytes, ranks, H100, per_node)["ring"], 2 * alpha)  # is alpha
    said = numbers(sentence(prose, "Latency dominates below the crossover"))
    assert round(tp / 1e6, 1) in said and round(dp / 1e6, 1) in said


def test_nccls_choices_the_prose_states(lesson, prose, cfg):
    """Over 128 nodes of one GPU each PAT's latency beats the ring's below about 204 MB; over 1,024 GPUs eight a
    node the tree wins an all-reduce below about 30 GB; eight members a node move eight times the bytes."""
    pat = algorithm_seconds("reduce_scatter", 0, 128, H100, 1)
    said = sentence(prose, "PAT's 394 µs of latency")
    assert f"{pat['pat'] * 1e6:.0f} µs" in said and f"{pat['ring'] * 1e6:,.0f} µs" in said
    pat_switch = lesson.switch_bytes("reduce_scatter", 128, H100, 1)
    tree_switch = lesson.switch_bytes("all_reduce", 1024, H100, 8)
    assert f"about {pat_switch[0] / 1e6:.0f} MB" in said and pat_switch[1:] == ("pat", "ring")
    assert f"about {tree_switch[0] / 1e9:.0f} GB" in said and tree_switch[1:] == ("tree", "ring")
    counts = lesson.split_layers(cfg.layers, 16, "lighter ends")
    layer_grad = lesson.stage_params(cfg.replace(attention="fused"), 8, counts, 1) * 4 // counts[1]
    one, eight = (lesson.split("reduce_scatter", layer_grad, 128, H100, k) for k in (1, 8))
    assert one[0] == eight[0] == "ring" and one[2] / eight[2] == pytest.approx(8, rel=0.01)
    said = sentence(prose, "take 32 ms of bandwidth")
    assert f"{one[2] * 1e3:.0f} ms" in said and f"{eight[2] * 1e3:.1f} ms" in said


def test_the_pipeline_send_the_prose_states(lesson, prose):
    """33.6 MB over one network hop: alpha is one step's (22 us: NCCL's 14.0 us network step since 2.18.1), the
    crossover about a megabyte."""
    kind, nbytes, ranks, per_node = "p2p", 8192 * 16384 * 2 // 8, 2, 1  # the lesson's: s h / t bf16 elements
    _, alpha, band = lesson.split(kind, nbytes, ranks, H100, per_node)
    said = sentence(prose, "A pipeline's send of one activation")
    assert f"{nbytes / 1e6:.1f} MB" in said and f"{alpha * 1e6:.0f} µs" in said and band > alpha
    assert 0.9e6 < lesson.crossover_bytes(kind, ranks, H100, per_node) < 1.2e6 and "about a megabyte" in said


def test_the_elementwise_kernels_are_a_few_percent_of_the_layer(lesson, cfg):
    table = lesson.layer_table(cfg.replace(attention="fused"), 8192, 8, H100)
    layer = [row for row in table if row[0].name not in ("final_norm", "logits", "loss")]
    elementwise = sum(row[5] for row in layer if row[0].flops == 0)
    assert 0.01 < elementwise / sum(row[5] for row in layer) < 0.1


def test_the_kernel_rates_the_prose_states(lesson, prose, cfg, cases):
    """Section 1b's numbers are the published table's and the layer's, and the kernels rung's MFUs the ladder's."""
    rates = H100.kernels
    slower, layer_ratio = lesson.kernel_ratios(lesson.layer_table(cfg.replace(attention="fused"), 8192, 8, H100), H100)
    said = sentence(prose, "at 8K cuDNN's forward runs at")
    assert (f"{rates.attention_rate('forward', 8192) / 1e12:.0f} TFLOP/s" in said
            and f"at {rates.attention_rate('backward', 8192) / 1e12:.0f} in the model's count" in said)
    assert f"{slower['attention']:.1f} times" in sentence(prose, "Attention takes")
    assert slower["qkv"] < slower["o_proj"] == pytest.approx(1 / rates.gemm_efficiency)
    assert f"{layer_ratio:.2f} times" in sentence(prose, "The layer as a whole takes")
    models = dict(lesson.correction_models())
    said = sentence(prose, "Kernels at their published rates move")
    for name in ("+ accumulation", "+ kernels"):
        assert all(f"{mfu:.1%}" in said for mfu in published_mfus(lesson, cfg, models[name])), said


def published_mfus(lesson, cfg, model):
    """The MFU of each Table 4 split's best variant under `model`: the fastest of the split's variants that fit,
    the row the search's distinct splits keep for it (its variants evaluated alone, not the whole search)."""
    search_cfg, out = cfg.replace(attention="fused"), []
    for gpus, seq, (tp, cp, pp, dp), _, _ in lesson.LLAMA3_405B_TABLE_4:
        M, run_cfg = lesson.TOKENS // seq // dp, search_cfg.replace(max_seq=max(cfg.max_seq, seq))
        variants = [evaluate(run_cfg, seq, gpus, lesson.TOKENS, lesson.CAPACITY, lesson.HW,
                             Layout(dp, pp, tp, cp=cp, microbatches=M, schedule=schedule, virtual_stages=V, sp=sp),
                             zero, policy, split, model)
                    for zero in ZERO_STAGES for schedule, V in SCHEDULES for policy in POLICIES
                    for split in (splits_for(cfg.layers, pp) if model.stages else ("even",))
                    for sp in ((True, False) if model.overlap else (True,))
                    if runs(run_cfg, cp, pp, dp, M, zero, schedule, V, split, model)]
        out.append(min((r for r in variants if r["fits"]), key=lambda r: r["step_seconds"])["mfu"])
    return out


def test_the_bubble_shares_the_prose_states(prose):
    assert math.isclose(bubble_idle(16, 16, "1f1b"), 15 / 31)
    assert round(100 * bubble_idle(16, 16, "1f1b"), 1) in numbers(sentence(prose, "idles 48.4% of the step"))
    assert round(100 * bubble_idle(16, 16, "interleaved", 4), 1) in numbers(sentence(prose, "brings it to"))


# ---- the three cases of Table 4 -------------------------------------------------------------------------------

def test_the_things_the_prose_says_hold_in_every_case(prose, table_4):
    """The reported MFU is below the modelled one in every case; the paper's choices (interleaving, the lighter
    ends, sequence parallelism) are its split's best variant; at 8K tokens the model's best has cp > 1 and stores
    everything or rebuilds only the elementwise outputs; at 128K the published split is within a few percent."""
    assert "The reported MFU is below the modelled one" in sentence(prose, "The reported MFU is below")
    for (gpus, seq), (splits, rank, row, reported) in table_4.items():
        assert row["mfu"] > reported and splits[0]["mfu"] >= row["mfu"]
        assert row["schedule"] == "interleaved" and row["split"] == "lighter ends" and row["sp"]
        if seq == 8192:
            assert splits[0]["cp"] > 1 and row["cp"] == 1 and splits[0]["pp"] >= 32
            assert splits[0]["policy"] in ("none", "cheap") and splits[0]["schedule"] == "zb-h1"
        else:
            assert rank <= 3 and row["step_seconds"] / splits[0]["step_seconds"] < 1.05


def test_every_split_fits_sorted_and_the_published_split_is_among_them(cases, table_4):
    for splits, rank, row, _ in table_4.values():
        assert rank is not None and splits[rank - 1] is row
        assert all(r["fits"] and r["peak_bytes"] <= 80 * GIB for r in splits)
        assert [r["step_seconds"] for r in splits] == sorted(r["step_seconds"] for r in splits)
    for case in cases:
        assert len(case["splits"]) == len({(r["tp"], r["cp"], r["pp"], r["dp"]) for r in case["rows"]})


def test_the_ladder_of_corrections(lesson, prose, cfg, cases):
    """The first rung is the simpler model (what the prose says it gave), the last the full model; the prose's
    numbers are the ladder's (the overlap rung's MFU at 8,192 GPUs against the stages rung's)."""
    models = dict(lesson.correction_models())
    assert list(models) == ["the simpler model"] + [f"+ {name}" for name in lesson.CORRECTIONS]
    assert models["+ chunked_tp"] == lesson.Model()
    first = lesson.table_4_cases(cfg, models["the simpler model"])
    assert [(c["rank"], round(c["ratio"], 2)) for c in first] == [(16, 1.12), (19, 1.15), (1, 1.0)]
    said = sentence(prose, "The simpler model put the paper's 8K split")
    assert "16th and 19th" in said and "1.12x and 1.15x" in said and "first" in said
    said = sentence(prose, "The published 8K split ends at")
    assert (f"{cases[0]['rank']}th and {cases[1]['rank']}th" in said and f"{cases[0]['ratio']:.2f}x and "
            f"{cases[1]['ratio']:.2f}x" in said and f"{cases[2]['ratio']:.2f}x" in said)
    stages, overlap = (published_mfus(lesson, cfg, models[name])[0] for name in ("+ stages", "+ overlap"))
    said = sentence(prose, "and overlap, which hides half")
    assert f"from {stages:.0%} to {overlap:.0%}" in said
    said = sentence(prose, "The MFUs rise with the ranks")
    assert all(f"{c['published']['mfu']:.1%}" in said for c in cases), said


def test_the_8k_split_without_recomputation(lesson, prose, cfg):
    """Section 6: with ZeRO 2 or 3 and 1F1B the 8K split fits 80 GiB with nothing recomputed (about 71 GiB under
    ZeRO 2); ZeRO 1 does not; interleaved, stage 1 holds 19.25 micro-batches at V=4 and 8,192 GPUs: V=4 fits at
    16,384 GPUs under ZeRO 2 and 3 but not at 8,192."""
    for gpus, dp in ((8192, 64), (16384, 128)):
        variants = [r for r in lesson.split_variants(cfg, 8192, gpus, (8, 1, 16, dp), "none")
                    if r["sp"] and r["split"] == "lighter ends"]
        by = {(r["zero"], r["schedule"], r["virtual_stages"]): r for r in variants}
        assert all(r["policy"] == "none" for r in variants)
        assert by["2", "1f1b", 1]["fits"] and by["3", "1f1b", 1]["fits"] and not by["1", "1f1b", 1]["fits"]
        assert round(by["2", "1f1b", 1]["peak_bytes"] / GIB) == 71 and by["2", "1f1b", 1]["busiest_stage"] == 1
        assert by["3", "interleaved", 4]["fits"] == by["2", "interleaved", 4]["fits"] == (gpus == 16384)
    assert in_flight("interleaved", 16, 32, 1, 4) / 4 == 19.25 and "at 19.25 micro-batches for $V = 4$" in prose
    assert "about 71 GiB" in prose and "stage 1 holds 15 micro-batches" in prose
    assert "The memory model agrees with the paper where the paper's sharding is modelled" in prose


def test_the_split_variants_are_the_searchs_rows(lesson, cfg, cases):
    """The lesson's split_variants() is the search's space for one split: the fitting ones are the search's rows."""
    rows = cases[1]["rows"]
    fields = ("zero", "schedule", "virtual_stages", "policy", "sp", "split")
    mine = {tuple(r[f] for f in fields) for r in lesson.split_variants(cfg, 8192, 16384, (8, 1, 16, 128))
            if r["fits"]}
    theirs = {tuple(r[f] for f in fields) for r in rows if (r["tp"], r["cp"], r["pp"], r["dp"]) == (8, 1, 16, 128)}
    assert mine == theirs


def test_the_step_is_the_sum_of_its_terms(cases):
    """layout_search's docstring: the slowest stage's M micro-batches, the fill and drain, and what of dp does not
    hide."""
    for case in cases:
        for r in (case["best"], case["published"]):
            assert math.isclose(r["step_seconds"], sum(r["terms_seconds"].values()), rel_tol=1e-9)


# ---- search() against an independent enumeration of its space --------------------------------------------------

TINY = Config.from_preset("tiny", layers=6, heads=8, kv_heads=4, hidden=64, ffn=128, vocab=96, dtype="bfloat16",
                          max_seq=64)


def layer_splits(layers, pp):
    """The even split, and the lighter ends where they are another split: L + 2 spread, one off each end."""
    even = [layers // pp + (1 if s < layers % pp else 0) for s in range(pp)]
    out = [("even", even)]
    if pp > 1 and (layers + 2) // pp >= 2:
        ends = [(layers + 2) // pp + (1 if s < (layers + 2) % pp else 0) for s in range(pp)]
        ends[0], ends[-1] = ends[0] - 1, ends[-1] - 1
        if ends != even:
            out.append(("lighter ends", ends))
    return out


def as_layout(row):
    """The Layout of an enumerated (tp, cp, pp, dp, M, zero, schedule, V, policy, sp, split); evaluate takes zero,
    policy and split beside it."""
    tp, cp, pp, dp, M, _, schedule, V, _, sp, _ = row
    return Layout(dp, pp, tp, cp=cp, microbatches=M, schedule=schedule, virtual_stages=V, sp=sp)


def enumerate_space(cfg, seq, gpus, tokens, node):
    """Every (tp, cp, pp, dp, M, zero, schedule, V, policy, sp, split) the search's docstrings allow, written out
    anew."""
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
                for split, _ in layer_splits(cfg.layers, pp):
                    places = cfg.layers + (2 if split == "lighter ends" else 0)  # the embedding, the head
                    if schedule == "interleaved" and (pp == 1 or M % pp or places % (pp * V)):  # whole chunks
                        continue
                    if schedule == "zb-h1" and (pp == 1 or M < pp):  # a pipeline, every stage busy once warm
                        continue
                    for policy in ("none", "cheap", "full"):
                        for sp in ((True, False) if tp > 1 else (False,)):
                            out.append((tp, cp, pp, dp, M, zero, schedule, V, policy, sp, split))
    return out


def key(row):
    return (row["tp"], row["cp"], row["pp"], row["dp"], row["microbatches"], row["zero"], row["schedule"],
            row["virtual_stages"], row["policy"], row["sp"], row["split"])


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
    peaks = {row: evaluate(run, seq, gpus, tokens, 1.0, hw, as_layout(row), row[5], row[8], row[10])["peak_bytes"]
             for row in space}
    capacity = statistics.median(peaks.values())  # about half of the space fits
    rows, considered = search(TINY, seq, gpus, tokens, capacity, hw)
    assert considered == len(space) == len(set(space))
    expected = {layout for layout, peak in peaks.items() if peak <= capacity}
    assert 0 < len(expected) < len(space)
    assert {key(r) for r in rows} == expected and len(rows) == len(expected)
    assert [r["step_seconds"] for r in rows] == sorted(r["step_seconds"] for r in rows)
    assert max(r["tp"] for r in rows) <= node


# ---- the sources: NCCL's constants, the paper's own word, Megatron's fused projection, the H200's memory -------

def test_nccls_network_step_is_tuning_ccs_since_2_18_1(prose):
    """NVIDIA/nccl src/graph/tuning.cc: hwLatencies[NET][RING][SIMPLE] is 9.6 us in 2.17.1 and 14.0 us from 2.18.1
    on; PAT from 2.23."""
    assert collectives.NETWORK_LATENCY["ring"] == 14.0e-6 and "14.0 us (NCCL" in collectives.__doc__
    said = sentence(prose, "The latencies are NCCL's own constants")
    assert "`src/graph/tuning.cc`" in said and "14.0 µs over the network" in said and "2.18.1" in said
    assert "PAT" in said and "2.23" in said and "9.6 µs a step" not in prose


def test_the_paper_pre_trained_at_8k_without_activation_checkpointing(prose):
    """The Llama 3 paper, sec. 3.3.2: its pipeline improvements let it pre-train 8K sequences without activation
    checkpointing; the lesson says so and checks it against the memory model."""
    paper = sentence(prose, "*without activation checkpointing*")
    assert "Section 3.3.2" in paper
    assert "the model above is wrong where it says the published split must recompute to fit" not in prose


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

"""The layout model's terms as frameworks run them: full recomputation reruns the whole forward, Megatron hides its
backward tensor-parallel collectives under the GEMMs they overlap, a pipeline pays its exchanges every micro-batch,
interleaving needs whole chunks, every stage is priced, and the Llama 3 paper's 8K layout fits without
recomputation the way the paper shards it."""
import pytest

from picockpt import Config
from picockpt.planning.collectives import collective_seconds
from picockpt.planning.cost import HARDWARE, layer_ops
from picockpt.planning.kernel_rates import op_seconds
from picockpt.planning.layout_memory import CUDA_CONTEXT_BYTES, NCCL_BUFFER_BYTES, reserve_bytes, split_layers, stage_bytes
from picockpt.planning.layout_search import evaluate, runs
from picockpt.planning.layout_time import (UB_SMS, UB_SPLITS, Model, microbatch_seconds, pipelined_exposed,
                                           ring_exchange_exposed)
from picockpt.parallel import Layout

H100 = HARDWARE["h100"]
GIB = 2**30
WHOLE = Model(chunked_tp=False)  # every tensor-parallel collective a GEMM does not hide exposed whole
BIG = Config.from_preset("llama3-405b", dtype="bf16").replace(attention="fused")


def layer_seconds(cfg, seq, tp, sp, cp=1):
    return sum(op_seconds(op, H100, H100.kernels) for op in layer_ops(cfg, 1, seq, tp, sp, cp, causal_skip=True)
               if op.name != "probs")


def gemm_halves(cfg, seq, tp, sp):
    """{op name: half its backward}: the input-gradient or the weight-gradient GEMM a collective hides under."""
    return {op.name: op_seconds(op, H100, H100.kernels, "backward") / 2
            for op in layer_ops(cfg, 1, seq, tp, sp, 1, causal_skip=True)}


def test_full_recomputation_is_the_whole_forward():
    """Megatron's --recompute-granularity full and torch's checkpoint rerun the layer from its input: every op."""
    t = microbatch_seconds(BIG, 8192, 8, True, 1, 8, False, "full", H100, 1)
    assert t["recompute"] == pytest.approx(8 * layer_seconds(BIG, 8192, 8, True))
    assert t["recompute"] == pytest.approx(t["forward"])  # not the last stage: no head


def test_full_recomputation_reruns_the_forwards_collectives():
    none, full = (microbatch_seconds(BIG, 8192, 8, True, 1, 8, False, p, H100, 1, WHOLE) for p in ("none", "full"))
    block = 8192 * BIG.hidden * 2
    forward = 2 * (collective_seconds("all_gather", block, 8, H100, 8)
                   + collective_seconds("reduce_scatter", block, 8, H100, 8))
    assert full["tp_comm"] - none["tp_comm"] == pytest.approx(8 * forward)


def test_megatron_hides_the_async_backward_collectives_under_their_gemms():
    """Without sequence parallelism the column-parallel input gradient's all-reduce runs under the weight-gradient
    GEMM: at 405B's shapes the MLP's gate/up GEMM hides it whole, the attention's q/k/v GEMM (one K/V head a rank)
    only in part. With it, the output gradient's all-gather is exposed, the re-gather hides under the input-gradient
    GEMM and the reduce-scatter under the weight-gradient GEMM, as far as they last."""
    block = 8192 * BIG.hidden * 2
    gather = collective_seconds("all_gather", block, 8, H100, 8)
    scatter = collective_seconds("reduce_scatter", block, 8, H100, 8)
    reduce = collective_seconds("all_reduce", block, 8, H100, 8)
    ops = gemm_halves(BIG, 8192, 8, False)
    assert ops["qkv"] < reduce < ops["gate_up"]
    no_sp = microbatch_seconds(BIG, 8192, 8, False, 1, 1, False, "none", H100, 1, WHOLE)
    assert no_sp["tp_comm"] == pytest.approx(2 * reduce + (reduce - ops["qkv"]))
    sp_ops = gemm_halves(BIG, 8192, 8, True)
    sp = microbatch_seconds(BIG, 8192, 8, True, 1, 1, False, "none", H100, 1, WHOLE)
    hidden = sum(max(0, gather - sp_ops[c]) + max(0, scatter - sp_ops[c]) for c in ("qkv", "gate_up"))
    assert sp["tp_comm"] == pytest.approx(2 * (gather + scatter) + 2 * gather + hidden)


def test_chunked_collectives_leave_what_their_gemm_chunks_do_not_cover():
    """A ring exchange of tp chunks: tp - 1 transfers, each beside one GEMM chunk; a pipeline of 4 chunks: the last
    chunk's reduce-scatter exposed, the GEMM on 16 fewer SMs."""
    assert ring_exchange_exposed(7.0, 8.0, 8) == 0.0  # each transfer 1.0 beside a 1.0 chunk
    assert ring_exchange_exposed(7.0, 4.0, 8) == pytest.approx(7.0 - 4.0 * 7 / 8)
    assert pipelined_exposed(4.0, 8.0) == pytest.approx(4.0 / UB_SPLITS)  # no SMs given: the GEMM at its rate
    slowed = 8.0 * 132 / (132 - UB_SMS)
    assert pipelined_exposed(4.0, 8.0, 132) == pytest.approx(slowed - 8.0 + 1.0)
    assert pipelined_exposed(40.0, 8.0, 132) == pytest.approx(slowed - 8.0 + 10.0 + 3 * (10.0 - slowed / 4))


def test_sequence_parallel_collectives_chunk_under_their_gemms():
    """Megatron's --tp-comm-overlap (TransformerEngine's userbuffers): at 405B's TP8 shapes the forward's
    all-gathers hide under the q/k/v and gate/up GEMMs, its reduce-scatters partly under o_proj and down, and the
    backward's output-gradient all-gathers under the row-parallel input-gradient GEMMs; what the async backward
    hid stays hidden the same way. Less than half the collectives' seconds stay exposed."""
    block = 8192 * BIG.hidden * 2
    gather = collective_seconds("all_gather", block, 8, H100, 8)
    scatter = collective_seconds("reduce_scatter", block, 8, H100, 8)
    forward = {op.name: op_seconds(op, H100, H100.kernels) for op in layer_ops(BIG, 1, 8192, 8, True, 1, True)}
    halves = gemm_halves(BIG, 8192, 8, True)
    expected = sum(ring_exchange_exposed(gather, forward[column], 8)
                   + min(scatter, pipelined_exposed(scatter, forward[row], H100.kernels.sms))
                   + ring_exchange_exposed(gather, halves[row], 8)
                   + max(0, gather - halves[column]) + max(0, scatter - halves[column])
                   for column, row in (("qkv", "o_proj"), ("gate_up", "down")))
    chunked = microbatch_seconds(BIG, 8192, 8, True, 1, 1, False, "none", H100, 1)
    whole = microbatch_seconds(BIG, 8192, 8, True, 1, 1, False, "none", H100, 1, WHOLE)
    assert chunked["tp_comm"] == pytest.approx(expected)
    assert ring_exchange_exposed(gather, forward["gate_up"], 8) == 0.0
    assert chunked["tp_comm"] < whole["tp_comm"] / 2
    no_sp = (microbatch_seconds(BIG, 8192, 8, False, 1, 1, False, "none", H100, 1, m) for m in (Model(), WHOLE))
    assert next(no_sp)["tp_comm"] == next(no_sp)["tp_comm"]  # needs sequence parallelism, as Megatron asserts


def test_a_pipeline_pays_its_exchanges_every_micro_batch_and_v_times_interleaved():
    rows = {V: evaluate(BIG, 8192, 8192, 2**24, 10**15, H100,
                        Layout(dp=64, pp=16, tp=8, microbatches=32, schedule=s, virtual_stages=V), "1", "none")
            for s, V in (("1f1b", 1), ("interleaved", 2))}
    send = collective_seconds("p2p", 8192 * BIG.hidden * 2 // 8, 2, H100, 1)
    assert rows[1]["terms_seconds"]["pp_comm"] == pytest.approx(32 * 2 * send)
    assert rows[2]["terms_seconds"]["pp_comm"] == pytest.approx(2 * rows[1]["terms_seconds"]["pp_comm"])


def test_interleaving_needs_whole_chunks():
    """126 layers: no even split into 16 x 2 chunks; the lighter ends (the embedding and the head in a layer's place,
    128 places) split into 16 x 2 and 16 x 4, as the Llama 3 paper's schedule does."""
    assert not runs(BIG, 1, 16, 64, 32, "1", "interleaved", 2, "even")
    assert runs(BIG, 1, 16, 64, 32, "1", "interleaved", 2, "lighter ends")
    assert runs(BIG, 1, 16, 64, 32, "1", "interleaved", 4, "lighter ends")
    assert runs(BIG.replace(layers=128), 1, 16, 64, 32, "1", "interleaved", 4, "even")
    assert not runs(BIG, 1, 16, 64, 30, "1", "interleaved", 2, "lighter ends")  # M a multiple of p


def test_the_papers_split_and_every_stage():
    assert split_layers(126, 16, "lighter ends") == (7,) + (8,) * 14 + (7,)
    assert split_layers(126, 16, "even") == (8,) * 14 + (7, 7)
    with pytest.raises(ValueError, match="split='lighter ends' with pp=126"):
        split_layers(126, 126, "lighter ends")
    row = evaluate(BIG, 8192, 8192, 2**24, 80 * GIB, H100, Layout(dp=64, pp=16, tp=8, microbatches=32), "2", "none",
                   "lighter ends")
    assert row["busiest_stage"] == 1  # 8 layers and 15 micro-batches in flight outweigh stage 0's 7 and 16
    assert len(row["stage_peak_bytes"]) >= 3


def test_the_reserve_is_stated_and_in_the_peak():
    assert reserve_bytes(0) == CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES == 1.5 * GIB
    parts = stage_bytes(BIG, 8192, Layout(dp=64, pp=16, tp=8, microbatches=32), split_layers(126, 16), 0, "1", "none")
    assert parts["reserve"] == reserve_bytes(sum(v for k, v in parts.items() if k != "reserve"))


def test_the_papers_8k_layout_fits_without_recomputation_as_the_paper_shards_it():
    """Sec. 3.3.2: 8K sequences trained without activation checkpointing; its FSDP shards the optimizer state and
    the gradients and keeps the gathered weights (ZeRO 2 here). At 1F1B with the lighter ends the busiest rank fits
    80 GB with nothing recomputed; with the distributed optimizer's whole fp32 gradients (ZeRO 1) it does not, nor
    interleaved (Korthikanti's 1 + (p-1)/(pV) more in flight on stage 0)."""
    def peak(zero, schedule="1f1b", V=1, gpus=8192, dp=64, M=32):
        layout = Layout(dp=dp, pp=16, tp=8, microbatches=M, schedule=schedule, virtual_stages=V)
        row = evaluate(BIG, 8192, gpus, 2**24, 80 * GIB, H100, layout, zero, "none", "lighter ends")
        return row["peak_bytes"] / GIB
    for gpus, dp, M in ((8192, 64, 32), (16384, 128, 16)):
        assert peak("2", gpus=gpus, dp=dp, M=M) < 74.5 and peak("3", gpus=gpus, dp=dp, M=M) < 74.5  # 80 GB
        assert peak("1", gpus=gpus, dp=dp, M=M) > 80
        assert peak("2", "interleaved", 4, gpus, dp, M) > 74.5


def test_every_micro_batch_accumulates_its_weight_gradients_in_fp32():
    """Megatron's gradient_accumulation_fusion: each weight-gradient GEMM adds into an fp32 main_grad, reading and
    writing 8 bytes a weight. On 8,192 rows a layer's GEMMs stay compute-bound and it costs nothing; on a context-
    parallel rank's 512 rows it is memory-bound and adds about 40% to the micro-batch's compute."""
    plain = Model(accumulation=False, kernels=False)  # the roofline: a backward is twice the forward
    for tp, cp, bound in ((8, 1, 1.001), (1, 16, 1.3)):
        with_it, without = (microbatch_seconds(BIG, 8192, tp, True, cp, 2, False, "none", H100, 1, m)["compute"]
                            for m in (Model(kernels=False), plain))
        assert without == pytest.approx(3 * microbatch_seconds(BIG, 8192, tp, True, cp, 2, False, "none", H100, 1,
                                                               plain)["forward"])
        assert (with_it / without < bound) if cp == 1 else (with_it / without > bound)


@pytest.mark.parametrize("policy", ["none", "full", "cheap"])
def test_interleaving_holds_about_p_micro_batches_on_every_stage_as_its_order_walks(policy):
    """The search's interleaved activations are the rank's closed form (pp_forms.rank_forms, exact to the parallel
    runs) on every stage, not Korthikanti's stage-0 factor with 1F1B's p - s elsewhere: a late stage's warm-up of
    2 (p - s - 1) + (V - 1) p chunk forwards leaves it far more than 1F1B's one micro-batch."""
    from picockpt.parallel.pipeline_parallel.pp_forms import rank_forms
    from picockpt.planning.layout_memory import chunk_layers, interleaved_activation_bytes
    from picockpt.recompute.policy import parse_policy
    cfg = Config.from_preset("tiny").replace(layers=8, attention="fused")
    for pp, V, M in ((2, 2, 4), (2, 2, 2), (4, 2, 8)):
        layout = Layout(pp=pp, microbatches=M, schedule="interleaved", virtual_stages=V, sp=False)
        walked = [interleaved_activation_bytes(cfg, 32, layout, chunk_layers(8, pp, V, "even", s), s,
                                               parse_policy(policy, cfg)) for s in range(pp)]
        assert walked == [rank_forms(cfg, M, 32, policy, layout, s).peak_bytes for s in range(pp)]
        assert walked == [stage_bytes(cfg, 32, layout, split_layers(8, pp), s, "1", policy, split="even")
                          ["activations"] for s in range(pp)]  # what the search prices
        one_f_one_b = stage_bytes(cfg, 32, Layout(pp=pp, microbatches=M, sp=False), split_layers(8, pp), pp - 1, "1",
                                  policy)["activations"]
        assert walked[-1] > one_f_one_b


def test_the_lighter_ends_give_the_first_and_last_chunks_the_embedding_and_the_head():
    """Grattafiori et al. 2024, sec. 3.3.2: L + 2 places over the p V virtual stages, the embedding and the head
    each taking one; with one place a chunk, the first chunk holds only the embedding, the last only the head."""
    from picockpt.planning.layout_memory import chunk_layers
    assert chunk_layers(126, 16, 8, "lighter ends", 0) == (0,) + (1,) * 7
    assert chunk_layers(126, 16, 8, "lighter ends", 15) == (1,) * 7 + (0,)
    assert chunk_layers(126, 16, 4, "lighter ends", 0) == (1, 2, 2, 2)
    assert sum(chunk_layers(126, 16, 4, "lighter ends", 0)) == split_layers(126, 16, "lighter ends")[0]
    assert chunk_layers(128, 16, 4, "even", 3) == (2, 2, 2, 2)

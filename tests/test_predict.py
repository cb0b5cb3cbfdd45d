"""python -m picockpt predict: the published figures, picockpt's exact ones, JSON keys, clear errors."""
import json

import pytest

from commands import picockpt
from picockpt import Config
from picockpt.cli import main
from picockpt.planning.published import korthikanti_layer_bytes
from picockpt.planning.step_forms import predicted_peak_bytes
from picockpt.parallel.context_parallel.cp_forms import cp_comm_bytes, cp_peak_bytes
from picockpt.parallel.data_parallel.zero_forms import model_state_bytes, zero_paper_bytes, zero_paper_parts
from picockpt.parallel import Layout

KEYS = ("model", "layers", "hidden", "heads", "kv_heads", "seq", "batch", "recompute", "tp", "sp", "formula",
        "per_layer_bytes", "per_layer_gib", "embedding_dropout_bytes", "activation_bytes", "activation_gib",
        "picockpt_dtype", "picockpt_per_layer_bytes", "picockpt_peak_bytes", "picockpt_peak_gib",
        "published_flops", "picockpt_flops")


def predict_json(capsys, *args):
    assert main(["predict", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("recompute,gib", [("none", 97.02), ("selective", 17.02), ("full", 1.02)])
def test_llama3_8b_at_4096_tokens(capsys, recompute, gib):
    row = predict_json(capsys, "--model", "llama3-8b", "--seq", "4096", "--batch", "1", "--recompute", recompute)
    for key in KEYS:
        assert key in row, key
    assert round(row["activation_gib"], 2) == gib
    assert row["activation_bytes"] == 32 * row["per_layer_bytes"] + 4096 * 4096  # + the embedding dropout mask
    cfg = Config.from_preset("llama3-8b", dtype="bf16")
    assert row["picockpt_dtype"] == "bfloat16"
    assert row["picockpt_peak_bytes"] == predicted_peak_bytes(cfg, 1, 4096, recompute)


def test_tensor_and_sequence_parallel(capsys):
    row = predict_json(capsys, "--model", "llama3-70b", "--seq", "8192", "--tp", "8", "--sp")
    assert row["formula"] == "sbh(34/t + 5as/(ht))"
    assert row["per_layer_bytes"] == korthikanti_layer_bytes(8192, 1, 8192, 64, t=8, sp=True)
    assert row["embedding_dropout_bytes"] == 8192 * 8192 // 8
    no_sp = predict_json(capsys, "--model", "llama3-70b", "--seq", "8192", "--tp", "8")
    assert no_sp["formula"] == "sbh(10 + 24/t + 5as/(ht))"
    assert no_sp["per_layer_bytes"] - row["per_layer_bytes"] == 10 * 8192 * 8192 * (1 - 1 / 8)


def test_shape_flags_and_dtype(capsys):
    row = predict_json(capsys, "--layers", "4", "--hidden", "256", "--heads", "8", "--kv-heads", "2",
                       "--ffn", "512", "--vocab", "1000", "--seq", "128", "--batch", "2", "--dtype", "fp32")
    assert (row["layers"], row["hidden"], row["heads"], row["kv_heads"]) == (4, 256, 8, 2)
    assert row["per_layer_bytes"] == korthikanti_layer_bytes(128, 2, 256, 8)
    cfg = Config.from_preset("llama3-8b", layers=4, hidden=256, heads=8, kv_heads=2, ffn=512, vocab=1000)
    assert row["picockpt_peak_bytes"] == predicted_peak_bytes(cfg, 2, 128, "none")  # fp32, as asked


def test_table_names_both_sources(capsys):
    assert main(["predict", "--model", "llama3-405b", "--seq", "1024", "--recompute", "selective"]) == 0
    out = capsys.readouterr().out
    assert "per_layer_bytes" in out and "activation_bytes" in out and "66.95 GiB" in out
    assert "picockpt's exact store" in out and "sbh(34)" in out


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "--tp=3"),
    (["--tp", "0"], "--tp=0"),
    (["--model", "llama3-7b"], "--model='llama3-7b'"),
    (["--recompute", "some"], "--recompute='some'"),
    (["--seq", "0"], "--seq 0"),
])
def test_user_mistakes_are_one_line_errors(args, message):
    out = picockpt("predict", *args)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_model_state_per_gpu_is_zero_inventorys(capsys, stage):
    row = predict_json(capsys, "--model", "llama3-70b", "--seq", "8192", "--recompute", "full",
                       "--zero", str(stage), "--dp", "8")
    cfg = Config.from_preset("llama3-70b", dtype="bf16")
    zero, psi = row["zero"], cfg.num_params()
    assert zero["picockpt"] == model_state_bytes(cfg, stage, 8)
    assert zero["paper"] == zero_paper_parts(psi, stage, K=12, N_d=8)
    assert zero["paper_model_state_bytes"] == pytest.approx(zero_paper_bytes(psi, K=12, N_d=8)[stage])
    assert zero["picockpt_activation_bytes"] == predicted_peak_bytes(cfg, 1, 8192, "full")  # one rank's micro-batch
    gathered = zero["picockpt_gathered_bytes"]
    assert (gathered > 0) == (stage == 3)
    assert zero["picockpt_total_bytes"] == sum(zero["picockpt"].values()) + gathered + zero["picockpt_activation_bytes"]
    assert zero["picockpt_model_state_by_stage"][str(stage)] == sum(zero["picockpt"].values())
    units = cfg.layers + 2  # the embedding, the layers, the head: one AdamW step count (4 bytes) each
    assert zero["picockpt_model_state_by_stage"]["0"] == 16 * psi + 4 * units  # fp32 weights, gradients, 2 moments
    assert row["gpu_bytes"] == 81559 * 2**20  # --gpu-gib left out: an H100's memory, as its driver reports it


def test_zero_table_names_the_stage_and_the_verdict(capsys):
    assert main(["predict", "--model", "llama3-8b", "--seq", "4096", "--zero", "3", "--dp", "8"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 3 over 8 data-parallel ranks" in out and "gathered parameters in flight" in out
    assert "total per GPU: picockpt" in out and "fits" in out


def test_context_parallel_per_rank_is_cp_inventorys(capsys):
    row = predict_json(capsys, "--model", "llama3-8b", "--seq", "8192", "--attention", "fused", "--recompute", "full",
                       "--cp", "4", "--cp-comm", "allgather", "--keep-kv")
    cfg = Config.from_preset("llama3-8b", dtype="bf16", attention="fused")
    cp = row["cp"]
    assert cp["rank_tokens"] == 2048
    assert cp["peak_bytes"] == cp_peak_bytes(cfg, 1, 8192, "full", 4, "allgather", True)
    assert cp["every_peak_bytes"]["1"] == cp["peak_bytes"]  # full is every:1
    assert cp["every_peak_bytes"]["32"] == cp_peak_bytes(cfg, 1, 8192, "every:32", 4, "allgather", True)
    assert cp["comm_bytes"] == cp_comm_bytes(cfg, 1, 8192, "full", 4, "allgather", True)
    assert cp_peak_bytes(cfg, 1, 8192, "full", 4, "allgather", True) > cp_peak_bytes(cfg, 1, 8192, "full", 4)


def test_context_parallel_beside_tensor_parallel_is_a_tp_rank_on_t_over_cp_tokens(capsys):
    """--cp 16 --tp 8 --sp (Llama 3 405B at 128K tokens): a rank's store is a tensor-parallel rank's on T/cp
    tokens, the form the composed step's tp x cp ranks are measured against (parallel/report_forms.py: ChunkForms
    at T/cp, tests/test_parallel_cp.py), and its communication the ring's K/V of KV/t heads plus tp's."""
    from picockpt.parallel.pipeline_parallel.pp_forms import ChunkForms
    from picockpt.parallel.tensor_parallel.tp_forms import rank_comm_bytes, rank_peak_bytes
    row = predict_json(capsys, "--model", "llama3-405b", "--seq", "131072", "--attention", "fused", "--recompute",
                       "full", "--cp", "16", "--tp", "8", "--sp")
    cfg = Config.from_preset("llama3-405b", dtype="bf16", attention="fused")
    cp, n = row["cp"], 131072 // 16
    assert (cp["rank_tokens"], cp["tp"], cp["sp"]) == (n, 8, True)
    assert cp["peak_bytes"] == rank_peak_bytes(cfg, 1, n, "full", 8, True) == \
        ChunkForms(cfg, 1, n, "full", Layout(tp=8), 0).peak_bytes
    tp_comm = rank_comm_bytes(cfg, 1, n, "full", 8, True)
    ring = cp_comm_bytes(cfg, 1, 131072, "full", 16, t=8)
    assert cp["comm_bytes"] == {phase: ring[phase] + tp_comm[phase] for phase in ring}
    assert ring["forward"] == cfg.layers * 15 * 2 * (cfg.kv_heads // 8) * n * cfg.head_dim * 2  # (cp-1) KV, bf16
    assert cp["every_peak_bytes"]["1"] == cp["peak_bytes"] < cp_peak_bytes(cfg, 1, 131072, "full", 16)


def test_context_parallel_beside_pipeline_stages_is_each_stages_rank(capsys):
    """--cp 16 --tp 8 --sp --pp 16 (the Llama 3 paper's 128K layout): every stage's rank on its T/cp tokens under
    1F1B (ChunkForms, what tests/test_parallel_cp.py measures cp x pp ranks against); stage 0, holding the most
    micro-batches, is the busiest; every:C runs within the largest stage."""
    from picockpt.parallel.pipeline_parallel.pp_forms import ChunkForms
    row = predict_json(capsys, "--model", "llama3-405b", "--seq", "131072", "--attention", "fused", "--recompute",
                       "full", "--cp", "16", "--tp", "8", "--sp", "--pp", "16", "--batch", "16")
    cfg = Config.from_preset("llama3-405b", dtype="bf16", attention="fused")
    cp, n = row["cp"], 131072 // 16
    assert (cp["pp"], cp["microbatches"]) == (16, 16)
    assert cp["stage_peak_bytes"] == [ChunkForms(cfg, 16, n, "full", Layout(pp=16, tp=8, microbatches=16), s).peak_bytes
                                      for s in range(16)]
    assert cp["peak_bytes"] == cp["stage_peak_bytes"][0] == max(cp["stage_peak_bytes"])
    assert sorted(map(int, cp["every_peak_bytes"])) == list(range(1, 9))  # 126 layers over 16 stages: 8 at most


def test_zero_beside_tp_cp_and_pp_is_the_busiest_stages_rank(capsys):
    """Llama 3 405B's 4D layout at 128K tokens (tp 8, cp 16, pp 16, dp 4) with ZeRO-1 over the dp x cp = 64 ranks
    that share every weight: stage 0's rank holds the embedding's and 8 layers' tp slices, each unit padded to a
    multiple of 64 (written from the shapes here: fp32 weights, AdamW's two moments of its shards, one step count
    per unit)."""
    row = predict_json(capsys, "--model", "llama3-405b", "--seq", "131072", "--attention", "fused", "--recompute",
                       "full", "--zero", "1", "--dp", "4", "--cp", "16", "--tp", "8", "--sp", "--pp", "16",
                       "--batch", "16")
    zero, cfg = row["zero"], Config.from_preset("llama3-405b")
    assert (zero["pipeline_stage"], zero["tp"], zero["cp"], zero["pp"]) == (0, 8, 16, 16)
    h, kv, f, V = cfg.hidden, cfg.kv_dim, cfg.ffn, cfg.vocab
    layer = (2 * h * h + 2 * kv * h + 3 * h * f) // 8 + 2 * h  # q, o, k, v, gate, up, down sliced; two norms whole
    units = [V * h // 8] + [layer] * 8  # 126 layers over 16 stages: stage 0 has 8
    assert zero["parameters"] == sum(units)
    shards = sum(-(-n // 64) for n in units)
    assert zero["picockpt"] == {"param_bytes": 4 * 64 * shards, "grad_bytes": 4 * 64 * shards,
                                "optimizer_bytes": 8 * shards + 4 * len(units)}
    assert len(zero["stages"]) == 16 and zero["stages"][0]["picockpt"] == zero["picockpt"]


def test_zero_beside_ep_shards_the_experts_over_dp_and_the_rest_over_dp_x_ep(capsys):
    """Mixtral 8x7B, ZeRO-3 over dp 2 beside ep 4: a rank holds 2 of the 8 experts of every layer, sharded over its
    2 data-parallel ranks, and every other weight sharded over dp x ep = 8 (fp32 shards, written from the shapes;
    AdamW's two moments and a step count per unit); its activations are ep_forms.py's for balanced routing."""
    row = predict_json(capsys, "--model", "mixtral-8x7b", "--seq", "1024", "--recompute", "full", "--zero", "3",
                       "--dp", "2", "--ep", "4")
    zero, cfg = row["zero"], Config.from_preset("mixtral-8x7b")
    h, kv, f, E, V = cfg.hidden, cfg.kv_dim, cfg.ffn, cfg.experts, cfg.vocab
    dense = [V * h] + [2 * h * h + 2 * kv * h + 2 * h + E * h] * cfg.layers + [h + V * h]  # units over 8 ranks
    experts = [E // 4 * 3 * f * h] * cfg.layers  # each layer's 2 experts, over 2 ranks
    shards = sum(-(-n // 8) for n in dense) + sum(-(-n // 2) for n in experts)
    assert zero["picockpt"] == {"param_bytes": 4 * shards, "grad_bytes": 4 * shards,
                                "optimizer_bytes": 8 * shards + 4 * (len(dense) + len(experts))}
    assert zero["ep"] == 4 and zero["picockpt_activation_bytes"] > 0


@pytest.mark.parametrize("args,message", [
    (["--ep", "2", "--experts", "4"], "--ep 2 without --zero: predict computes expert parallelism beside ZeRO"),
    (["--ep", "3", "--experts", "4", "--zero", "1", "--dp", "2"], "--ep 3 with --experts 4: each rank holds E/ep"),
    (["--zero", "2"], "--zero 2 with --dp 1"),
    (["--zero", "4", "--dp", "8"], "invalid choice: 4"),
    (["--dp", "8"], "--dp 8 without --zero"),
    (["--zero", "3", "--dp", "8", "--tp", "3"], "--tp=3: the tensor-parallel size must divide the 32 attention heads"),
    (["--cp", "4"], "--cp 4 with --attention eager: eager attention keeps the probabilities"),
    (["--cp", "4", "--tp", "8", "--attention", "fused", "--cp-comm", "allgather", "--keep-kv"],
     "--keep-kv with --tp 8"),
    (["--cp", "4", "--tp", "8", "--sp", "--seq", "8", "--attention", "fused"],
     "--seq 8 with --cp 4 --tp 8 --sp: sequence parallelism splits each context-parallel rank's 2 tokens"),
    (["--keep-kv"], "--keep-kv without --cp"),
    (["--schedule", "zb-h1"], "--schedule zb-h1 without --pp"),
    (["--pp", "2", "--batch", "4", "--microbatches", "4", "--schedule", "interleaved", "--virtual-stages", "3",
      "--layers", "4"], "--pp 2 x --virtual-stages 3 = 6 chunks for 4 layers"),
    (["--pp", "4", "--cp", "2", "--attention", "fused", "--batch", "3"], "--batch 3 with --pp 4: --pp's 4 micro-"),
    (["--cp", "3", "--seq", "4096", "--attention", "fused"], "--seq 4096 with --cp 3: zigzag cuts each sequence"),
    (["--gpu-gib", "0"], "--gpu-gib=0"),
])
def test_parallel_mistakes_are_one_line_errors(capsys, args, message):
    try:  # in this process (test_user_mistakes_are_one_line_errors runs the command itself)
        code = main(["predict", *args])
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err

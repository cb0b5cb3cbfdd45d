"""predict's and plan's messages: one line naming the flag that is wrong and what works, suggestions that run,
the dtype the help states, the offload plan's JSON keys and why offloading cannot lower a peak."""
import json
import re

import pytest

from picockpt import Config
from picockpt.cli import main
from picockpt.cli.predict_layouts import layouts_for

TINY = ["--preset", "tiny", "--batch", "2", "--seq", "16"]
RATES = ["--host-bandwidth", "1e12", "--compute-rate", "1e9"]  # a fast link, a slow device: offloading pays


def run(capsys, *argv):
    """(exit code, stdout, stderr) of `python -m picockpt ARGV`, in this process (argparse's exits too)."""
    try:
        code = main(list(argv))
    except SystemExit as exit:
        code = exit.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv,phrase", [
    (["predict", "--gpu-gib", "inf"], "--gpu-gib=inf: give one GPU's memory as a positive finite number of GiB"),
    (["predict", "--gpu-gib", "nan"], "--gpu-gib=nan: give one GPU's memory as a positive finite number of GiB"),
    (["predict", "--gpu-gib", "1e400"], "--gpu-gib=inf: give one GPU's memory as a positive finite number"),
    (["predict", "--gpu-gib", "-1"], "--gpu-gib=-1: give one GPU's memory as a positive finite number"),
    (["predict", "--gpu-gib", "0"], "--gpu-gib=0: give one GPU's memory as a positive finite number"),
    (["predict", "--gpu-gib", "True"], "argument --gpu-gib: invalid float value: 'True'"),
    (["predict", "--tp", "0"], "--tp=0: give a whole number of tensor-parallel ranks, 1 or more"),
    (["predict", "--tp", "-2"], "--tp=-2: give a whole number of tensor-parallel ranks, 1 or more"),
    (["predict", "--tp", "True"], "argument --tp: invalid int value: 'True'"),
    (["predict", "--cp", "0"], "--cp=0: give a whole number of context-parallel ranks, 1 or more"),
    (["predict", "--pp", "0"], "--pp=0: give 1 to 32 stages (the model's layers)"),
    (["predict", "--pp", "-2"], "--pp=-2: give 1 to 32 stages"),
    (["predict", "--pp", "33", "--cp", "2", "--attention", "fused"], "--pp=33: give 1 to 32 stages"),
    (["predict", "--microbatches", "0", "--pp", "2", "--cp", "2", "--attention", "fused", "--batch", "2"],
     "--microbatches=0: give a whole number of micro-batches, 1 or more"),
    (["predict", "--microbatches", "-1", "--pp", "2", "--cp", "2", "--attention", "fused"],
     "--microbatches=-1: give a whole number of micro-batches, 1 or more"),
    (["predict", "--cp", "2", "--pp", "2", "--microbatches", "3", "--batch", "4", "--attention", "fused"],
     "--microbatches 3 does not divide --batch 4: each micro-batch takes --batch / M sequences; use --microbatches "
     "1, 2, 4, or --batch a multiple of 3"),
    (["predict", "--dp", "0", "--zero", "1"], "--zero 1 with --dp 0: ZeRO shards over data-parallel ranks"),
    (["predict", "--batch", "0"], "--batch 0: must be a positive integer"),
    (["predict", "--seq", "-1"], "--seq -1: must be a positive integer"),
    (["predict", "--dropout", "nan"], "--dropout nan: must be a finite number"),
    (["predict", "--cp", "2", "--attention", "tiled", "--dropout", "0.1"], "--cp 2 needs --dropout 0"),
    (["predict", "--cp", "2", "--keep-kv", "--attention", "fused"],
     "--keep-kv with --cp-comm ring: it keeps the all-gathered K/V of the other ranks; add --cp-comm allgather"),
    (["plan", *TINY, "--budget", "0"], "--budget='0': size '0' must be positive"),
    (["plan", *TINY, "--budget", "inf"], "--budget='inf': size 'inf' is not understood"),
    (["plan", *TINY, "--budget", "nan"], "--budget='nan': size 'nan' is not understood"),
    (["plan", *TINY, "--budget", "True"], "--budget='True': size 'True' is not understood"),
    (["plan", *TINY, "--budget", "1MiB", "--offload", "--budget", "-1"], "--budget='-1': size '-1' must be positive"),
    (["plan", *TINY, "--budget", "1MiB", "--host-bandwidth", "inf"], "--host-bandwidth=inf: give a positive number"),
    (["plan", *TINY, "--budget", "1MiB", "--host-bandwidth", "nan"], "--host-bandwidth=nan: give a positive number"),
    (["plan", *TINY, "--budget", "1MiB", "--compute-rate", "0"], "--compute-rate=0: give a positive number"),
    (["plan", *TINY, "--budget", "1MiB", "--compute-rate", "-1"], "--compute-rate=-1: give a positive number"),
    (["plan", *TINY, "--budget", "1MiB", "--compute-rate", "True"], "argument --compute-rate: invalid float value"),
    (["plan", "--chain", "uniform", "--length", "0", "--slots", "3"], "--length 0: the chain needs a whole number"),
    (["plan", "--chain", "uniform", "--length", "10", "--slots", "-1"], "--slots -1: at least 1 slot is needed"),
    (["plan", *TINY, "--budget", "1MiB", "--measure", "--seed", "-1"], "--seed=-1: use a whole number from 0"),
])
def test_bad_values_are_one_line_errors(capsys, argv, phrase):
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and phrase in err and "Traceback" not in err, err


def test_a_cp_and_pp_layout_blames_the_batch_and_its_fix_runs(capsys):
    argv = ["predict", "--cp", "2", "--pp", "2", "--attention", "fused", "--seq", "1024", "--json"]
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.startswith("error: --batch 1 with --pp 2: --pp's 2 micro-batches (--microbatches "
                                        "defaults to --pp) split --batch, so it must be a multiple of 2; use "
                                        "--batch 2")
    assert "--microbatches=" not in err
    code, out, _ = run(capsys, *argv, "--batch", "2")
    assert code == 0 and json.loads(out)["cp"]["microbatches"] == 2


@pytest.mark.parametrize("argv", [["--microbatches", "4"], ["--microbatches", "3", "--batch", "2"]])
def test_micro_batches_or_stages_without_their_partner_suggest_flags_that_run(capsys, argv):
    code, _, err = run(capsys, "predict", "--seq", "1024", *argv)
    assert code == 2 and "--pp 1" not in err
    example = re.search(r"e\.g\. ((?:--[a-z-]+ \w+ ?)+),", err)
    assert example, err
    flags = example.group(1).split()
    code, out, _ = run(capsys, "predict", "--seq", "1024", *argv, *flags, "--json")
    assert code == 0 and json.loads(out)["cp"]["pp"] >= 2


@pytest.mark.parametrize("argv,start", [
    (["--cp", "2", "--attention", "fused", "--seq", "4098"],
     "error: --seq 4098 with --cp 2: zigzag cuts each sequence into 2 x cp = 4 equal chunks"),
    (["--cp", "4", "--tp", "8", "--sp", "--seq", "8", "--attention", "fused"],
     "error: --seq 8 with --cp 4 --tp 8 --sp: sequence parallelism splits"),
    (["--cp", "2", "--tp", "16", "--attention", "fused"], "error: --tp 16 beside --cp 2: --tp 16 is larger than allowed"),
    (["--cp", "2", "--model", "mixtral-8x7b", "--attention", "fused"], "error: --cp 2 needs a dense MLP, and this "
                                                                        "model has 8 experts (--experts)"),
    (["--cp", "2"], "error: --cp 2 with --attention eager: eager attention keeps the probabilities"),
])
def test_errors_name_the_flag_that_is_wrong_not_cp(capsys, argv, start):
    code, _, err = run(capsys, "predict", *argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith(start) and not err.startswith("error: --cp="), err


def test_the_help_states_the_dtype_predict_computes(capsys):
    code, out, _ = run(capsys, "predict", "--help")
    assert code == 0 and "(default bf16)" in " ".join(out.split()) and "(default fp32)" not in out
    code, out, _ = run(capsys, "predict", "--seq", "512", "--json")
    assert code == 0 and json.loads(out)["picockpt_dtype"] == "bfloat16"
    code, out, _ = run(capsys, "measure", "--help")  # the other commands compute the preset's fp32
    assert code == 0 and "(default fp32)" in " ".join(out.split())


def test_layouts_for_a_world_size_include_cp_and_ep_where_the_model_allows():
    cfg = Config.from_preset("llama3-8b")
    four = layouts_for(cfg, 4096, 4)
    assert four == ("layouts of 4 ranks predict computes for this model: --tp 4; --cp 4 --attention fused; "
                    "--tp 2 --cp 2 --attention fused; --zero 3 --dp 4 (the model state sharded, the activations "
                    "whole)")
    moe = layouts_for(Config.from_preset("mixtral-8x7b"), 4096, 4)
    assert "expert parallelism over 4 ranks (2 of the 8 experts each)" in moe and "--cp" not in moe
    assert "expert parallelism" not in four
    assert layouts_for(cfg, 4096, 3) == (
        "no layout of 3 ranks splits this model's activations (--tp 3 needs 3 to divide the 32 heads; --cp 3 needs "
        "--seq a multiple of 2 x 3 = 6 (zigzag: a front and a back chunk per rank); no tp x cp product of 3 fits "
        "either); --zero 3 --dp 3 (the model state sharded, the activations whole) fits")
    for model in (cfg, Config.from_preset("mixtral-8x7b"), Config.from_preset("tiny")):
        for ranks in range(2, 41):  # never an empty list: a layout, or why none splits the activations
            text = layouts_for(model, 4096, ranks)
            assert "computes for this model: --" in text or text.startswith(f"no layout of {ranks} ranks"), text


def test_each_suggested_layout_runs(capsys):
    text = layouts_for(Config.from_preset("llama3-8b", dtype="bf16"), 4096, 4)
    layouts = [part.split(" (")[0] for part in text.split(": ", 1)[1].split("; ")]
    assert layouts == ["--tp 4", "--cp 4 --attention fused", "--tp 2 --cp 2 --attention fused", "--zero 3 --dp 4"]
    for layout in layouts:
        code, _, err = run(capsys, "predict", "--seq", "4096", *layout.split(), "--json")
        assert code == 0, (layout, err)


def test_tp_error_suggests_layouts_of_as_many_ranks(capsys):
    code, _, err = run(capsys, "predict", "--tp", "3", "--model", "mixtral-8x7b")
    assert code == 2 and err.count("\n") == 1
    assert "or for 3 ranks: no layout of 3 ranks splits this model's activations (--tp 3 needs 3 to divide the 32 " \
           "heads; --cp 3 needs a dense MLP, and this model has 8 experts (--experts)" in err


def test_offload_json_has_every_key_of_the_plain_plan(capsys):
    code, plain, _ = run(capsys, "plan", *TINY, "--budget", "60KiB", "--json")
    assert code == 0
    code, offload, _ = run(capsys, "plan", *TINY, "--budget", "60KiB", "--offload", "--json")
    assert code == 0
    plain, offload = json.loads(plain), json.loads(offload)
    assert set(plain) <= set(offload), set(plain) - set(offload)
    for key in ("budget_bytes", "forward_flops", "least_budget_bytes"):  # the same meaning, the same numbers
        assert offload[key] == plain[key], key
    assert offload["least_budget_bytes"] == 45312 and offload["forward"] == plain["forward"]


def test_offload_plan_says_why_it_cannot_lower_the_peak(capsys):
    code, out, _ = run(capsys, "plan", *TINY, "--budget", "45312", "--offload")
    assert code == 0
    assert ("why offloading does not lower the peak: device peak 45,312 B, the two-action plan's too: it is set "
            "while layer 1 is recomputed for its backward, holding layer 1's tensors (41,216 B) and layer 0's "
            "checkpoint (4,096 B); ") in out
    assert "a recomputed layer's tensors are made on the device and read there by the backward that follows" in out
    code, out, _ = run(capsys, "plan", *TINY, "--budget", "80938", *RATES)  # offloads layer 0, the head sets the peak
    assert code == 0 and "offload (all it stores) + recompute" in out
    assert "it is set at the head (the logits and loss), holding layer 1's tensors (67,840 B) and the head's logits " \
           "and loss (12,416 B); the logits and loss are made and read inside the head" in out
    code, out, _ = run(capsys, "plan", *TINY, "--budget", "116564", *RATES, "--json")  # here offloading lowers it
    row = json.loads(out)
    assert code == 0 and row["peak_bytes"] == 109056 < row["two_action"]["peak_bytes"] and row["peak_reason"] is None


def test_offload_budget_below_the_least_says_what_sets_that_peak(capsys):
    code, _, err = run(capsys, "plan", *TINY, "--budget", "1KiB", "--offload")
    assert code == 2 and err.count("\n") == 1
    assert "below the least device peak of any plan with offloading, 45,312 bytes (0.04 MiB): give a budget of at " \
           "least that (it is set in layer 1's backward, as tensors come back from the host, holding layer 1's " \
           "tensors (41,216 B) and layer 0's checkpoint (4,096 B); a layer's backward reads its tensors" in err

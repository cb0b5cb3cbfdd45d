"""The commands people type: JSON keys, tables, clear errors."""
import json

import pytest

from commands import picockpt as run_command
from picockpt import Config
from picockpt.measurement.compare import compare
from picockpt.model.params import param_shapes


def picockpt(*args, check=True):
    return run_command(*args, check=check)


def test_measure_json_has_the_documented_keys():
    out = picockpt("measure", "--preset", "tiny", "--layers", "5", "--seq", "24", "--policy", "every:2+selective",
                   "--device", "cpu", "--repeats", "1", "--attention", "tiled", "--loss-chunk", "7", "--json")
    row = json.loads(out.stdout)
    for key in ("policy", "peak_activation_bytes", "predicted_activation_bytes", "peak_live_bytes",
                "forward_flops", "recompute_flops", "backward_flops", "step_seconds", "loss",
                "grad_max_abs_diff_vs_none", "attention", "loss_chunk"):
        assert key in row, key
    assert row["policy"] == "every:2+selective"
    assert (row["attention"], row["loss_chunk"]) == ("tiled", 7)
    assert row["peak_activation_bytes"] == row["predicted_activation_bytes"]
    assert row["grad_max_abs_diff_vs_none"] == 0.0
    assert row["peak_live_bytes"] >= row["peak_activation_bytes"]


def test_measure_table_and_trace():
    out = picockpt("measure", "--preset", "tiny", "--seq", "8", "--policy", "full", "--trace", "--repeats", "1")
    assert "recompute segment [1..1] from the input of layer 1" in out.stdout
    assert "peak stored activations (logical)" in out.stdout and "bytes" in out.stdout


def test_measure_without_an_optimizer_is_a_forward_and_backward_alone(monkeypatch):
    """--no-optimizer: no AdamW step (no optimizer phase, no state), the same stored bytes and gradients; the fit
    check then asks 8 bytes a parameter less (AdamW's two fp32 moments)."""
    from picockpt.planning import fit
    args = ("measure", "--preset", "tiny", "--seq", "16", "--policy", "full", "--device", "cpu", "--repeats", "1",
            "--json")
    with_adamw, alone = (json.loads(picockpt(*args, *extra).stdout) for extra in ((), ("--no-optimizer",)))
    assert (with_adamw["optimizer"], alone["optimizer"]) == ("AdamW", None)
    tiny = Config.from_preset("tiny")  # AdamW: two fp32 moments a parameter and an fp32 step count a tensor
    assert with_adamw["optimizer_state_bytes"] == 8 * tiny.num_params() + 4 * len(param_shapes(tiny))
    assert alone["optimizer_state_bytes"] == 0
    assert "optimizer" in with_adamw["phase_peaks"] and "optimizer" not in alone["phase_peaks"]
    assert alone["peak_activation_bytes"] == with_adamw["peak_activation_bytes"] == alone["predicted_activation_bytes"]
    assert alone["grad_max_abs_diff_vs_none"] == 0.0
    cfg = Config.from_preset("llama3-8b", dtype="bf16", attention="fused", max_seq=8192)
    whole, forward_backward = (fit.step_bytes(cfg, 1, 8192, "none", optimizer) for optimizer in (True, False))
    assert whole["state"] - forward_backward["state"] == 8 * cfg.num_params()
    monkeypatch.setattr(fit, "available_bytes", lambda device: (140 * 2**30, "a 140 GiB device"))
    with pytest.raises(ValueError, match="weights, gradients and AdamW state"):
        fit.check_fits(cfg, "cpu", 1, 8192, "none")  # 186 GiB with AdamW's state
    fit.check_fits(cfg, "cpu", 1, 8192, "none", optimizer=False)  # 127 GiB without: Llama 3 8B at T=8192 fits


@pytest.mark.parametrize("args,message", [
    (["measure", "--policy", "every:0"], "every:C needs a whole number"),
    (["measure", "--preset", "tiny", "--policy", "every:3"], "larger than the number of layers"),
    (["measure", "--hidden", "130"], "not divisible by --heads"),
    (["measure", "--batch", "0"], "--batch 0"),
    (["compare", "--preset", "tiny", "--segment", "5"], "--segment=5"),
    (["inventory", "--preset", "tiny", "--layer", "9"], "--layer=9"),
])
def test_user_mistakes_are_one_line_errors(args, message):
    out = picockpt(*args, "--device", "cpu", check=False)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


def test_inventory_command_agrees_with_the_closed_form():
    out = picockpt("inventory", "--preset", "tiny", "--dropout", "0.1", "--policy", "selective")
    assert "differs" not in out.stdout and "attn.probs_mask" in out.stdout


@pytest.mark.slow
def test_compare_memory_against_pytorch():
    rows = {r["name"]: r for r in compare(Config.from_preset("small", layers=4), 2, 64, segment=2, repeats=1,
                                          log=None)}
    losses = {round(r["loss"], 4) for r in rows.values()}
    assert len(losses) == 1  # every contender computes the same loss
    for name, row in rows.items():  # and the same gradients (fp32: summation orders differ)
        assert row["grad_max_rel_diff"] <= 1e-5, (name, row["grad_max_rel_diff"])
    assert rows["picockpt full"]["grad_max_rel_diff"] == 0  # recomputation is bitwise
    for name, row in rows.items():
        if row["kind"] == "picockpt" and row["memory_vs_equivalent"] is not None:
            assert row["memory_vs_equivalent"] <= 1.0, name
    # the same recomputation as torch's: one extra forward of every layer (torch stops early, see lesson 10)
    assert rows["picockpt full"]["recompute_flops"] == rows["bridge full"]["recompute_flops"]
    assert rows["torch checkpoint per layer"]["recompute_flops"] < rows["picockpt full"]["recompute_flops"]


def test_compare_checks_the_hugging_face_contenders_gradients_under_fused_attention():
    rows = {r["name"]: r for r in compare(Config.from_preset("tiny", attention="fused"), 2, 16, repeats=1, log=None)}
    assert {"HF eager", "HF eager + checkpointing", "HF sdpa", "HF sdpa + checkpointing"} <= set(rows)
    for name, row in rows.items():
        assert row["grad_max_rel_diff"] <= 1e-5, (name, row["grad_max_rel_diff"])
    assert rows["picockpt full"]["equivalent"] == "HF sdpa + checkpointing"


@pytest.mark.parametrize("command,phrases", [
    ("train", ["--log-every", "print every N steps, and the last", "seed for weights, data and dropout"]),
    ("measure", ["median reported (default 3, at least 1)"]),
    ("compare", ["interleaved timed repeats (default 7, at least 1)"]),
    ("plan", ["an error with --chain uniform or --benchmark", "l^2 x s up to 4e8", "refused, with the numbers"]),
    ("predict", ["none (default), selective or full (any case)", "sequence parallelism; needs --tp t > 1"]),
    ("reproduce", ["Figures go to out/figures/ (or $PICOCKPT_FIGURES), never over the committed ones"]),
])
def test_help_explains_the_flags(command, phrases):
    out = picockpt(command, "--help")
    text = " ".join(out.stdout.split())  # argparse wraps lines
    for phrase in phrases:
        assert phrase in text, (command, phrase)


@pytest.mark.slow
def test_compare_json_is_json_alone_and_its_losses_follow_the_seed():
    args = ("compare", "--preset", "tiny", "--seq", "8", "--dropout", "0.1", "--repeats", "1", "--device", "cpu",
            "--json", "--seed")
    first, second = (picockpt(*args, "2") for _ in range(2))
    rows = json.loads(first.stdout)  # progress lines go to stderr
    assert "comparing on cpu" in first.stderr
    assert [row["loss"] for row in rows] == [row["loss"] for row in json.loads(second.stdout)]
    assert {round(row["loss"], 5) for row in rows} == {round(rows[0]["loss"], 5)}  # every run, the same masks


@pytest.mark.parametrize("args,message", [
    (["--preset", "tiny", "measure"], "error: '--preset tiny' comes before the command: flags follow it, as in "
                                      "`python -m picockpt measure --preset tiny`"),
    (["measure", "--preset", "tiny", "--attention-tile", "8"], "error: --attention-tile=8 with --attention eager: "
                                                               "only tiled attention works in tiles"),
    (["plan", "--budget", "1MiB", "--device", "cuda"], "error: --device: not used by --chain model"),
    (["notebooks", "--only", "99"], "the lessons are 00, 01"),
])
def test_flags_that_would_be_ignored_or_misplaced_are_one_line_errors(args, message):
    out = picockpt(*args, check=False)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    if args[0] == "notebooks":  # notebooks has no --list of its own: the hint names the command that has one
        assert "(`python -m picockpt reproduce --list` names them)" in out.stderr


def test_predict_gives_the_one_rank_figures_of_a_mixture_of_experts():
    out = picockpt("predict", "--model", "mixtral-8x7b", "--json")
    rows = json.loads(out.stdout)["table2"]
    assert rows[0]["picockpt_bytes"] == 1996718080  # one rank holds the whole model: the exact store's layer
    assert all(row["picockpt_bytes"] is not None for row in rows)


@pytest.mark.parametrize("layers, segment, peer", [(2, 2, None), (4, 2, "torch checkpoint_sequential(2)"),
                                                   (4, 3, "torch checkpoint_sequential(2)")])
def test_every_c_is_paired_with_checkpoint_sequential_only_when_that_checkpoints_a_segment(layers, segment, peer):
    """checkpoint_sequential runs its last segment without checkpointing: in one segment it is plain autograd, which
    stores everything and recomputes nothing, so no ratio is printed against every:C's recomputation."""
    from picockpt.measurement.compare import contenders
    rows = {name: equivalent for name, _, _, equivalent in contenders(Config.from_preset("tiny", layers=layers), 16,
                                                                     segment)}
    assert rows[f"picockpt every:{segment}"] == peer and rows[f"bridge every:{segment}"] == peer

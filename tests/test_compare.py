"""compare: the min-cut partitioner's runs, and a gradient check that can fail.

Tiny shapes and a few contenders each (compare(only=...)); the two compiled cases trace a
one-layer model through AOTAutograd (a few seconds each).
"""
import json

import pytest

from picockpt import Config, init_params
from picockpt.cli import main
from picockpt.measurement.compare import GRAD_TOLERANCE, compare, reference_masks_match
from picockpt.measurement.measure import make_batch, max_relative_diff
from picockpt.measurement.peers import min_cut
from picockpt.measurement.reference import ReferenceLlama
from picockpt.teaching.reproduce import LESSONS, load

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def rows_by_name(cfg, seq=16, **kwargs):
    rows = compare(cfg, 2, seq, repeats=1, log=None, **kwargs)
    return {row["name"]: row for row in rows}


@pytest.mark.compile
def test_min_cut_peer_gradients_and_recompute():
    """Without dropout the partitioner's gradients are autograd's at every budget, and budget 0
    recomputes the whole forward (its FLOPs counted inside the backward graph)."""
    cfg = Config.from_preset("tiny", layers=1)
    params = init_params(cfg, seed=0)
    ids, targets = make_batch(cfg, 2, 8, "cpu", 0)
    model = ReferenceLlama(cfg, params)
    model(ids, targets).backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    graphs = {}
    compiled = min_cut(model, 0.0, graphs)
    model.zero_grad(set_to_none=True)
    compiled(ids, targets).backward()
    for name, p in model.named_parameters():
        assert max_relative_diff(p.grad, reference[name]) < GRAD_TOLERANCE["float32"], name
    order = load(LESSONS / "12_budget_planner.py").backward_order(graphs)  # what lesson 12's sweep table reads
    assert order["from_x0"]  # budget 0 rebuilds x0 from the ids: the embedding lookup is in the backward graph
    assert order["recomputed_matmuls"] == 7 + 2 + 1  # q k v o gate up down, q k^T and P v, and the head


@pytest.mark.parametrize("budget", [1.5, -0.1, float("nan"), True, "0.5"])
def test_min_cut_refuses_budgets_outside_0_to_1(budget):
    cfg = Config.from_preset("tiny", layers=1)
    with pytest.raises(ValueError, match="0 <= budget <= 1"):
        min_cut(ReferenceLlama(cfg, init_params(cfg)), budget)
    with pytest.raises(ValueError, match="min_cut="):
        compare(cfg, 2, 8, min_cut=(budget,), log=None)


def test_compare_refuses_what_min_cut_cannot_measure():
    with pytest.raises(ValueError, match="dtype=bfloat16"):
        compare(Config.from_preset("tiny", dtype="bf16"), 2, 8, min_cut=(0.5,), log=None)
    with pytest.raises(ValueError, match="aten.nonzero"):
        compare(Config.from_preset("tiny", experts=4, experts_per_token=2), 2, 8, min_cut=(0.5,), log=None)
    with pytest.raises(ValueError, match="no such contender"):
        compare(Config.from_preset("tiny"), 2, 8, only=["picockpt everything"], log=None)


def test_different_dropout_masks_are_checked_against_their_own_family():
    """tiled attention with dropout: the reference model's runs draw other masks than picockpt's, so they
    are checked against autograd (and pass), not reported as 1.2 'within' picockpt none's."""
    cfg = Config.from_preset("tiny", attention="tiled", dropout=0.1)
    assert not reference_masks_match(cfg) and reference_masks_match(cfg.replace(attention="eager"))
    rows = rows_by_name(cfg, only=["picockpt full", "torch checkpoint per layer"])
    assert set(rows) == {"picockpt none", "picockpt full", "autograd", "torch checkpoint per layer"}
    assert rows["picockpt full"]["grad_checked_against"] == "picockpt none"
    assert rows["torch checkpoint per layer"]["grad_checked_against"] == "autograd"
    assert rows["autograd"]["dropout_masks"] == "the reference model's"
    assert all(row["grad_ok"] for row in rows.values())
    assert rows["autograd"]["loss"] != rows["picockpt none"]["loss"]  # the masks do differ


def test_cli_flags_other_masks_and_passes(capsys):
    code = main(["compare", "--preset", "tiny", "--batch", "2", "--seq", "8", "--repeats", "1", "--attention",
                 "tiled", "--dropout", "0.1", "--device", "cpu", "--segment", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "dropout masks differ" in out and "checked against autograd" in out and "FAILED" not in out
    assert "within 1.2e+00" not in out and "of autograd's" in out


@pytest.mark.compile
def test_failing_gradient_check_says_failed_and_exits_non_zero(monkeypatch, capsys):
    """With dropout the min-cut partitioner recomputes aten.rand in its backward with fresh numbers
    (pytorch/pytorch#190758): its gradients are wrong, and compare must say so. The command as a user
    runs it, with only the bases and that run (compare(only=...)) to keep the test short."""
    import picockpt.cli.compare as command
    cut = "min-cut partitioner, budget 0.5"
    monkeypatch.setattr(command, "compare", lambda *args, **kwargs: compare(*args, **kwargs, only=[cut]))
    code = main(["compare", "--preset", "tiny", "--layers", "1", "--batch", "2", "--seq", "8", "--repeats", "1",
                 "--dropout", "0.1", "--min-cut", "0.5", "--device", "cpu", "--segment", "1", "--json"])
    out = capsys.readouterr()
    assert code == 1, out.err
    rows = {row["name"]: row for row in json.loads(out.out)}
    assert set(rows) == {"picockpt none", "autograd", cut}
    assert not rows[cut]["grad_ok"] and rows[cut]["grad_max_rel_diff"] > 0.1 and rows[cut]["peak_live_bytes"] > 0
    assert rows[cut]["recompute_flops"] > 0 and rows["autograd"]["grad_ok"]
    assert f"FAILED: {cut}" in out.err and "gradient check FAILED for 1 of 3 runs" in out.err


def test_cli_min_cut_flag(capsys):
    for flag, message in (("2", "0 <= budget <= 1"), ("0.5,0.5", "given twice"), ("x", "comma separated"),
                          ("0.5", "--dtype bfloat16")):
        assert main(["compare", "--preset", "tiny", "--dtype", "bf16", "--min-cut", flag]) == 2
        out = capsys.readouterr()
        assert message in out.err and "comparing on" not in out.out, out  # refused before any work


def test_bf16_hugging_face_rows_under_autocast():
    """In bf16 Hugging Face runs under torch.autocast over fp32 master weights: its rows are listed, their
    gradients checked against picockpt's fp32 step within twice picockpt bf16's own distance from it, and
    picockpt full with the weight copies recast holds no more, by the tracked total, than HF sdpa with its
    checkpointing (which recasts in the recompute), on the same shape."""
    pytest.importorskip("transformers")
    cfg = Config.from_preset("tiny", dtype="bfloat16", attention="fused", layers=4)
    runs = ["picockpt full", "picockpt full+recast", "HF sdpa + checkpointing"]
    rows = rows_by_name(cfg, seq=64, only=runs)
    assert all(row["grad_ok"] for row in rows.values()), \
        {name: (row["grad_max_rel_diff"], row["grad_tolerance"]) for name, row in rows.items()}
    peer = rows["HF sdpa + checkpointing"]
    assert peer["grad_checked_against"] == "picockpt none in float32" and 0 < peer["grad_tolerance"] < 0.1
    totals = {name: rows[name]["peak_total_bytes"] for name in runs}
    assert totals["picockpt full+recast"] <= totals["HF sdpa + checkpointing"], totals
    assert rows["picockpt full+recast"]["memory_compared"] == "peak_total_bytes"

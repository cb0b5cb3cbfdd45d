"""ZeRO from the command line and the API's front door: `parallel --dp 2 --zero 3` (and beside --tp), `train --dp 2
--zero 2`, and what each refuses before any rank starts."""
import json
import multiprocessing

import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.measurement.measure import make_batch
from picockpt.parallel.training import zero_train
from picockpt.parallel import Layout

from processes import no_process_left_behind  # noqa: F401 (a fixture)

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
BATCH, SEQ = 4, 8
BASE = dict(vocab=65, hidden=30, layers=3, heads=3, kv_heads=1, ffn=25, max_seq=64)
ZERO_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "gathered_peak_bytes", "zero_bytes_by_kind")  # predicted_
pytestmark = pytest.mark.usefixtures("no_process_left_behind", "one_thread")  # conftest.py: one torch thread


@pytest.mark.ranks
def test_the_api_and_the_command_run_zero_and_refuse_what_it_cannot(capsys):
    """parallel.loss_and_grads(..., dp=2, zero=3) and `python -m picockpt parallel --dp 2 --zero 3 --json`: the
    single process's gradients, every rank's model state, stored peak and bytes per phase equal to their
    closed forms, one AdamW step's state on the command line; a clear error for what ZeRO still refuses."""
    from picockpt import parallel
    from picockpt.cli import main
    cfg = Config(**BASE)
    params = init_params(cfg, seed=0)
    input_ids, targets = make_batch(cfg, BATCH, SEQ, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"^zero=3 with dp=1: .*nothing to shard"):  # no dp, ep or cp to shard over
        parallel.loss_and_grads(params, cfg, input_ids, targets, "full", Layout(pp=2, zero=3))
    with pytest.raises(ValueError, match=r"^keep_gathered=True without zero"):
        parallel.loss_and_grads(params, cfg, input_ids, targets, "full", Layout(dp=2, keep_gathered=True))
    _, grads0 = loss_and_grads(params, cfg, input_ids, targets, "none")
    _, grads, ranks = parallel.loss_and_grads(params, cfg, input_ids, targets, "every:2",
                                              Layout(dp=2, zero=3, keep_gathered=True), start_method=START)
    assert max(((grads[k] - grads0[k]).abs().max() / grads0[k].abs().max()).item() for k in grads0) <= 1e-5
    for r in ranks:
        for key in ZERO_KEYS:
            assert r[key] == r["predicted_" + key], (r["rank"], key)
        assert r["peak_activation_bytes"] == r["predicted_activation_bytes"] and r["optimizer_bytes"] == 0
    assert main(["parallel", "--dp", "2", "--zero", "3", "--keep-gathered", "--policy", "full", "--preset", "tiny",
                 "--batch", "2", "--seq", "8", "--device", "cpu", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["zero"] == 3 and row["grad_max_rel_diff_vs_single"] <= 1e-5
    assert {key: row[key] for key in ("tp", "pp", "microbatches", "ep", "cp", "cp_comm", "keep_gathered")} == \
        dict(tp=1, pp=1, microbatches=1, ep=1, cp=1, cp_comm="ring", keep_gathered=True)  # every layout's keys
    for r in row["ranks"]:
        assert r["optimizer_bytes"] == r["predicted_optimizer_bytes"] > 0  # after one AdamW step on the shards
        assert r["zero_bytes_by_kind"] == r["predicted_zero_bytes_by_kind"] and not r["zero_bytes_by_kind"]["optimizer"]
        assert r["zero_bytes_by_kind"]["backward"].get("all_gather", 0) == 0  # keep_gathered: none again
        assert r["dp_bytes"] == r["predicted_dp_bytes"] == sum(n for kinds in r["zero_bytes_by_kind"].values()
                                                                for n in kinds.values())


@pytest.mark.ranks
def test_the_command_stacks_zero_on_tensor_parallelism(capsys):
    """`parallel --dp 2 --zero 2 --tp 2`: 4 ranks, each sharding its tensor-parallel slices over its 2 data-parallel
    ranks; the layout's keys and ZeRO's per rank, every ZeRO count equal to its closed form, and the table
    printing ZeRO's beside the layout's."""
    from picockpt.cli import main
    flags = ["parallel", "--dp", "2", "--zero", "2", "--tp", "2", "--preset", "tiny", "--batch", "2", "--seq", "8",
             "--device", "cpu"]
    assert main(flags + ["--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["zero"] == 2 and row["tp"] == 2 and row["dp"] == 2 and len(row["ranks"]) == 4
    assert row["grad_max_rel_diff_vs_single"] <= 1e-5
    assert sorted((r["dp_rank"], r["tp_rank"]) for r in row["ranks"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in row["ranks"]:
        assert r["zero"] == 2 and r["tp"] == 2
        for key in ZERO_KEYS + ("dp_bytes",):
            assert r[key] == r["predicted_" + key], (r["rank"], key)
        assert r["peak_activation_bytes"] == r["predicted_activation_bytes"]
        assert r["comm_bytes"] == r["predicted_comm_bytes"] and r["comm_bytes"]["forward"] > 0  # the tp layers'
        assert r["zero_bytes_by_kind"]["backward"]["reduce_scatter"] > 0 and r["optimizer_bytes"] > 0
    assert main(flags) == 0
    text = capsys.readouterr().out
    assert "dp=2, tp=2" in text and "ZeRO stage 2 over the data-parallel group (dp 2 = 2 ranks)" in text
    assert "closed forms (picockpt/parallel/data_parallel/zero_forms.py): yes" in text


def test_every_zero_layout_flag_reaches_the_job_and_zero_shards_over_dp_ep_and_cp(monkeypatch, capsys):
    """--zero goes through the same path as every layout: --cp and each --cp-* flag reach the job beside it
    (none dropped); without dp x ep x cp > 1 the command says what ZeRO shards over."""
    from picockpt.cli import main, parallel_run
    seen = {}

    class Captured(Exception):
        pass

    def capture(*args, **kwargs):
        seen.update(kwargs, **vars(kwargs["layout"]))  # the layout's fields, beside the call's own keywords
        raise Captured
    monkeypatch.setattr(parallel_run, "loss_and_grads", capture)
    tiny = ["parallel", "--preset", "tiny", "--batch", "4", "--seq", "16", "--device", "cpu"]
    with pytest.raises(Captured):
        main(tiny + ["--zero", "3", "--cp", "2", "--attention", "tiled", "--cp-layout", "contiguous", "--cp-comm",
                     "allgather", "--cp-keep-kv", "--tp", "2", "--no-prefetch"])
    assert {key: seen[key] for key in ("zero", "dp", "cp", "cp_layout", "cp_comm", "cp_keep_kv", "tp", "prefetch")} \
        == dict(zero=3, dp=1, cp=2, cp_layout="contiguous", cp_comm="allgather", cp_keep_kv=True, tp=2, prefetch=False)
    assert seen["optimizer_step"] is True
    for flag, kept in (["--keep-gathered"], True), (["--keep-gathered", "step"], "step"):  # with pp: torchtitan's
        with pytest.raises(Captured):
            main(tiny + ["--zero", "3", "--dp", "2", "--pp", "2", "--microbatches", "2", *flag])
        assert seen["keep_gathered"] == kept
    with pytest.raises(SystemExit):  # argparse's own refusal
        main(tiny + ["--zero", "3", "--dp", "2", "--keep-gathered", "always"])
    assert "invalid choice: 'always'" in capsys.readouterr().err
    assert main(tiny + ["--zero", "1", "--tp", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: --zero without --dp D, --ep N or --cp N (more than one rank in "
                                              "dp x ep x cp)")


@pytest.mark.ranks
def test_the_train_command_on_zero_ranks_prints_the_losses_of_training_in_one_process(capsys):
    """`train --dp 2 --zero 2` draws the single-process command's batches and weights for the seed: the same
    losses (to their 4 printed decimals, +-1 in the last), --log-every honoured, every rank's report equal to
    its closed forms."""
    from picockpt.cli import main
    flags = ["train", "--preset", "tiny", "--batch", "2", "--seq", "8", "--steps", "3", "--log-every", "2",
             "--device", "cpu"]
    assert main(flags) == 0
    alone = capsys.readouterr().out
    assert main(flags + ["--dp", "2", "--zero", "2"]) == 0
    sharded = capsys.readouterr().out

    def losses(text):
        return {line.split()[1]: float(line.split()[3]) for line in text.splitlines() if line.startswith("step ")}

    assert set(losses(sharded)) == set(losses(alone)) == {"0", "2"}
    assert all(abs(losses(sharded)[step] - loss) <= 1.5e-4 for step, loss in losses(alone).items())
    assert "over 2 ZeRO-2 ranks" in sharded and "closed forms (picockpt/parallel/data_parallel/zero_forms.py): " \
                                                "yes" in sharded
    assert [line.split()[0] for line in sharded.splitlines() if line[:2] in ("0 ", "1 ")] == ["0", "1"]  # a row each


def test_zero_training_refuses_what_it_cannot_before_any_rank_starts(capsys):
    from picockpt.cli import main
    cfg = Config(**BASE)
    params = init_params(cfg)
    batch = make_batch(cfg, BATCH, SEQ, "cpu", seed=0)
    wrong = (batch[0].clone(), batch[1])
    wrong[0][0, 0] = cfg.vocab
    for kwargs, words in ((dict(dp=1), "nothing to shard"), (dict(dp=0), r"dp=0: use a whole number"),
                          (dict(zero=4), "stages are 1"), (dict(batches=[]), "non-empty list"),
                          (dict(batches="batch"), "non-empty list"), (dict(batches=[batch, batch[0]]), "one pair"),
                          (dict(batches=[batch, (batch[0][:, :4], batch[1][:, :4])]), r"batches\[1\] is \(4, 4\)"),
                          (dict(batches=[batch, wrong]), r"batches\[1\]: input_ids hold token ids from \d+ to 65"),
                          (dict(lr=0), "lr=0: AdamW"), (dict(weight_decay=-0.1), "weight_decay=-0.1"),
                          (dict(policy="full+offload:input"), "a parallel layout has no host tier"),
                          (dict(tp=2, cp=2), "attention='eager' under context parallelism"),
                          (dict(ep=2), "ep=2 with Config.experts=0: expert parallelism"),
                          (dict(pp=2, cfg=cfg.replace(dropout=0.1)), "2 steps with pp=2 and dropout")):
        args = {"batches": [batch, batch], "policy": "none", "dp": 2, "zero": 1, "cfg": cfg, **kwargs}
        layout = Layout(**{name: args.pop(name) for name in list(args) if name in Layout.__dataclass_fields__})
        with pytest.raises(ValueError, match=words):  # raised by zero_train before any rank starts
            zero_train(params, args.pop("cfg"), args.pop("batches"), args.pop("policy"), layout, **args)
    tiny = ["train", "--preset", "tiny", "--steps", "1", "--batch", "2", "--seq", "8"]
    for flags, words in ((["--dp", "2"], "plain data-parallel training is not built; --zero 1 holds"),
                         (["--zero", "2"], "--zero 2 without --dp"), (["--zero", "2", "--dp", "1"], "with --dp 1"),
                         (["--no-prefetch"], "--no-prefetch without --zero 3"),
                         (["--dp", "2", "--zero", "1", "--keep-gathered"], "only stage 3 gathers"),
                         (["--dp", "2", "--zero", "1", "--watch-live"], "--watch-live with --dp"),
                         (["--dp", "2", "--zero", "1", "--peak-tflops", "5"], "--peak-tflops with --dp"),
                         (["--dp", "2", "--zero", "3", "--dtype", "bf16"], "mixed precision"),
                         (["--tp", "2"], "--tp 2 without --zero: the parallel layouts train on ZeRO ranks here"),
                         (["--zero", "1", "--tp", "2"], "--zero 1 without --dp: ZeRO shards the model state over "
                                                        "data-parallel ranks (dp x ep x cp of them)"),
                         (["--dp", "2", "--zero", "1", "--sp"], "--sp with a tensor-parallel size of 1"),
                         (["--dp", "2", "--zero", "1", "--pp", "0"], "--pp 0: give a whole number"),
                         (["--dp", "2", "--zero", "1", "--cp", "2", "--attention", "tiled", "--batch", "3"],
                          "--batch 3 is not divisible into --dp x --microbatches = 2 x 1 = 2 micro-batches"),
                         (["--dp", "64", "--zero", "3", "--batch", "64", "--device", "cuda"],
                          "CUDA was asked for" if not torch.cuda.is_available() else "take one GPU each")):
        assert main(tiny + flags) == 2, flags
        assert words in capsys.readouterr().err, flags
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "ZeRO stage over the data-parallel ranks (--dp x --ep x --cp of them): 1 shards the AdamW state" in text
    assert "--keep-gathered --zero 3" in text and "--sp --tp N: sequence parallelism" in text

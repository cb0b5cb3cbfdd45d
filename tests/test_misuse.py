"""The commands stay true under misuse and interruption: the same seed gives the same losses, a
bad flag is a one-line error before any work, Ctrl-C stops a run with exit code 130, an
interrupted figure never replaces a whole one, and fast runs leave figures/ alone."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
import types

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
import torch

from commands import picockpt as run_command
from picockpt import Config, init_params
from picockpt.measurement import peers
from picockpt.cli import main
from picockpt.planning.fit import WORKING_COPIES, check_fits, step_bytes
from picockpt.planning.step_forms import layer_flops, predicted_peak_bytes
from picockpt.measurement.measure import make_batch
from picockpt.teaching.plotting import FAST_FIGURES, REPO, save_figure
from picockpt.measurement.reference import ReferenceLlama
from picockpt.measurement.tracker import Tracker
from picockpt.measurement.train import MarkovTask, Monitor, train

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # a lesson's own process


def picockpt(*args, env=None):
    return run_command(*args, env={"OMP_NUM_THREADS": "1", **(env or {})})


def one_line_error(out, message):
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


# ---- the same seed, the same losses ----------------------------------------------------------

def loss_lines(stdout):
    """'step    0  loss  4.1577 ...' -> ['step    0  loss  4.1577', ...]: the lines without the timing."""
    return [line.split("  loss ")[0] + " loss " + line.split("  loss ")[1].split()[0]
            for line in stdout.splitlines() if "  loss " in line] + \
           [line for line in stdout.splitlines() if line.startswith("loss ")]


def test_train_with_dropout_is_reproducible_from_its_seed():
    args = ("train", "--preset", "tiny", "--steps", "3", "--dropout", "0.1", "--device", "cpu")
    first, second = picockpt(*args, "--seed", "3"), picockpt(*args, "--seed", "3")
    other = picockpt(*args, "--seed", "4")
    assert first.returncode == second.returncode == other.returncode == 0, first.stderr
    assert len(loss_lines(first.stdout)) == 4  # three steps and the summary
    assert loss_lines(first.stdout) == loss_lines(second.stdout)
    assert loss_lines(first.stdout) != loss_lines(other.stdout)  # the seed does reach the losses


def test_train_losses_are_bitwise_equal_for_one_seed():
    cfg = Config.from_preset("tiny", dropout=0.1)

    def losses(seed):
        return train(init_params(cfg, seed=seed), cfg, MarkovTask(cfg.vocab, seed=seed), 3, 2, 16, seed=seed,
                     monitor=Monitor(log=None))
    torch.manual_seed(123)  # whatever the generator held before, the seed decides
    first = losses(7)
    torch.manual_seed(456)
    assert losses(7) == first  # float equality: bitwise
    assert losses(8) != first


def test_measure_loss_is_reproducible_from_its_seed():
    args = ("measure", "--preset", "tiny", "--seq", "16", "--dropout", "0.1", "--policy", "full", "--repeats", "1",
            "--device", "cpu", "--json")
    first, second = (json.loads(picockpt(*args, "--seed", "5").stdout) for _ in range(2))
    assert first["loss"] == second["loss"]
    assert first["grad_max_abs_diff_vs_none"] == 0.0


# ---- the torch peers decide by the attention layout, not by sizes -----------------------------

def run_peer(cfg, batch, seq, run_layers):
    """(executed FLOPs, loss, gradients) of one forward + backward of the autograd reference."""
    params = init_params(cfg)
    ids, targets = make_batch(cfg, batch, seq, "cpu")
    model = ReferenceLlama(cfg, params)
    torch.manual_seed(0)
    with Tracker("cpu", physical=False) as tracker:
        loss = model(ids, targets, run_layers=run_layers)
        loss.backward()
    return sum(tracker.flops.values()), loss.item(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("seq,batch,case", [(16, 1, "T != h"), (32, 1, "T == h"), (8, 1, "T == head_dim"),
                                            (32, 2, "T == h, dropout")])
def test_selective_peers_recompute_only_q_k_transposed(seq, batch, case):
    """tiny: h = 32, 4 heads of 8, 2 key/value heads (k and v projections 16 wide). A size test took
    the q/o projections at T = h and the k/v ones at T = 16 (B = 1) for q k^T."""
    cfg = Config.from_preset("tiny", dropout=0.1 if "dropout" in case else 0.0)
    plain, loss, grads = run_peer(cfg, batch, seq, peers.autograd)
    q_k_transposed = cfg.layers * layer_flops(cfg, batch, seq)["scores"]  # 2*B*H*T*T*hd per layer
    for peer in (peers.selective(seq), peers.save_matmuls(seq)):
        flops, peer_loss, peer_grads = run_peer(cfg, batch, seq, peer)
        assert flops - plain == q_k_transposed, case
        assert peer_loss == loss and all(torch.equal(peer_grads[k], grads[k]) for k in grads), case


def test_selective_peer_recomputes_the_same_ops_whatever_the_sizes(monkeypatch):
    """Which ops are recomputed per layer, counted by op name, at T != h and at T == h."""
    decisions = []
    real = peers.create_selective_checkpoint_contexts

    def recording(policy):
        def wrapped(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            if not ctx.is_recompute:
                decisions.append((str(op), decision.name))
            return decision
        return real(wrapped)
    monkeypatch.setattr(peers, "create_selective_checkpoint_contexts", recording)
    recomputed = {}
    for seq in (16, 32):  # tiny: h = 32
        decisions.clear()
        run_peer(Config.from_preset("tiny", layers=1), 2, seq, peers.selective(seq))
        recomputed[seq] = sorted(op for op, decision in decisions if decision == "PREFER_RECOMPUTE")
    assert recomputed[32] == recomputed[16]
    assert recomputed[16].count("aten.bmm.default") == 1 and "aten._softmax.default" in recomputed[16]
    assert "aten.mm.default" not in recomputed[16] and "aten.rsqrt.default" not in recomputed[16]


def test_a_peer_built_for_another_length_says_so():
    with pytest.raises(ValueError, match=r"seq=16\): a layer's first batched matmul is \(8, 32, 8\) @ \(8, 8, 32\)"):
        run_peer(Config.from_preset("tiny"), 2, 32, peers.selective(16))


# ---- one-line errors before any work -----------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["measure", "--preset", "tiny", "--repeats", "0"], "--repeats=0: time at least one step"),
    (["compare", "--preset", "tiny", "--repeats", "0"], "--repeats=0: time at least one step"),
    (["train", "--preset", "tiny", "--log-every", "0"], "--log-every=0: print every N steps with N >= 1"),
    (["train", "--preset", "tiny", "--lr", "-1"], "--lr=-1.0: AdamW's learning rate must be a positive number"),
    (["train", "--preset", "tiny", "--seed", "-1"], "--seed=-1: use a whole number from 0 to 2**63 - 2"),
    (["plan", "--chain", "uniform", "--length", "100000", "--slots", "3"],
     "length^2 x slots = 30,000,000,000 operations, more than the 400,000,000 planned here"),
    (["plan", "--chain", "uniform", "--length", "10", "--slots", "3", "--budget", "1MiB"],
     "--budget: not used by --chain uniform"),
    (["plan", "--benchmark", "--budget", "1MiB"], "--budget: not used by --benchmark"),
    (["plan", "--budget", "1KiB"], "is below the least feasible budget for this model and batch, 3,411,968 bytes "
                                   "(3.25 MiB): give a budget of at least 3.26MiB"),
    (["plan", "--budget", "1MiB", "--length", "10", "--slots", "2"], "--length, --slots: not used by --chain model"),
    (["predict", "--sp"], "--sp with --tp 1: sequence parallelism splits the sequence over the tensor-parallel"),
])
def test_misuse_is_a_one_line_error(args, message):
    one_line_error(picockpt(*args, *(["--device", "cpu"] if args[0] in ("measure", "compare", "train") else [])),
                   message)


@pytest.mark.parametrize("args,message", [
    (["parallel", "--recompute-early"], "--recompute-early without --pp P (P > 1): it changes a pipeline stage's waits"),
    (["parallel", "--no-overlap"], "--no-overlap without --dp D (D > 1)"),
    (["parallel", "--schedule", "afab"], "--schedule without --pp P or --microbatches M (> 1)"),
    (["parallel", "--keep-dispatched"], "--keep-dispatched without --ep: it keeps the rows"),
    (["parallel", "--batch", "8", "--seq", "65536", "--max-seq", "65536"],
     "(this command also runs the whole step in one process, to check the ranks' gradients). To fit, use a smaller"),
    (["predict", "--distribute-saved"], "--distribute-saved with --tp 1: it splits each checkpoint over the"),
    (["plan", "--layers", "3000", "--budget", "100MiB"], "layers: a chain of 3001 stages needs the planner's table"),
    (["plan", "--chain", "uniform", "--length", "10", "--slots", "2", "--hidden", "64"],
     "--hidden: not used by --chain uniform (counted in slots, not bytes); leave it out"),
    (["predict", "--seq", "1000000000000", "--max-seq", "1000000000000", "--json"], None),  # closed forms only: fine
])
def test_flags_of_a_layout_not_asked_for_are_one_line_errors(args, message, capsys):
    code = main([*args, "--preset", "tiny"] + (["--device", "cpu"] if args[0] == "parallel" else []))
    err = capsys.readouterr().err
    if message is None:
        assert code in (0, None) and err == ""
        return
    assert code == 2 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_flags_argparse_refuses_are_one_line_errors_too(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["measure", "--batch", "abc"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err == ("error: argument --batch: invalid int value: 'abc' "
                                               "(`python -m picockpt measure --help` explains every flag)\n")


def test_the_uniform_chain_error_gives_the_closed_form_answer():
    out = picockpt("plan", "--chain", "uniform", "--length", "100000", "--slots", "3")
    assert "is 6,176,445 (t = 83)" in out.stderr  # t*l - C(s+t, t-1) = 83*100000 - C(86, 82)


def test_long_uniform_chains_plan_without_recursion():
    out = picockpt("plan", "--chain", "uniform", "--length", "3000", "--slots", "1", "--json")
    plan = json.loads(out.stdout)
    assert plan["forward_steps"] == plan["binomial_formula"] == 3000 * 2999 // 2  # one slot: l(l-1)/2


def test_predict_recompute_takes_any_case():
    upper = json.loads(picockpt("predict", "--recompute", "SELECTIVE", "--json").stdout)
    lower = json.loads(picockpt("predict", "--recompute", "selective", "--json").stdout)
    assert upper["recompute"] == "selective" and upper["per_layer_bytes"] == lower["per_layer_bytes"]


def test_step_bytes_are_the_stated_parts():
    cfg = Config.from_preset("small", dtype="bf16")
    parts = step_bytes(cfg, 4, 128, "full")
    assert parts["state"] == cfg.num_params() * (16 + 2)  # fp32 weights, grads, two moments; bf16 copies
    assert parts["stored"] == predicted_peak_bytes(cfg, 4, 128, "full")
    assert parts["working"] == WORKING_COPIES * 4 * 4 * 4 * 128 * 128  # 4 fp32 copies of the (B, H, T, T) scores
    assert parts["largest"] == "the attention scores"
    check_fits(cfg, torch.device("cpu"), 4, 128, "full")  # a few MiB: fits


@pytest.mark.parametrize("command", [["train", "--steps", "1"], ["measure"], ["compare"], ["inventory"],
                                     ["plan", "--budget", "1TiB", "--measure"]])
def test_a_step_that_cannot_fit_is_refused_with_the_numbers(command):
    """A shape of terabytes, which no machine running these tests has: refused before any step."""
    cfg, batch, seq = Config.from_preset("small", max_seq=16384), 64, 16384
    start = time.perf_counter()
    out = picockpt(*command, "--preset", "small", "--batch", str(batch), "--seq", str(seq), "--device", "cpu")
    seconds = time.perf_counter() - start
    stored = predicted_peak_bytes(cfg, batch, seq, "budget:1TiB" if command[0] == "plan" else "none")
    working = WORKING_COPIES * 4 * batch * cfg.heads * seq * seq  # fp32 (B, H, T, T) scores
    one_line_error(out, f"stored activations {stored / 2**30:.2f} GiB + working memory about "
                        f"{working / 2**30:.2f} GiB ({WORKING_COPIES} fp32 copies of the attention scores)")
    assert "of available RAM" in out.stderr and "use a smaller --batch or --seq" in out.stderr
    assert seconds < 30  # refused before any step


def test_the_advice_names_a_policy_only_when_it_fits(monkeypatch):
    monkeypatch.setattr("picockpt.planning.fit.available_bytes", lambda device: (20 * 2**30, "available RAM"))
    cfg, cpu = Config.from_preset("small", max_seq=4096), torch.device("cpu")
    need = {policy: sum(step_bytes(cfg, 16, 4096, policy)[k] for k in ("state", "stored", "working"))
            for policy in ("none", "full+selective")}
    stored = predicted_peak_bytes(cfg, 16, 4096, "full+selective")
    with pytest.raises(ValueError) as error:
        check_fits(cfg, cpu, 16, 4096, "none")
    assert str(error.value).startswith(f"one step of batch 16 x 4096 tokens under policy none needs about "
                                       f"{need['none'] / 2**30:.2f} GiB, more than the 20.00 GiB of available RAM")
    assert str(error.value).endswith(f"or a recomputation policy (--policy full+selective stores "
                                     f"{stored / 2**30:.2f} GiB here, and fits)")
    assert need["full+selective"] < 20 * 2**30
    check_fits(cfg, cpu, 16, 4096, "full+selective")  # which it does
    monkeypatch.setattr("picockpt.planning.fit.available_bytes", lambda device: (10 * 2**30, "available RAM"))
    with pytest.raises(ValueError) as error:  # now full+selective does not fit either (its scores' working memory)
        check_fits(cfg, cpu, 16, 4096, "none")
    assert str(error.value).endswith(f"To fit, use a smaller --batch or --seq (a recomputation policy is not enough: "
                                     f"under --policy full+selective the step still needs about "
                                     f"{need['full+selective'] / 2**30:.2f} GiB)")
def test_an_unwritable_figures_folder_is_reported_before_any_lesson(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    out = picockpt("reproduce", "--fast", "--device", "cpu", env={"PICOCKPT_FIGURES": str(blocker / "figs")})
    one_line_error(out, f"$PICOCKPT_FIGURES '{blocker / 'figs'}' cannot be written (Not a directory)")
    assert "[1/" not in out.stdout  # no lesson started


# ---- interruption --------------------------------------------------------------------------------

def test_an_interrupted_save_leaves_the_old_figure_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("PICOCKPT_FIGURES", str(tmp_path))
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    before = save_figure(fig, "kept").read_bytes()

    def interrupted(target, **kwargs):  # half a file, then Ctrl-C
        pathlib.Path(target).write_bytes(before[:100])
        raise KeyboardInterrupt
    monkeypatch.setattr(fig, "savefig", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_figure(fig, "kept")
    assert (tmp_path / "kept.png").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.png"]  # no partial file left behind
    plt.close(fig)


WAITING_NOTEBOOK = {
    "cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# A lesson that waits"]},
              {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
               "source": ["import pathlib, time\n", "pathlib.Path('started').write_text('yes')\n", "time.sleep(120)"]},
              {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
               "source": ["pathlib.Path('second_cell').write_text('yes')"]}],
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    "nbformat": 4, "nbformat_minor": 5}
WAITING_SCRIPT = '''"""A lesson that waits."""
import pathlib
import time


def main(argv):
    pathlib.Path(__file__).with_name("started").write_text("yes")
    time.sleep(120)
'''
AFTER_SCRIPT = '''"""A lesson after the interrupted one."""
import pathlib


def main(argv):
    pathlib.Path(__file__).with_name("after_ran").write_text("yes")
    return {"figures": [], "summary": {}}
'''


@pytest.mark.notebooks  # a lesson's own process
@pytest.mark.parametrize("kind", ["ipynb", "py"])
def test_ctrl_c_stops_reproduce_with_exit_code_130(kind, tmp_path):
    lessons = tmp_path / "lessons"
    lessons.mkdir()
    waiting = json.dumps(WAITING_NOTEBOOK) if kind == "ipynb" else WAITING_SCRIPT
    (lessons / f"01_wait.{kind}").write_text(waiting)
    (lessons / "02_after.py").write_text(AFTER_SCRIPT)
    runner = textwrap.dedent(f"""
        import pathlib, sys
        import picockpt.teaching.reproduce
        picockpt.teaching.reproduce.LESSONS = pathlib.Path({str(lessons)!r})
        from picockpt.cli import main
        sys.exit(main(["reproduce", "--device", "cpu"]))""")
    process = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=REPO, env={**ENV, "PICOCKPT_FIGURES": str(tmp_path / "figures")},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal's
    try:
        deadline = time.monotonic() + 90
        while not (lessons / "started").exists():  # the notebook's kernel takes a few seconds to start
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, out + err
    assert "interrupted: python -m picockpt reproduce stopped before it finished" in err
    assert "[1/2] 01_wait" in out and "interrupted; 0 of 2 lessons had finished" in out
    assert "FAILED" not in out and "Traceback" not in err
    assert not (lessons / "second_cell").exists() and not (lessons / "after_ran").exists()


@pytest.mark.notebooks  # a lesson's own process
def test_a_fast_lesson_leaves_the_committed_figures_alone():
    committed = REPO / "figures" / "02_anatomy_of_a_step.png"
    before = (committed.stat().st_mtime_ns, committed.read_bytes())
    env = {k: v for k, v in ENV.items() if k != "PICOCKPT_FIGURES"}
    out = subprocess.run([sys.executable, "lessons/02_anatomy_of_a_step.py", "--fast", "--device", "cpu"],
                         capture_output=True, text=True, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    assert f"wrote {FAST_FIGURES / '02_anatomy_of_a_step.png'}" in out.stdout
    assert (committed.stat().st_mtime_ns, committed.read_bytes()) == before
    assert not list((REPO / "figures").glob(".02_anatomy_of_a_step.png.*"))  # nor a temporary file beside it


@pytest.mark.notebooks  # a lesson's own process
def test_reproduce_fast_says_where_its_figures_go():
    env = {k: v for k, v in ENV.items() if k != "PICOCKPT_FIGURES"}
    out = subprocess.run([sys.executable, "-m", "picockpt", "reproduce", "--fast", "--only", "02", "--device", "cpu"],
                         capture_output=True, text=True, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    assert f"figures go to {FAST_FIGURES} (fast figures never replace the committed ones in figures/)" in out.stdout
    assert (FAST_FIGURES / "02_anatomy_of_a_step.png").stat().st_mtime > time.time() - 300


# ---- the CUDA timeline is read only when asked for -----------------------------------------------

@pytest.mark.parametrize("timeline", [False, True])
def test_memory_allocated_is_read_only_for_the_cuda_timeline(timeline, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 4096)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: calls.append(device) or 1024 * len(calls))
    with Tracker("cuda", physical=False, flops=False, cuda_timeline=timeline) as tracker:
        with tracker.phase("forward"):
            for k in range(3):
                tracker.on_event(types.SimpleNamespace(kind="put", layer=k, name="input", live_bytes=100 * (k + 1)))
    assert len(calls) == (1 + 3 if timeline else 1)  # the step's base, then one per store event
    assert [e["cuda"] for e in tracker.timeline if e["kind"] == "event"] == ([1024, 2048, 3072] if timeline
                                                                            else [None] * 3)
    assert tracker.peaks["forward"]["cuda"] == 4096 - 1024  # max_memory_allocated per phase, either way


# ---- a lesson's part on more ranks than GPUs; lesson flags -------------------------------------------------

def test_a_multi_rank_part_on_fewer_gpus_than_ranks_runs_on_gloo_and_says_so(monkeypatch, capsys):
    """reproduce --device cuda on one GPU: lessons 14, 16 and 17 plan their 4-, 2- and 2-rank parts from
    torch.cuda.device_count() (mocked to 1 here) and run them on the CPU over gloo, saying so in one line."""
    from picockpt.teaching.reproduce import rank_device
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    device, note = rank_device("cuda", 2)
    assert device == torch.device("cpu")
    assert note == ("2 ranks need 2 GPUs (NCCL: one per rank) and this machine has 1: the 2-rank part runs on the "
                    "CPU over gloo (same bytes, FLOPs and checks; CPU timings)")
    assert rank_device("cuda", 1) == (torch.device("cuda"), None)
    assert rank_device("cpu", 4) == (torch.device("cpu"), None)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lessons"))
    import _lesson
    assert _lesson.ranks_device(torch.device("cuda"), 4) == torch.device("cpu")
    assert "4 ranks need 4 GPUs" in capsys.readouterr().out


LESSON = pathlib.Path(__file__).resolve().parents[1] / "lessons" / "07_cheap_ops.py"


@pytest.mark.notebooks  # a lesson's own process
@pytest.mark.parametrize("flags,message", [
    (["--seed", "-1"], "error: --seed=-1: must be a whole number from 0 to 2**64 - 1"),
    (["--seed", str(2**64)], "error: --seed=18446744073709551616: must be a whole number"),
])
def test_a_lesson_s_bad_seed_is_one_line_before_any_work(flags, message):
    out = subprocess.run([sys.executable, str(LESSON), "--fast", *flags], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith(message) and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stdout == ""


@pytest.mark.notebooks  # a lesson's own process
def test_a_lesson_s_figures_folder_under_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "a_file").write_text("")
    env = {**os.environ, "PICOCKPT_FIGURES": str(tmp_path / "a_file" / "figures")}
    out = subprocess.run([sys.executable, str(LESSON), "--fast"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr.startswith(f"error: $PICOCKPT_FIGURES '{tmp_path / 'a_file' / 'figures'}' cannot be written "
                                 f"(Not a directory)"), out.stderr


@pytest.mark.notebooks  # a lesson's own process
def test_a_lesson_piped_into_head_ends_quietly():
    out = subprocess.run(f"'{sys.executable}' '{LESSON}' --fast | head -1", shell=True, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.count("\n") == 1 and "BrokenPipeError" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("words,message", [
    ("--help", "$PICOCKPT_LESSON_ARGS asks for --help, which a notebook cannot show: the flags are --fast, --large, "
               "--device, --seed, --threads"),
    ('--fast "x', "$PICOCKPT_LESSON_ARGS='--fast \"x' cannot be split into flags (No closing quotation)"),
])
def test_a_notebook_s_lesson_args_fail_as_one_value_error(monkeypatch, words, message):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lessons"))
    import _lesson
    monkeypatch.setattr(_lesson, "in_notebook", lambda: True)
    monkeypatch.setenv("PICOCKPT_LESSON_ARGS", words)
    with pytest.raises(ValueError) as error:  # not SystemExit: that would stop the kernel's cell oddly
        _lesson.lesson_args()
    assert str(error.value).startswith(message)


def test_a_model_whose_weights_alone_do_not_fit_is_not_told_to_shorten_its_batch(monkeypatch, capsys):
    """No --batch or --seq fits when the weights and gradients alone fill the device: the advice names the model's
    size, whatever the caller would have advised; a command that runs no optimizer does not count AdamW's state."""
    monkeypatch.setattr("picockpt.planning.fit.available_bytes", lambda device: (20 * 2**30, "available RAM"))
    cfg, cpu = Config.from_preset("llama3-8b"), torch.device("cpu")
    for optimizer, state in ((True, "weights, gradients and AdamW state"), (False, "weights and gradients")):
        with pytest.raises(ValueError) as error:
            check_fits(cfg, cpu, 1, 1, "none", advice="use a smaller --batch or --seq", optimizer=optimizer)
        need = cfg.num_params() * (16 if optimizer else 8) / 2**30
        assert str(error.value).endswith(f"To fit, use a smaller model (--layers, --hidden, or a smaller --preset): "
                                         f"the {state} alone need {need:.2f} GiB, so no --batch or --seq fits")
    for command in ("compare", "inventory"):  # neither runs an optimizer: its refusal counts none
        assert main([command, "--preset", "llama3-8b", "--seq", "1", "--batch", "1", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert "AdamW" not in err and "no --batch or --seq fits" in err, err

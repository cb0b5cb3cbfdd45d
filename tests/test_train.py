import pytest
import torch

from commands import picockpt
from picockpt import Config, init_params
from picockpt.model.params import param_shapes
from picockpt.planning.step_forms import predicted_peak_bytes, step_flops
from picockpt.measurement.train import MarkovTask, Monitor, train


@pytest.mark.slow
def test_synthetic_task_is_learned_within_100_steps():
    cfg = Config.from_preset("small")
    task = MarkovTask(cfg.vocab, seed=0)
    torch.manual_seed(0)
    # 90 steps, not 100: the mean of the last 10 is 3.1 by then (2.7 at 100, 3.7 at 80; a smaller batch or shorter
    # sequences stay above 3.5 at 100), so the same bound holds, 0.4 nats to spare
    losses = train(init_params(cfg, seed=0), cfg, task, steps=90, batch=8, seq=64, monitor=Monitor(log=None))
    print(f"first {losses[0]:.3f}, last {losses[-1]:.3f}, floor {task.loss_floor:.3f}")
    assert losses[0] > 5.0                      # ~ ln(256) = 5.55 at the start
    assert sum(losses[-10:]) / 10 < 3.5         # clearly falling: 2 nats below the start (3.1 measured)


def test_batches_follow_the_chain():
    task = MarkovTask(50, branching=3, seed=1)
    ids, targets = task.batch(4, 20)
    assert torch.equal(ids[:, 1:], targets[:, :-1])
    for b in range(4):
        for t in range(20):
            assert targets[b, t] in task.successors[ids[b, t]]


def test_train_command_runs():
    out = picockpt("train", "--preset", "tiny", "--steps", "3", "--policy", "every:2", "--device", "cpu", check=True)
    assert "tokens/s" in out.stdout and "stored" in out.stdout and "summary over steps 1..2" in out.stdout


def test_train_reports_what_recomputation_costs():
    """Per step and in the summary: stored and live peaks, the recompute share of FLOPs (the closed form)
    and of time (the tracker's recompute phase)."""
    cfg = Config.from_preset("tiny")
    lines = []
    train(init_params(cfg), cfg, MarkovTask(cfg.vocab), steps=3, batch=2, seq=16, policy="full",
          monitor=Monitor(log=lines.append, watch_live=True))
    flops = step_flops(cfg, 2, 16, "full")
    share = f"recompute {flops['recompute'] / sum(flops.values()):5.1%} of FLOPs"
    assert len(lines) == 6 and all(share in line for line in lines[:4]), lines  # 3 steps, summary, state, phases
    stored = f"stored {predicted_peak_bytes(cfg, 2, 16, 'full') / 2**20:8.3f} MiB"
    assert all(stored in line for line in lines[:4])
    for line in lines[:4]:
        live = float(line.split(" live ")[1].split()[0])
        time_share = float(line.split("of FLOPs, ")[1].split("%")[0])
        assert live * 2**20 > predicted_peak_bytes(cfg, 2, 16, "full") and 0 < time_share < 100
    assert lines[-3].startswith("summary over steps 1..2") and "MFU" not in lines[-3]  # no peak given, no utilisation
    state = 8 * cfg.num_params() + 4 * len(param_shapes(cfg))  # two fp32 moments a parameter, a step count a tensor
    assert lines[-2].startswith("optimizer state (AdamW") and f"{state / 2**20:.3f} MiB" in lines[-2]
    assert "backward stored" in lines[-1] and ", live " in lines[-1]  # per phase, live too (watch_live)


def test_cuda_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        return
    out = picockpt("train", "--device", "cuda", "--steps", "1")
    assert out.returncode == 2 and "CUDA was asked for" in out.stderr and "Traceback" not in out.stderr


def test_train_records_mfu_hfu_and_per_phase_memory():
    """PaLM's convention (Chowdhery et al. 2022, app. B): HFU / MFU = the step's executed FLOPs over its
    model FLOPs (policy none), whatever the peak or the time; the record carries every step's per-phase
    peaks, the store's equal to the closed form."""
    cfg = Config.from_preset("tiny")
    lines, record = [], []
    train(init_params(cfg), cfg, MarkovTask(cfg.vocab), steps=3, batch=2, seq=16, policy="full",
          monitor=Monitor(log=lines.append, peak_tflops=1.0, record=record))
    executed, model = sum(step_flops(cfg, 2, 16, "full").values()), sum(step_flops(cfg, 2, 16, "none").values())
    assert [row["step"] for row in record] == [0, 1, 2]
    for row in record:
        assert abs(row["hfu"] / row["mfu"] - executed / model) < 1e-12
        assert row["hardware_flops"] == executed and row["model_flops"] == model
        assert set(row["phases"]) == {"forward", "recompute", "backward", "optimizer"}
        assert max(phase["stored"] for phase in row["phases"].values()) == predicted_peak_bytes(cfg, 2, 16, "full")
        assert row["phases"]["recompute"]["seconds"] > 0 and row["phases"]["forward"]["live"] is None  # no watch
    assert "MFU" in lines[-3] and "HFU" in lines[-3]  # given a peak, on CPU too
    assert lines[-1].startswith("per phase, largest over steps 1..2: forward stored")


def test_train_refuses_a_bad_peak_or_record():
    cfg = Config.from_preset("tiny")
    for kwargs, message in ((dict(peak_tflops=0), "peak_tflops=0"), (dict(peak_tflops=float("nan")), "peak_tflops"),
                            (dict(record={}), "record=dict")):
        try:
            train(init_params(cfg), cfg, MarkovTask(cfg.vocab), 1, 2, 8, monitor=Monitor(log=None, **kwargs))
        except ValueError as error:
            assert message in str(error)
        else:
            raise AssertionError(f"{kwargs} was accepted")

import subprocess
import sys

import torch

from picockpt import Config, init_params
from picockpt.train import MarkovTask, train


def test_synthetic_task_is_learned_within_100_steps():
    cfg = Config.from_preset("small")
    task = MarkovTask(cfg.vocab, seed=0)
    torch.manual_seed(0)
    losses = train(init_params(cfg, seed=0), cfg, task, steps=100, batch=8, seq=64, log=None)
    print(f"first {losses[0]:.3f}, last {losses[-1]:.3f}, floor {task.loss_floor:.3f}")
    assert losses[0] > 5.0                      # ~ ln(256) = 5.55 at the start
    assert sum(losses[-10:]) / 10 < 3.5         # clearly falling: 2 nats below the start (2.7 measured)


def test_batches_follow_the_chain():
    task = MarkovTask(50, branching=3, seed=1)
    ids, targets = task.batch(4, 20)
    assert torch.equal(ids[:, 1:], targets[:, :-1])
    for b in range(4):
        for t in range(20):
            assert targets[b, t] in task.successors[ids[b, t]]


def test_train_command_runs():
    out = subprocess.run([sys.executable, "-m", "picockpt", "train", "--preset", "tiny", "--steps", "3",
                          "--policy", "every:2", "--device", "cpu"], capture_output=True, text=True, check=True)
    assert "tokens/s" in out.stdout and "stored activations" in out.stdout


def test_cuda_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        return
    out = subprocess.run([sys.executable, "-m", "picockpt", "train", "--device", "cuda", "--steps", "1"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "CUDA was asked for" in out.stderr and "Traceback" not in out.stderr

"""Inputs that used to end in a traceback: a config of zero heads, device="gpu" through the API, and Ctrl-C while
`python -m picockpt` is still importing torch."""
import os
import signal
import subprocess
import sys
import time

import pytest

from picockpt import Config, init_params
from picockpt.measurement.compare import compare
from picockpt.measurement.train import MarkovTask, Monitor, train

HF = {"model_type": "llama", "vocab_size": 100, "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 6,
      "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}


@pytest.mark.parametrize("key", ["num_attention_heads", "hidden_size", "num_hidden_layers"])
@pytest.mark.parametrize("value", [0, -2, 2.5, True])
def test_from_hf_names_a_size_that_is_not_a_whole_number(key, value):
    with pytest.raises(ValueError, match=f"^{key}={value!r}: a Llama config's sizes are whole numbers >= 1$"):
        Config.from_hf({**HF, key: value})


def test_device_gpu_names_the_parameter_and_what_works():
    cfg = Config.from_preset("tiny")
    message = r"device='gpu': use auto, cpu, cuda or cuda:N"
    with pytest.raises(ValueError, match=message):
        init_params(cfg, device="gpu")
    with pytest.raises(ValueError, match=message):
        compare(cfg, 2, 8, device="gpu")
    with pytest.raises(ValueError, match=message):
        train(init_params(cfg), cfg, MarkovTask(cfg.vocab), 1, 2, 8, device="gpu", monitor=Monitor(log=lambda *_: None))


@pytest.mark.parametrize("delay", [0.3, 1.0, 2.5])  # from torch's import to the step (a busy machine moves them)
def test_ctrl_c_at_any_moment_of_the_start_is_one_line_and_130(delay):
    """Before picockpt's own code runs (Python's site imports, ~0.1 s) nothing can catch it; from there on every
    moment gives one line and 130. The child restores SIGINT's default before exec, so Python installs its handler
    even where the suite itself runs with SIGINT ignored (a background or nohup'd shell)."""
    child = subprocess.Popen([sys.executable, "-m", "picockpt", "measure", "--device", "cpu"], cwd=os.getcwd(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(delay)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    if child.returncode == 1 and "Could not import runpy module" in err:  # a loaded machine: still in Python's start
        pytest.skip(f"SIGINT at {delay} s came before Python had imported runpy, before any picockpt code")
    assert child.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.strip().startswith("interrupted: python -m picockpt"), err
    assert len(err.strip().splitlines()) == 1, err


CTRL_C_INSIDE_EXEC = """
import runpy, sys
import picockpt.cli.measure as measure

def run(args):  # Ctrl-C lands while Python runs code given as a string (dataclasses and namedtuple make classes so)
    exec("import os, signal, time\\nos.kill(os.getpid(), signal.SIGINT)\\ntime.sleep(30)")

measure.run = run
sys.argv = ["picockpt", "measure", "--device", "cpu"]
runpy.run_module("picockpt", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_that_passed_through_an_exec_still_exits_130(tmp_path):
    """CPython (since bpo-1054041) ends a `python -m` process by SIGINT when a KeyboardInterrupt ever left an exec or
    eval of a string, even one that was caught: the command's one line and 130 must survive that."""
    (tmp_path / "interrupted_in_exec").mkdir()
    (tmp_path / "interrupted_in_exec" / "__main__.py").write_text(CTRL_C_INSIDE_EXEC)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    child = subprocess.run([sys.executable, "-m", "interrupted_in_exec"], capture_output=True, text=True, env=env,
                           timeout=120, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert child.returncode == 130, child.stderr
    assert child.stderr.strip() == "interrupted: python -m picockpt measure stopped before it finished", child.stderr


@pytest.mark.parametrize("text", ["1.5", "1.5B", "0.25e1"])
def test_a_size_of_a_fraction_of_a_byte_is_refused_not_rounded(text):
    from picockpt.recompute.policy import parse_size
    with pytest.raises(ValueError, match="not a whole number of bytes: give a unit"):
        parse_size(text)
    assert parse_size("1.5KiB") == 1536 and parse_size("2.0") == 2

"""predict --search's flags: each default says what it stands for, a flag that would be ignored or priced as
something else is refused in one line naming it, and the table's times are in a unit the step can be read in."""
import json
import re

import pytest

from commands import picockpt
from picockpt.planning.cost import HARDWARE

GIB = 2**30
REPORTED = {"h100": 81559 * 2**20, "h200": 143771 * 2**20, "a100": 81920 * 2**20}  # nvidia-smi's memory.total
SMALL = ["predict", "--search", "--model", "tiny", "--seq", "64", "--gpus", "8", "--tokens-per-batch", "1K"]
EIGHT_B = ["predict", "--search", "--model", "llama3-8b", "--seq", "8192", "--gpus", "8", "--tokens-per-batch", "1M"]


def run(*argv):
    """(exit code, stdout, stderr) of `python -m picockpt ARGV`, in this process (argparse's exits too)."""
    done = picockpt(*argv)
    return done.returncode, done.stdout, done.stderr


# ---- --kernels and --attention-kernel: published rates only where a table exists ---------------------------------
def test_published_kernels_on_a_gpu_without_them_are_refused():
    code, out, err = run(*EIGHT_B, "--hardware", "a100", "--kernels", "published")
    assert code == 2 and out == ""
    assert "--kernels published with --hardware a100" in err and "--kernels peak" in err and "FILE" in err


def test_the_default_kernels_say_which_rates_they_are():
    """Published where the GPU has a table (h100), the roofline where it has none (a100), said in the header."""
    code, out, _ = run(*SMALL, "--hardware", "a100")
    assert code == 0 and "the roofline" in out and "no published kernel rates for the a100" in out
    code, out, _ = run(*SMALL)
    assert code == 0 and "kernels at h100 published, cudnn attention rates" in out
    code, out, _ = run(*SMALL, "--hardware", "h200", "--kernels", "published", "--attention-kernel", "flash3")
    assert code == 0 and "kernels at h200 published, flash3 attention rates" in out


@pytest.mark.parametrize("flags,refusal", [
    (["--hardware", "a100", "--attention-kernel", "flash3"], "--attention-kernel flash3 with --hardware a100"),
    (["--kernels", "peak", "--attention-kernel", "flash2"], "--attention-kernel flash2 with --kernels peak"),
])
def test_an_attention_kernel_without_a_published_table_is_refused(flags, refusal):
    code, out, err = run(*SMALL, *flags)
    assert code == 2 and out == "" and refusal in err and "leave --attention-kernel out" in err


def test_a_kernel_table_without_a_field_names_it(tmp_path):
    table = tmp_path / "rates.json"
    table.write_text("{}")
    code, _, err = run(*SMALL, "--kernels", str(table))
    assert code == 2 and "it has no 'name'" in err and "KeyError" not in err and "('name')" not in err
    table.write_text("[1, 2]")
    code, _, err = run(*SMALL, "--kernels", str(table))
    assert code == 2 and "not a JSON object" in err


# ---- flags only the search reads, given without it ----------------------------------------------------------------
@pytest.mark.parametrize("flags,named", [
    (["--hardware", "h200"], "--hardware"),
    (["--hardware", "h100"], "--hardware"),  # the default's own name, given: still only the search reads it
    (["--kernels", "published"], "--kernels"),
    (["--attention-kernel", "cudnn"], "--attention-kernel"),
])
def test_search_flags_without_search_are_refused(flags, named):
    code, _, err = run("predict", "--model", "llama3-8b", *flags)
    assert code == 2 and f"{named}: only --search reads it" in err


def test_predict_without_search_flags_still_runs():
    code, out, _ = run("predict", "--model", "llama3-8b", "--zero", "3", "--dp", "8")
    assert code == 0 and "in 79.65 GiB" in out  # an H100's memory, as its driver reports it


# ---- --model and --preset -----------------------------------------------------------------------------------------
def test_model_and_preset_that_differ_are_refused():
    for flags in (["--model", "llama3-70b", "--preset", "llama3-8b"],
                  ["--preset", "llama3-8b", "--model", "llama3-70b"]):  # the default's name, given, counts too
        code, out, err = run("predict", *flags, "--json")
        assert code == 2 and out == "" and "--model" in err and "--preset" in err
    code, out, _ = run("predict", "--model", "llama3-70b", "--preset", "llama3-70b", "--json")
    assert code == 0 and json.loads(out)["model"] == "llama3-70b"
    code, out, _ = run("predict", "--json")
    assert code == 0 and json.loads(out)["model"] == "llama3-8b"


# ---- --dtype: the rates are 16-bit tensor-core ones ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "float64"])
def test_a_dtype_the_rates_do_not_price_is_refused(dtype):
    code, out, err = run(*SMALL, "--dtype", dtype)
    assert code == 2 and out == "" and f"--dtype {dtype} with --search" in err and "bf16" in err


def test_bf16_and_fp16_rank_the_same_layouts():
    """Both are 2 bytes, and the H100's dense fp16 tensor-core rate is its bf16 one: the same search."""
    found = {}
    for dtype in ("bf16", "fp16"):
        code, out, _ = run(*SMALL, "--dtype", dtype, "--json", "--top", "3")
        assert code == 0
        found[dtype] = json.loads(out)["layouts"]
    assert found["bf16"] == found["fp16"]


# ---- a step that does not fit --------------------------------------------------------------------------------------
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_no_layout_that_fits_is_a_refusal(json_flag):
    code, out, err = run(*SMALL, "--gpu-gib", "0.5", *json_flag)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and "no layout" in err and "--gpu-gib" in err and "--seq" in err
    assert len(err.strip().splitlines()) == 1


# ---- --gpu-gib: the hardware's memory by default, no more than it holds --------------------------------------------
@pytest.mark.parametrize("name", ["h100", "h200", "a100"])
def test_gpu_memory_defaults_to_the_hardware(name):
    code, out, _ = run(*SMALL, "--hardware", name, "--json", "--top", "1")
    assert code == 0 and json.loads(out)["gpu_bytes"] == REPORTED[name]
    code, out, _ = run(*SMALL, "--hardware", name, "--top", "1")
    assert f"{name} GPUs of {REPORTED[name] / GIB:.2f} GiB" in out and "driver reports" in out


def test_datasheet_memory_is_counted_in_gib():
    """A datasheet's "80 GB" of HBM counts 2**30-byte gigabytes: the driver reports more than 80e9 bytes, and at
    most 80 GiB."""
    for name, datasheet in (("h100", 80), ("h200", 141), ("a100", 80)):
        hw = HARDWARE[name]
        assert hw.capacity == datasheet * GIB and hw.reported == REPORTED[name]
        assert datasheet * 1e9 < hw.reported <= hw.capacity


def test_more_memory_than_the_hardware_holds_is_refused():
    code, out, err = run(*SMALL, "--hardware", "h200", "--gpu-gib", "192")
    assert code == 2 and out == "" and "--gpu-gib 192 with --hardware h200" in err and "141" in err
    code, _, err = run(*SMALL, "--gpu-gib", "81")
    assert code == 2 and "--gpu-gib 81 with --hardware h100" in err
    assert run(*SMALL, "--gpu-gib", "80", "--top", "1")[0] == 0  # the datasheet's figure itself


# ---- the table's times ---------------------------------------------------------------------------------------------
def table_rows(text):
    rows = text.split("fastest splits:\n")[1].split("\n  sp:")[0].splitlines()
    return rows[0], [row.split() for row in rows[1:]]


@pytest.mark.parametrize("argv,unit", [
    (SMALL, "µs"),
    (EIGHT_B[:6] + ["--gpus", "64", "--tokens-per-batch", "8K"], "ms"),  # one sequence on 64 GPUs
    (EIGHT_B, "s"),
])
def test_times_are_printed_in_a_unit_that_fits_the_step(argv, unit):
    code, text, _ = run(*argv)
    assert code == 0
    header, rows = table_rows(text)
    step = header.split().index("step")
    assert all(float(row[step]) >= 1 for row in rows)  # never 0.00 of a step
    assert f"step in {unit}; then the terms of the step, in {unit}" in text
    assert re.search(rf"of its [\d.]+ {unit},", text) and not re.search(r"saves 0\.00 ", text)
    assert all(len(line) < 110 for line in text.splitlines())
    code, out, _ = run(*argv, "--json", "--top", "1")  # the JSON keeps seconds
    seconds = json.loads(out)["layouts"][0]["step_seconds"]
    assert float(rows[0][step]) == pytest.approx(seconds / {"s": 1, "ms": 1e-3, "µs": 1e-6}[unit], rel=1e-3)

"""predict --search's flags: each default says what it stands for, a flag that would be ignored or priced as
something else is refused in one line naming it, and the table's times are in a unit the step can be read in."""
from commands import picockpt
from picockpt.planning.cost import HARDWARE

GIB = 2**30
REPORTED = {"h100": 81559 * 2**20, "h200": 143771 * 2**20, "a100": 81920 * 2**20}  # nvidia-smi's memory.total
SMALL = ["predict", "--search", "--model", "tiny", "--seq", "64", "--gpus", "8", "--tokens-per-batch", "1K"]


def run(*argv):
    """(exit code, stdout, stderr) of `python -m picockpt ARGV`, in this process (argparse's exits too)."""
    done = picockpt(*argv)
    return done.returncode, done.stdout, done.stderr


# ---- what the search reads: a kernel-rate table, each GPU's memory --------------------------------------------------
def test_a_kernel_table_without_a_field_names_it(tmp_path):
    table = tmp_path / "rates.json"
    table.write_text("{}")
    code, _, err = run(*SMALL, "--kernels", str(table))
    assert code == 2 and "it has no 'name'" in err and "KeyError" not in err and "('name')" not in err
    table.write_text("[1, 2]")
    code, _, err = run(*SMALL, "--kernels", str(table))
    assert code == 2 and "not a JSON object" in err


def test_datasheet_memory_is_counted_in_gib():
    """A datasheet's "80 GB" of HBM counts 2**30-byte gigabytes: the driver reports more than 80e9 bytes, and at
    most 80 GiB."""
    for name, datasheet in (("h100", 80), ("h200", 141), ("a100", 80)):
        hw = HARDWARE[name]
        assert hw.capacity == datasheet * GIB and hw.reported == REPORTED[name]
        assert datasheet * 1e9 < hw.reported <= hw.capacity

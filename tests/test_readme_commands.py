"""Every command in the README's code blocks runs: as written, with a tiny shape where the README's is large
(the flags that set the shape come last, so they win), and its exit code 0. They run in this process
(picockpt.cli.main), so torch is imported once; the parallel ones still start their ranks. `reproduce`
(every lesson) and `pytest` (this suite) are left out: the lessons and the tests each have their own tests."""
import re
import shlex
from pathlib import Path

import pytest

from picockpt.cli import main

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = {"reproduce": "every lesson's experiment: tests/test_lessons.py runs each one"}
TINY = {  # per command: what makes its shape tiny (analytic commands run exactly as written)
    "train": ["--preset", "tiny", "--seq", "16", "--batch", "2", "--steps", "2", "--device", "cpu"],
    "measure": ["--preset", "tiny", "--seq", "16", "--repeats", "1", "--device", "cpu"],
    "inventory": ["--preset", "tiny", "--seq", "16"],
    # --min-cut none: torch.compile's partitioner takes ~30 s whatever the shape (tests/test_compare.py runs it)
    "compare": ["--preset", "tiny", "--seq", "16", "--batch", "1", "--repeats", "1", "--device", "cpu",
                "--min-cut", "none"],
    "parallel": ["--preset", "tiny", "--seq", "16", "--device", "cpu"],
    "notebooks": ["--fast", "--no-execute"],  # the cells only, to out/notebooks/: never over the committed ones
    "predict": [], "plan": [],
}


def readme_commands():
    """The `python -m picockpt ...` lines of every fenced block, comments cut off."""
    text = (ROOT / "README.md").read_text()
    lines = [line.split("  #")[0].strip() for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
             for line in block.splitlines()]
    return [shlex.split(line)[3:] for line in lines if line.startswith("python -m picockpt ")]


COMMANDS = readme_commands()


def test_the_readme_has_the_commands_this_file_knows():
    assert {words[0] for words in COMMANDS} <= set(TINY) | set(SKIPPED)
    assert len(COMMANDS) >= 10 and ["parallel", "--pp", "2", "--microbatches", "4", "--schedule", "1f1b", "--dp", "2",
                                    "--batch", "8", "--policy", "full"] in COMMANDS


def marks(words):
    """ranks: the command starts processes; slow: the offload planner at an 8B model's shape (about 15 s)."""
    return [pytest.mark.ranks] * (words[0] == "parallel" or "--dp" in words) + \
        [pytest.mark.slow] * (words[0] == "plan" and "--offload" in words)


@pytest.mark.parametrize("words", [pytest.param(w, marks=marks(w), id=" ".join(w))
                                   for w in COMMANDS if w[0] not in SKIPPED])
def test_a_readme_command_runs(words, capsys):
    code = main([*words, *TINY[words[0]]])
    assert code == 0, f"{' '.join(words)}:\n{capsys.readouterr().err[-3000:]}"

"""The parallel command's report prints a section for every dimension that ran, not only the first that matches."""
import pytest

from picockpt.cli import main


@pytest.mark.ranks
@pytest.mark.parametrize("flags, sections", [
    (["--pp", "2", "--cp", "2", "--attention", "tiled", "--microbatches", "2", "--batch", "4"],
     ("pipeline and data parallelism, P=2 stages", "context parallel, K/V by ring (zigzag)")),
    (["--ep", "2", "--experts", "4", "--tp", "2", "--batch", "2"],
     ("tensor parallel, t=2:", "expert parallel, dispatching again to recompute")),
])
def test_every_dimension_that_ran_has_its_section(flags, sections, capsys):
    assert main(["parallel", "--preset", "tiny", "--seq", "16", "--device", "cpu", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("parallel step ")
    for section in sections:
        assert any(line.startswith(section) for line in lines), (section, lines)
    assert sum(line.startswith("loss ") for line in lines) == 1  # one loss line, after every section
    if "--pp" in flags:  # the pipeline's own lines, beside context parallelism's
        assert any(line.startswith("bubble (1 - computing / step time) per rank") for line in lines)

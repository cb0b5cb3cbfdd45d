"""What lessons 20 to 23 and the README say about time, links and number formats, read from their text
and checked against picockpt's code and picockpt/planning/hardware.py, so that a corrected statement cannot quietly
come back: an offloaded tensor's two copies, fp8's error bound and its subnormals, Megatron's overlap of
tensor-parallel collectives, what recomputation does to a data-parallel step, the sources cited, and one
place for every link and device number.
"""
import ast
import math
import pathlib
import re

import pytest
import torch

from picockpt import Config
from picockpt.planning import hardware
from picockpt.teaching.notebooks import cells
from picockpt.teaching.reproduce import LESSONS, load

REPO = pathlib.Path(__file__).resolve().parent.parent
HARDWARE = {name: value for name, value in vars(hardware).items() if name.isupper()}  # every number it holds

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def lesson_path(prefix):
    [path] = sorted(LESSONS.glob(f"{prefix}_*.py"))
    return path


def prose(prefix):
    """A lesson's markdown, every cell joined, each run of whitespace one space (sentences span lines)."""
    text = " ".join(cell.source for cell in cells(lesson_path(prefix)) if cell.kind == "markdown")
    return re.sub(r"\s+", " ", text)


def sentence(text, words):
    """The one sentence of `text` that holds `words` (a sentence ends at a full stop before a capital, a
    bracket or a list's dash)."""
    found = [s for s in re.split(r"(?<=\.)\s+(?=[A-Z*(-])", text) if words in s]
    assert len(found) == 1, f"{len(found)} sentences hold {words!r}: {found}"
    return found[0]


def shown(value, digits=1):
    """A number as the prose rounds it, e.g. 3.18e-05 -> 3.2e-05 (compared as floats: '3.2e-5' reads the same)."""
    return float(f"{value:.{digits}e}")


@pytest.fixture(scope="module")
def l20():
    return load(lesson_path("20"))


@pytest.fixture(scope="module")
def l23():
    return load(lesson_path("23"))


# ---- one place for link and device numbers ---------------------------------------------------------------

def literal_numbers(path):
    """(line, value) of every int or float literal in a Python file's code (comments and prose are not code)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            yield node.lineno, node.value


def test_no_lesson_or_module_restates_a_hardware_number():
    """A literal within 2% of a number hardware.py holds, or of twice one (a datasheet's both-directions or
    with-sparsity figure), is that number written a second time: 64e9 for PCIe beside 63.0e9 was one. A power
    of ten (1e9, 1e12, 1e15) is a unit, GB/s or PFLOP, not a figure."""
    figures = {name: value for name, value in HARDWARE.items()} | {f"2 x {n}": 2 * v for n, v in HARDWARE.items()}
    files = sorted(LESSONS.glob("*.py")) + [p for p in sorted((REPO / "picockpt").rglob("*.py"))
                                            if p.name != "hardware.py"]
    found = [f"{path.relative_to(REPO)}:{line}: {value:g} is {name} ({figure:g}): import it from picockpt.planning.hardware"
             for path in files for line, value in literal_numbers(path)
             if abs(value) >= 1e9 and not math.log10(abs(value)).is_integer()
             for name, figure in figures.items() if math.isclose(value, figure, rel_tol=0.02)]
    assert not found, "\n".join(found)


def test_lessons_20_and_23_take_their_rates_from_hardware(l20, l23):
    assert l20.LINKS == {"PCIe Gen5 x16": hardware.PCIE_GEN5_X16, "NVLink-C2C": hardware.NVLINK_C2C}
    assert l20.RATES == {"H100 SXM": hardware.H100_SXM_BF16, "H200 SXM": hardware.H200_SXM_BF16}
    assert l23.LINKS == {"NVLink 4": hardware.NVLINK_4, "PCIe Gen5 x16": hardware.PCIE_GEN5_X16,
                         "InfiniBand NDR": hardware.INFINIBAND_NDR}
    assert l23.H100_BF16 == hardware.H100_SXM_BF16


@pytest.mark.parametrize("prefix", ["20", "23"])
def test_every_link_figure_in_the_prose_is_hardwares(prefix):
    """Each 'N GB/s' is one direction of a hardware.py link, or a datasheet figure it halves: NVLink's and
    NVLink-C2C's 900 GB/s, PCIe Gen5's 128 GB/s (both directions of 32 GT/s x 16 lanes, before encoding)."""
    quoted = {2 * hardware.NVLINK_4, 2 * hardware.NVLINK_C2C, 2 * 32e9 * 16 / 8}
    allowed = set(HARDWARE.values()) | quoted
    for figure in re.findall(r"(\d[\d,]*(?:\.\d+)?) GB/s", prose(prefix)):
        value = float(figure.replace(",", "")) * 1e9
        assert any(math.isclose(value, a, rel_tol=0.005) for a in allowed), f"lesson {prefix}: {figure} GB/s"
    pcie = f"{hardware.PCIE_GEN5_X16 / 1e9:.1f} GB/s"  # 63.0: one direction, 128b/130b paid
    assert pcie in prose(prefix), f"lesson {prefix} does not give PCIe Gen5's {pcie}"


@pytest.mark.parametrize("prefix", ["20", "23"])
def test_every_compute_rate_in_the_prose_is_hardwares(prefix):
    for figure in re.findall(r"(\d[\d,]*(?:\.\d+)?) TFLOP", prose(prefix)):
        assert float(figure.replace(",", "")) * 1e12 == hardware.H100_SXM_BF16 == hardware.H200_SXM_BF16, \
            f"lesson {prefix}: {figure} TFLOP/s"


# ---- lesson 20: two copies, the sources -----------------------------------------------------------------

def test_20_unhidden_break_even_counts_both_copies(l20):
    """Moved, a tensor crosses the link twice; with neither copy hidden it beats recomputing below W/(2R)."""
    W, R = hardware.PCIE_GEN5_X16, hardware.H200_SXM_BF16
    assert l20.break_even(W, R) == W / (2 * R) and l20.break_even(W, R, hidden=True) == W / R
    text = prose("20")
    unhidden = sentence(text, "beats it only below")
    assert "$W/(2R)$" in unhidden and "$W/R$" not in unhidden and "crosses the link twice" in text
    pcie, c2c = re.search(r"\$W/\(2R\)\$: ([\d.e-]+) B/FLOP for PCIe .*?, ([\d.e-]+) B/FLOP over NVLink-C2C",
                          unhidden).groups()
    assert float(pcie) == shown(l20.break_even(W, R))
    assert float(c2c) == shown(l20.break_even(hardware.NVLINK_C2C, R))
    hidden = sentence(text, "both copies cost nothing")
    pcie, c2c = re.search(r"below \$W/R\$ \(([\d.e-]+) B/FLOP for PCIe, ([\d.e-]+) B/FLOP over NVLink-C2C\)",
                          hidden).groups()
    assert float(pcie) == shown(W / R) and float(c2c) == shown(hardware.NVLINK_C2C / R)


def test_20_projections_are_cheaper_to_rebuild_over_both_links_unless_hidden(l20):
    """'The projections' ratio is 1/h ... above both': checked on Llama 3 8B's q projection."""
    llama = Config.from_preset("llama3-8b", dtype="bf16", attention="eager", max_seq=4096)
    ratio = l20.bytes_per_flop(llama, 4096)["attn.q"]
    assert ratio == pytest.approx(1 / llama.hidden)
    assert f"$1/h$ = {shown(ratio):.1e}".replace("e-04", "e-4") in prose("20")
    for W in l20.LINKS.values():
        assert ratio > l20.break_even(W, hardware.H200_SXM_BF16)


def test_20_exercise_asks_about_both_copies():
    question = sentence(prose("20"), "would moving a Llama 3 8B layer's `mlp.gate` be cheaper")
    assert "if nothing hid either copy" in question
    assert "break_even(PCIE_GEN5_X16, H200_SXM_BF16)" in lesson_path("20").read_text(encoding="utf-8")


def test_20_cites_the_deepspeed_issue_that_asks_and_megatrons_offloading_docs():
    text = prose("20")
    deepspeed = sentence(text, "It once required partitioning")
    assert "#541" in deepspeed and "#522" not in text  # #541 asks why CPU checkpointing needed partitioning
    for path in ("megatron/core/transformer/moe/README.md",
                 "docs/user-guide/features/fine_grained_activation_offloading.md",
                 "megatron/core/model_parallel_config.py"):
        assert path in text, path
    assert "`--fine-grained-activation-offloading --offload-modules ...`" in text


def test_20_c2c_figure_is_gb200s_in_te_and_gh200s_in_its_datasheet():
    text = prose("20")
    te = sentence(text, "Transformer Engine's CPU-offloading docs")
    assert "GB200" in te and "900 GB/s" in te and "GH200 datasheet" in te
    assert "Grace superchip" not in text and "Grace Hopper's 900" not in lesson_path("20").read_text()


# ---- lesson 21: the fp8 bound and subnormals ------------------------------------------------------------

def power(x):
    """2^{-6} for 0.015625, as the lesson's TeX writes it."""
    return f"2^{{{math.log2(x):.0f}}}"


def test_21_fp8_bound_holds_for_normals_and_says_where_subnormals_start():
    e4m3, e5m2 = torch.finfo(torch.float8_e4m3fn), torch.finfo(torch.float8_e5m2)
    text = prose("21")
    bound = sentence(text, "That bound holds")
    assert "normal numbers only" in bound
    subnormal = text[text.index("## Where the"):]
    for figure in (power(e4m3.eps / 2), power(e4m3.smallest_normal), power(e4m3.smallest_normal * e4m3.eps),
                   power(e4m3.smallest_normal * e4m3.eps / 2), power(e5m2.eps / 2), power(e5m2.smallest_normal),
                   f"{e5m2.max:,.0f}", f"{e4m3.max / e4m3.smallest_normal:,.0f}"):
        assert figure in subnormal, figure


def test_21_narrow_store_counts_where_the_bound_fails():
    """Normal values keep 2^-4 of themselves; a subnormal one may lose more, and a tiny one all of itself."""
    m = load(lesson_path("21"))
    x = torch.tensor([448.0, 1.0, 3.3, 1.3 * 2**-9, 2**-12, -0.02], dtype=torch.float32)  # amax 448: scale 1
    store = m.NarrowStore({"x"}, torch.float32)
    store.put(0, "x", x)
    assert (store.elements, store.subnormal, store.zeroed) == (6, 2, 1)
    back = store.pop(0, "x")
    relative = ((back - x).abs() / x.abs()).tolist()
    assert all(r <= 2**-4 for r in relative[:3] + relative[5:])  # normals: within the bound
    assert relative[3] > 2**-4 and relative[4] == 1.0  # a subnormal beyond it; 2^-12 rounded to zero


# ---- lesson 22: the price of recomputation is the whole step's, not its phase's time ---------------------------

def committed_rounds(cheap_over_none):
    """rounds_of(policy, key) for lesson 22's diagnose(): none at 100 ms a round, full 1.109x, cheap as given, and
    cheap's recompute phase 9.1% of its time against 2.1% of its FLOPs (the committed CPU run's medians)."""
    seconds = {"none": [0.1] * len(cheap_over_none), "full": [0.1109] * len(cheap_over_none),
               "cheap": [0.1 * r for r in cheap_over_none]}
    share = {"recompute_time": 0.091, "recompute_flops_share": 0.021}
    return lambda policy, key: seconds[policy] if key == "seconds" else [share[key]] * len(cheap_over_none)


def test_22_names_flops_understating_cheaps_price_only_from_the_paired_step_ratio(capsys):
    """The committed run: cheap / none 0.968 [0.956..1.008] against a FLOP ratio of 1.021, while its recompute
    phase took 4.4x the time share its FLOPs would. The phase's share is not the price: no conclusion."""
    l22 = load(lesson_path("22"))
    flops = {"none": 1.0, "full": 1.328, "cheap": 1.021}
    claims = l22.diagnose("cpu", committed_rounds((0.968, 0.956, 1.008, 0.97, 0.96)), flops)
    out = capsys.readouterr().out
    assert claims["cheap recompute share"].conclusive and not claims["cheap price against FLOPs"].conclusive
    assert "here FLOP-based estimates understate its price" not in out
    assert "understate its price is inconclusive on this machine" in out
    claims = l22.diagnose("cpu", committed_rounds((1.05, 1.06, 1.04, 1.05, 1.07)), flops)  # every round above 1.021
    assert claims["cheap price against FLOPs"].conclusive
    assert "here FLOP-based estimates understate its price" in capsys.readouterr().out
    text = prose("22")
    assert "so FLOP-based estimates understate its price" not in text
    assert "the time spent in a phase is not its marginal cost" in text


# ---- lesson 23: Megatron's overlap, recomputation and the data-parallel step ----------------------------

def test_23_tp_comm_overlap_needs_sequence_parallelism():
    """megatron/training/arguments.py asserts sequence_parallel when tp_comm_overlap is set."""
    text = prose("23")
    refused = sentence(text, "is refused without sequence parallelism")
    assert "`tp_comm_overlap`" in refused and "megatron/training/arguments.py" in refused
    assert "unless `tp_comm_overlap`" not in text


def test_23_megatron_overlaps_the_backward_all_reduce_without_sequence_parallelism():
    """megatron/core/tensor_parallel/layers.py: without sequence parallelism the column-parallel linear's backward
    launches the input gradient's all-reduce with async_op=True and computes the weight gradient under it."""
    text = prose("23")
    assert "Megatron-LM does not" not in text and "each all-reduce sits between" not in text
    launched = sentence(text, "`async_op=True`")
    for words in ("megatron/core/tensor_parallel/layers.py", "weight gradient", "not self.sequence_parallel"):
        assert words in launched, words
    assert "overlaps half of them: the backward's" in text


def test_23_recomputation_widens_the_window_and_never_shortens_the_step(l23):
    IB, F = hardware.INFINIBAND_NDR, hardware.H100_SXM_BF16
    text = prose("23")
    assert "recomputation helps" not in text and "It never makes a step shorter" in text
    window = sentence(text, "gives the gradient all-reduce a longer window")
    full, none = re.search(r"d = 8: ([\d,]+) with `full` against ([\d,]+) without", window).groups()
    assert full == f"{l23.hiding_tokens(8, F, IB, policy='full'):,.0f}"
    assert none == f"{l23.hiding_tokens(8, F, IB):,.0f}"
    grows = sentence(text, "still grows")
    growth = {int(k.replace(",", "")): float(r) for k, r in re.findall(r"at ([\d,]+) (?:tokens per GPU, .*? )?by "
                                                                       r"(?:the recomputed forward, 8/6 = )?([\d.]+)",
                                                                       grows)}
    assert set(growth) == {32768, 16384}
    for tokens, ratio in growth.items():
        step = l23.dp_step_seconds(tokens, 8, F, IB, policy="full") / l23.dp_step_seconds(tokens, 8, F, IB)
        assert f"{step:.3f}" == f"{ratio:.3f}", tokens
    assert "at 8,192 and below" in grows and "by nothing" in grows
    for tokens in (2**k for k in range(8, 14)):  # 8,192 and below: the all-reduce outlasts both backwards
        assert l23.dp_step_seconds(tokens, 8, F, IB, policy="full") == l23.dp_step_seconds(tokens, 8, F, IB)
    for tokens in (2**k for k in range(8, 20)):
        assert l23.dp_step_seconds(tokens, 8, F, IB, policy="full") >= l23.dp_step_seconds(tokens, 8, F, IB)


# ---- README: what picockpt builds -------------------------------------------------------------------------

def test_readme_opening_names_context_parallelism_and_zero():
    opening = re.sub(r"\s+", " ", (REPO / "README.md").read_text(encoding="utf-8").split("## ")[0])
    builds = sentence(opening, "runs split over processes")
    for word in ("tensor", "sequence", "context", "pipeline", "data", "expert", "ZeRO"):
        assert word in builds, word
    assert (REPO / "picockpt/parallel/context_parallel").is_dir()
    assert (REPO / "picockpt/parallel/data_parallel/zero_shards.py").is_file()

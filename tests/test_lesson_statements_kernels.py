"""What lessons 21, 25, 26 and 27 say about number formats, the caching allocator, the memory hierarchy and
tensor-core layouts, read from their text and checked against torch or the source each one names: where fp8
rounds to zero, the allocator's documented settings, which working sets a cache holds, which strided operands
torch.matmul copies (recorded by dispatch, not assumed), which dimension an odd vocabulary misaligns, and how
batched attention products fill a GPU's waves.
"""
import re

import pytest
import torch

from picockpt import Config
from picockpt.teaching.reproduce import load
from test_lesson_statements_time import lesson_path, prose  # one reading of a lesson's markdown for both files

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def sentence(text, words):
    """The one sentence of `text` that holds `words` (here a sentence may also start with a backtick)."""
    found = [s for s in re.split(r"(?<=\.)\s+(?=[A-Z*(`-])", text) if words in s]
    assert len(found) == 1, f"{len(found)} sentences hold {words!r}: {found}"
    return found[0]


# ---- lesson 21: where e4m3 turns subnormal, and where it rounds to zero ---------------------------------------

def test_21_zero_starts_at_1_over_458752_of_the_amax_not_at_the_subnormal_threshold():
    """Scaled onto 448, an element below 448 / 2^-6 turns subnormal; only below 448 / 2^-10 (half the subnormal
    step 2^-9) does it round to zero, as torch's own cast shows."""
    e4m3 = torch.finfo(torch.float8_e4m3fn)
    subnormal, zero = e4m3.max / e4m3.smallest_normal, e4m3.max / (e4m3.smallest_normal * e4m3.eps / 2)
    assert (subnormal, zero) == (28672, 458752)
    amax = torch.tensor(448.0)
    assert (amax / (zero * 0.99)).to(torch.float8_e4m3fn).float() > 0  # just above: the smallest subnormal
    assert (amax / (zero * 1.01)).to(torch.float8_e4m3fn).float() == 0  # just below: zero
    said = sentence(prose("21"), "rounds to zero only once")
    assert f"{subnormal:,.0f} times smaller" in said and f"{zero:,.0f} times smaller" in said


# ---- lesson 25: the allocator settings torch's own error and notes name ------------------------------------------

def test_25_teaches_the_settings_torchs_out_of_memory_error_and_notes_name():
    """c10/cuda/CUDACachingAllocator.cpp's out-of-memory message recommends expandable_segments:True; the memory
    management notes document it and garbage_collection_threshold (added by pytorch/pytorch #74261)."""
    text = prose("25")
    section = text[text.index("## The two settings to try first"):text.index("## Against the real allocator")]
    for words in ("`expandable_segments:True`", "If reserved but unallocated memory is large try setting "
                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation",
                  "c10/cuda/CUDACachingAllocator.cpp", "docs/source/notes/cuda.rst",
                  "`garbage_collection_threshold:t`", "#74261", "without synchronizing the device"):
        assert words in section, words
    assert "max_split_size_mb` is the documented last resort" in section


# ---- lesson 26: a working set's level by its size, and by its measured speed ----------------------------------

def test_26_a_working_set_is_labelled_by_its_measured_speed_beside_its_size():
    """The committed run's 32-256 MiB working sets fit its 480 MiB L3 by size and ran at 0.92-0.94 ns an element,
    its DRAM's 0.89-0.91: the label now comes from the measurement, DRAM speed when no faster than DRAM's
    fastest repeat."""
    l26 = load(lesson_path("26"))
    spread = l26.Spread
    streamed = 8
    per_element = {streamed: spread((0.893e-9, 0.886e-9, 1.008e-9)), 1: spread((0.938e-9, 0.914e-9, 0.967e-9)),
                   2: spread((0.749e-9, 0.713e-9, 0.898e-9))}
    assert l26.speed_of(1, per_element, streamed) == "DRAM speed"  # 64 MiB in the committed table
    assert l26.speed_of(2, per_element, streamed) == "faster"  # 16 MiB
    text = prose("26")
    assert "runs at" in text and "is the socket's, shared by every core on it" in text


@pytest.fixture(scope="module")
def l27():
    return load(lesson_path("27"))


# ---- lesson 27: strided heads, an odd vocabulary, waves --------------------------------------------------------

def test_27_matmul_copies_strided_heads_only_when_it_folds_two_batch_dimensions(l27):
    """torch.matmul folds (B, H) into one batch dimension before bmm: a (B, T, H, hd) tensor viewed as
    (B, H, T, hd) folds without a copy only at B = 1; scaled_dot_product_attention takes the views as they are."""
    assert l27.copies_of_strided_heads(1, 16, 4, 8) == {"matmul": 0, "sdpa": 0}
    assert l27.copies_of_strided_heads(4, 16, 4, 8) == {"matmul": 2, "sdpa": 0}
    text = prose("27")
    assert "cannot be passed as it is" not in text and "PyTorch copies it first" not in text
    assert "folds the two batch dimensions (B, H) into one" in text
    copy = sentence(text, "at B = 1 the fold is free")
    assert "at B > 1 matmul copies each operand first" in copy
    assert "flash_attn/flash_attn_interface.py" in text and "(batch, seqlen, heads, headdim)" in text


def test_27_an_odd_vocabulary_misaligns_the_logits_not_the_weight(l27):
    """The weight is (V, h): its rows are h long (GPT-2: 768, 16-byte aligned in bf16); V is the logits' and their
    gradient's leading dimension."""
    text = prose("27")
    assert "rows of the weight that do not start" not in text
    assert l27.aligned(768) and not l27.aligned(50257)
    said = sentence(text, "*leading* dimension")
    assert "logits (tokens, V) and their gradient" in said
    assert "every row starts on a 16-byte boundary" in sentence(text, "Not in the weight")


def test_27_attention_products_fill_the_waves_of_all_their_heads_and_hopper_softens_the_tail(l27):
    llama = Config.from_preset("llama3-8b", dtype="bf16")
    table = l27.shape_table(llama, 4096, 4096)
    assert "p v (a head)" not in table
    pv = table["p v (B·H heads)"]
    assert pv["tiles"] == llama.heads * l27.tiles(4096, llama.head_dim)  # 32 heads x 16 tiles, one grid
    assert pv["wave"] == pytest.approx(512 / (4 * 132))  # four waves, not one sixteen-tile wave of 12%
    text = prose("27")
    for words in ("persistent", "stream-K", "Osama et al. 2023", "worst case"):
        assert words in text, words

"""What lessons 21, 25, 26 and 27 say about number formats, the caching allocator, the memory hierarchy and
tensor-core layouts, read from their text and checked against torch or the source each one names: where fp8
rounds to zero, the allocator's documented settings, which working sets a cache holds, which strided operands
torch.matmul copies (recorded by dispatch, not assumed), which dimension an odd vocabulary misaligns, and how
batched attention products fill a GPU's waves.
"""
import re

import pytest

from picockpt import Config
from picockpt.reproduce import load
from test_lesson_statements_time import lesson_path, prose  # one reading of a lesson's markdown for both files

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def sentence(text, words):
    """The one sentence of `text` that holds `words` (here a sentence may also start with a backtick)."""
    found = [s for s in re.split(r"(?<=\.)\s+(?=[A-Z*(`-])", text) if words in s]
    assert len(found) == 1, f"{len(found)} sentences hold {words!r}: {found}"
    return found[0]


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

"""What the layout model says of layouts people trained, held where it holds: the Llama 3 paper's three Table 4
rows (where each ranks among the distinct splits, its step against the fastest, its modelled MFU) and two sanity
cases. Where the model misses a target its gap is stated here and asserted as measured, not tuned away:

    row (Table 4)                          rank of splits   x fastest   modelled MFU (reported)
    8,192 GPUs, 8K, TP8 CP1 PP16 DP64       13 of 261        1.03        61.7% (43%)
    16,384 GPUs, 8K, TP8 CP1 PP16 DP128     14 of 278        1.09        54.8% (41%)
    16,384 GPUs, 128K, TP8 CP16 PP16 DP8     1 of 220        1.00        43.4% (38%)
    (at the datasheet's peak, Model(kernels=False): 9 at 1.06x, 77.7%; 16 at 1.11x, 68.3%; 1 at 1.00x, 65.4%)

Kernel efficiency (kernel_rates.py: matmuls at the H100's best measured rate, 80% of the datasheet, attention at
cuDNN's published rates) brings the modelled MFU within 6 points of the reported one at 128K, where attention is
40% of the FLOPs, and within 14 and 19 points at 8K. Sequence parallelism's collectives chunked under their GEMMs
(Megatron's --tp-comm-overlap, layout_time.Model.chunked_tp) leave TP8 little exposed communication, which brings
every published split within 1.10x of the fastest; at 8K the fastest splits still take context parallelism (CP2
to CP8) where the paper took none: nothing in the model says a rank's fewer rows run any slower as long as their
tiles fill the SMs. Llama 3 70B on 1,024 GPUs: the model's best is TP1 CP2 with FSDP over 512 ranks (its gathers
hidden behind the compute at datasheet link rates); the first TP4 or TP8 split with 4 to 8 stages is 7th of 181,
at 1.19x."""
import pytest

from picockpt import Config
from picockpt.planning.cost import HARDWARE
from picockpt.planning.layout_search import LLAMA3_405B_TABLE_4, distinct_splits, rank_of, search, split_of

H100 = HARDWARE["h100"]
GIB = 2**30

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # conftest.py; five searches, ~25 s


@pytest.fixture(scope="module")
def table_4():
    """{(gpus, seq): (distinct splits, rank, the published split's best row, reported MFU)}, 80 GiB H100s."""
    cfg, out = Config.from_preset("llama3-405b", dtype="bf16"), {}
    for gpus, seq, layout, _, reported in LLAMA3_405B_TABLE_4:
        splits = distinct_splits(search(cfg, seq, gpus, 2**24, 80 * GIB, H100)[0])
        rank, row = rank_of(splits, layout)
        out[gpus, seq] = splits, rank, row, reported
    return out


def ratio(splits, row):
    return row["step_seconds"] / splits[0]["step_seconds"]


def test_every_published_layout_fits_and_models_above_its_reported_mfu(table_4):
    """What the model leaves out (stragglers, launch gaps, overlap that slows the kernels it hides under) only
    slows a step: every published split fits, modelled above its reported MFU."""
    for splits, rank, row, reported in table_4.values():
        assert rank is not None and row["fits"] and row["mfu"] > reported


def test_the_modelled_mfu_gaps_as_measured(table_4):
    """Met at 128K (within 8 points of the reported 38%); not met at 8K, held at the gaps measured."""
    gaps = {key: row["mfu"] - reported for key, (_, _, row, reported) in table_4.items()}
    assert gaps[16384, 131072] < 0.08
    assert 0.12 < gaps[16384, 8192] < 0.15 and 0.17 < gaps[8192, 8192] < 0.20


def test_the_128k_layout_is_the_fastest(table_4):
    splits, rank, row, _ = table_4[16384, 131072]
    assert rank == 1 and ratio(splits, row) == 1.0


def test_the_8k_layouts_within_1_10x_of_the_fastest(table_4):
    """Met: within 1.10x. Not met: among the 10 fastest splits (13th and 14th, held); the fastest takes context
    parallelism in the place of some pipeline or data parallelism."""
    for key in ((8192, 8192), (16384, 8192)):
        splits, rank, row, _ = table_4[key]
        assert ratio(splits, row) < 1.10
        assert 10 < rank <= 16 and splits[0]["cp"] > 1


def test_the_paper_layouts_best_variants_interleave_the_lighter_ends(table_4):
    """The search reaches the paper's own choices for its split: interleaving (its chunks over the lighter first and
    last stages) and sequence parallelism."""
    for splits, rank, row, _ in table_4.values():
        assert row["schedule"] == "interleaved" and row["split"] == "lighter ends" and row["sp"]


def test_llama3_8b_on_8_gpus_takes_fsdp_over_plain_data_parallelism():
    rows, _ = search(Config.from_preset("llama3-8b", dtype="bf16"), 8192, 8, 2**16, 80 * GIB, H100)
    assert split_of(rows[0]) == (1, 1, 1, 8) and rows[0]["zero"] == "3"
    assert not any(r["zero"] == "0" and split_of(r) == (1, 1, 1, 8) for r in rows)  # DP8: 18 bytes a parameter,
    #                                                           144 GB of state, does not fit 80


def test_llama3_70b_on_1024_gpus_gap_as_measured():
    """Target TP8 or TP4 with 4 to 8 stages: not met. Held: such a split is in the model's top 10 of 181 (7th),
    within 1.3x of its best (TP1 CP2 FSDP over 512 ranks)."""
    splits = distinct_splits(search(Config.from_preset("llama3-70b", dtype="bf16"), 8192, 1024, 2**22, 80 * GIB,
                                    H100)[0])
    rank = next(i for i, r in enumerate(splits, 1) if r["tp"] in (4, 8) and 4 <= r["pp"] <= 8)
    assert rank <= 10 and ratio(splits, splits[rank - 1]) < 1.3

"""The hardware arithmetic of lessons 26 and 27 against hand calculations: this machine's cache sizes (read
from sysfs or lscpu, and the fallback where neither answers), arithmetic intensity and the roofline, the
bytes of each recompute, the eager rebuilds against picockpt's ops, and the tile and wave quantization of
NVIDIA's Matrix Multiplication Background User's Guide."""
import math
import pathlib

import pytest
import torch

from picockpt import Config
from picockpt.measurement.cpu_caches import SYSFS, TYPICAL, CacheSizes, from_lscpu, from_sysfs, parse_size, read_cache_sizes
from picockpt.planning.hardware import H100_SXM_BF16, H100_SXM_HBM
from picockpt.ops.rmsnorm import rmsnorm_apply
from picockpt.ops.swiglu import swiglu_forward
from picockpt.teaching.reproduce import LESSONS, load

LSCPU = """NAME ONE-SIZE ALL-SIZE WAYS TYPE        LEVEL SETS PHY-LINE COHERENCY-SIZE
L1d     32768    65536    8 Data            1   64        1             64
L1i     65536   131072    4 Instruction     1  256        1             64
L2     524288  1048576    8 Unified         2 1024        1             64
L3    8388608  8388608   16 Unified         3 8192        1             64
"""
EXPECTED = {"L1d": 32768, "L1i": 65536, "L2": 524288, "L3": 8388608}


@pytest.fixture(scope="module")
def memory():
    return load(next(LESSONS.glob("26_*.py")))


@pytest.fixture(scope="module")
def layouts():
    return load(next(LESSONS.glob("27_*.py")))


def fake_sysfs(folder, caches):
    """A /sys/devices/system/cpu/cpu0/cache lookalike: one index folder per (level, type, size)."""
    for i, (level, kind, size) in enumerate(caches):
        index = folder / f"index{i}"
        index.mkdir(parents=True)
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (index / name).write_text(f"{text}\n")
    return folder


# ---- this machine's caches -------------------------------------------------------------------------------------

def test_sizes_are_read_as_sysfs_and_lscpu_write_them():
    assert [parse_size(text) for text in ("32K", "8192K", "1M", "64 KiB", "524288", "2 MiB")] == \
           [32768, 8388608, 2**20, 65536, 524288, 2 * 2**20]
    with pytest.raises(ValueError, match="cache size 'big' is not a size: write it as 32K"):
        parse_size("big")


def test_sysfs_is_read_index_by_index(tmp_path):
    folder = fake_sysfs(tmp_path / "cache", [(1, "Data", "32K"), (1, "Instruction", "64K"), (2, "Unified", "512K"),
                                             (3, "Unified", "8192K")])
    (folder / "index4").mkdir()  # an index without its files is skipped, not fatal
    assert from_sysfs(folder) == EXPECTED
    sizes = read_cache_sizes(folder, lscpu=lambda: "")
    assert sizes.source == str(folder) and sizes.note == ""
    assert sizes.data_levels == [("L1d", 32768), ("L2", 524288), ("L3", 8388608)]
    assert sizes.last_level == ("L3", 8388608) and sizes.size("L2") == 524288


def test_lscpu_answers_where_sysfs_does_not(tmp_path):
    assert from_lscpu(LSCPU) == EXPECTED
    assert from_lscpu("no table here") == {}
    sizes = read_cache_sizes(tmp_path / "absent", lscpu=lambda: LSCPU)
    assert sizes.levels == EXPECTED and sizes.source == "lscpu -C -B" and sizes.note == ""


def test_without_either_typical_sizes_stand_in_and_say_so(tmp_path):
    sizes = read_cache_sizes(tmp_path / "absent", lscpu=lambda: "")
    assert sizes.levels == TYPICAL and sizes.source == "assumed (typical sizes)"
    assert sizes.note.startswith(f"this machine's cache sizes could not be read (no {tmp_path / 'absent'}, "
                                 f"no `lscpu -C -B`): typical sizes stand in")
    only_l1 = fake_sysfs(tmp_path / "l1", [(1, "Data", "32K")])  # no level beyond L1: not enough to choose from
    assert read_cache_sizes(only_l1, lscpu=lambda: "").source == "assumed (typical sizes)"


def test_an_unknown_level_is_refused_by_name():
    with pytest.raises(ValueError, match=r"cache 'L4' is not among this machine's caches: use one of L1d, L2"):
        CacheSizes({"L1d": 32768, "L2": 524288}, "test").size("L4")


@pytest.mark.skipif(not pathlib.Path(SYSFS).is_dir(), reason="no /sys cache folder on this machine")
def test_this_machine_is_read_from_sysfs():
    sizes = read_cache_sizes()
    names = [name for name, _ in sizes.data_levels]
    assert sizes.source == str(SYSFS) and names[0].startswith("L1") and "L2" in names
    assert all(a < b for (_, a), (_, b) in zip(sizes.data_levels, sizes.data_levels[1:]))


# ---- lesson 26: intensity, the roofline, the bytes of each recompute ------------------------------------------

def test_intensity_and_roofline_against_hand_calculations(memory):
    assert memory.arithmetic_intensity(5, 6) == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="nbytes=0"):
        memory.arithmetic_intensity(5, 0)
    ridge = H100_SXM_BF16 / H100_SXM_HBM
    assert memory.attainable_rate(5 / 6, H100_SXM_BF16, H100_SXM_HBM) == pytest.approx(5 / 6 * 3.35e12)
    assert memory.attainable_rate(2 * ridge, H100_SXM_BF16, H100_SXM_HBM) == H100_SXM_BF16  # above the ridge: peak
    assert memory.least_seconds(1e12, 1e9, 1e12, 1e12) == 1.0  # FLOP-bound: a second of FLOPs, a ms of bytes
    assert memory.least_seconds(1e9, 1e12, 1e12, 1e12) == 1.0  # memory-bound
    assert memory.least_seconds(1, 1, 1e12, 1e12, exps=3.9e12) == pytest.approx(1.0)  # exp-bound


def test_recompute_bytes_and_flops_of_a_llama_layer(memory):
    cfg, s, e = Config.from_preset("llama3-8b", dtype="bf16"), 4096, 2
    costs = memory.recompute_costs(cfg, s, e)
    assert costs["SwiGLU rebuild"] == (5 * s * 14336, 3 * s * 14336 * 2, s * 14336)
    assert costs["RMSNorm rebuild"] == (2 * s * 4096, 2 * s * 4096 * 2 + 4 * s + 4096 * 2, 0)
    assert costs["down projection (matmul)"][0] == 2 * s * 14336 * 4096
    causal = s * (s + 1) // 2
    written, flash = costs["P rebuilt, written to HBM"], costs["P rebuilt in SRAM (flash)"]
    assert written[0] == flash[0] == 2 * 32 * causal * 128  # the same FLOPs: only where P goes differs
    assert written[1] - flash[1] == 2 * 32 * causal * e  # P written once and read back, bf16
    assert flash[1] == (32 + 8) * s * 128 * e + 4 * s * 32  # q, k and one fp32 log-sum-exp per row and head


def test_the_eager_rebuilds_equal_picockpts_ops(memory):
    x, rstd, w, out = memory.norm_operands(64 * 2**10)
    assert (x.numel() + out.numel() + rstd.numel() + w.numel()) * 4 <= 64 * 2**10  # within the working set
    assert torch.equal(memory.norm_rebuild(x, rstd, w, out), rmsnorm_apply(x, rstd, w))
    gate, up = torch.randn(1000), torch.randn(1000)
    torch.testing.assert_close(memory.swiglu_rebuild(gate, up, torch.empty(1000)), swiglu_forward(gate, up))
    assert memory.eager_norm_bytes(10, h=128) == (4 * 10 * 128 + 10 + 128) * 4  # two passes


def test_levels_and_timed_steps(memory):
    sizes = CacheSizes(EXPECTED, "test")
    assert [memory.level_of(n, sizes) for n in (1000, 32768, 40000, 8388608, 8388609)] == \
           ["L1d", "L1d", "L2", "L3", "DRAM"]
    steps, elements, moved = memory.timed_steps([64 * 2**10], step_bytes=2**20)
    rows = memory.norm_operands(64 * 2**10)[0].shape[0]
    times = 2**20 // memory.eager_norm_bytes(rows)
    assert elements[64 * 2**10] == times * rows * 128 and moved[64 * 2**10] == times * memory.eager_norm_bytes(rows)
    assert len(steps[64 * 2**10]()) == times  # the step runs the rebuild that many times


# ---- lesson 27: tile and wave quantization, padding, alignment -------------------------------------------------

def test_tile_quantization_is_the_guides_example(layouts):
    assert layouts.tiles(256, 256, (128, 128)) == 4 and layouts.tiles(257, 256, (128, 128)) == 6
    assert layouts.tile_efficiency(257, 256, (128, 128)) == pytest.approx(257 * 256 / (6 * 128 * 128))
    assert layouts.tile_efficiency(4096, 128256) == 1.0  # Llama 3's vocabulary is 1002 tiles of 128
    assert layouts.tile_efficiency(256, 50257) == pytest.approx(50257 / (393 * 128))
    with pytest.raises(ValueError, match="m=0, n=5"):
        layouts.tiles(0, 5)


def test_wave_quantization_against_hand_calculations(layouts):
    assert layouts.waves(108, 108) == 1 and layouts.wave_efficiency(108, 108) == 1.0
    assert layouts.waves(109, 108) == 2 and layouts.wave_efficiency(109, 108) == pytest.approx(109 / 216)
    count = layouts.tiles(4096, 4096)  # Llama 3 8B's down projection at 4096 tokens, 256 x 128 tiles
    assert count == 512 and layouts.waves(count) == math.ceil(512 / 132) == 4
    assert layouts.wave_efficiency(count) == pytest.approx(512 / 528)
    assert layouts.waves(264, 132, per_sm=2) == 1  # two tiles a SM at a time: one wave


def test_padding_and_alignment(layouts):
    assert layouts.pad_to_multiple(50257, 64) == 50304 and layouts.pad_to_multiple(50304, 64) == 50304
    assert layouts.pad_to_multiple(447, 8) == 448
    with pytest.raises(ValueError, match="multiple=0"):
        layouts.pad_to_multiple(10, 0)
    assert layouts.aligned(8) and not layouts.aligned(7) and layouts.aligned(4, element_bytes=4)
    assert layouts.aligned(64, alignment=128) and not layouts.aligned(32, alignment=128)


def test_picockpts_shapes_under_the_rules(layouts):
    table = layouts.shape_table(Config.from_preset("small", dtype="bf16"), 512, 128)
    assert table["gate, up"]["shape"] == (512, 448, 128) and table["down"]["shape"] == (512, 128, 448)
    assert table["gate, up"]["tile"] == pytest.approx(448 / 512)  # 448 columns in four 128-wide tiles
    assert table["q k^T (B·H heads)"]["x8"] and not table["q k^T (B·H heads)"]["x64"]  # head_dim 32: 64 bytes in bf16
    assert table["q"]["tiles"] == 2 and table["q"]["wave"] == pytest.approx(2 / 132)
    steps = layouts.odd_and_padded(64, 16, 48)
    assert steps["odd f"]().shape == steps["padded f"]().shape == (64, 16)
    pair = layouts.strided_and_contiguous(2, 8, 4, 16)
    torch.testing.assert_close(pair["strided"](), pair["contiguous"]())

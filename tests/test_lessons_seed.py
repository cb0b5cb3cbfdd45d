"""Lessons 21, 23 and 24: their committed exercise answers against picockpt's code, and the functions the
lessons measure with, on small shapes (the lessons' experiments do not run here: reproduce.load).

    17  mixed precision of stored and recomputed activations (NarrowStore: fp8 with a per-tensor scale)
    19  time from bytes (the Playbook's overlap ratios, the layer model, the latency-bandwidth fit)
    20  tensor-parallel dropout masks and shared experts
"""
import ast
import math

import pytest
import torch

from picockpt import Config, init_params
from picockpt.planning.step_forms import layer_inventory, predicted_peak_bytes, rebuild_flops
from picockpt.measurement.measure import make_batch
from picockpt.teaching.reproduce import LESSONS, load

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def lesson(prefix):
    [path] = sorted(LESSONS.glob(f"{prefix}_*.py"))
    return path, load(path)


def answers(path):
    """The committed `answer = <number or text>` of the lesson's exercises, in order."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["answer"]]


def close(answer, expected, rel=0.01):
    return math.isclose(answer, expected, rel_tol=rel)


# ---- lesson 21 --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def l21():
    return lesson("21")


@pytest.mark.slow
def test_21_answers(l21):
    path, m = l21
    fp32_bytes, saved, bitwise = answers(path)
    cfg = m.small(dtype="bf16")
    params = init_params(cfg, seed=0)
    ids, targets = make_batch(cfg, 4, 128, "cpu", 0)
    assert fp32_bytes == sum(r[2] for r in layer_inventory(cfg, 4, 128).values() if r[1] == "float32")
    _, none_grads, stored = m.run_step(params, cfg, ids, targets)
    _, _, narrow = m.run_step(params, cfg, ids, targets, store=m.NarrowStore(m.MLP_WIDE, cfg.torch_dtype))
    assert saved == (stored - narrow) / cfg.layers
    _, full_grads, _ = m.run_step(params, cfg, ids, targets, "full")
    assert bitwise == all(torch.equal(full_grads[k], none_grads[k]) for k in none_grads)


def test_21_store_inventory_and_fp8_bytes(l21):
    _, m = l21
    cfg = Config.from_preset("tiny", dtype="bf16")
    params = init_params(cfg, seed=0)
    ids, targets = make_batch(cfg, 2, 16, "cpu", 0)
    found = m.stored_tensors(params, cfg, ids, targets)
    assert {name: row for (layer, name), row in found.items() if layer == 0} == layer_inventory(cfg, 2, 16)
    assert {m.kind(name, dtype) for (_, name), (_, dtype, _) in found.items()} == set(m.KINDS[:3])
    _, _, stored = m.run_step(params, cfg, ids, targets)
    assert stored == predicted_peak_bytes(cfg, 2, 16, "none")
    narrowed = m.NARROWABLE & set(layer_inventory(cfg, 2, 16))  # of every layer; final_norm.output in the head
    layer = layer_inventory(cfg, 2, 16)
    per_layer = sum(layer[name][2] // 2 - 4 for name in narrowed)  # 2 bytes -> 1, plus a 4-byte scale
    head = 2 * 16 * cfg.hidden * 2 // 2 - 4  # final_norm.output
    store = m.NarrowStore(m.NARROWABLE, cfg.torch_dtype)
    _, grads, narrow = m.run_step(params, cfg, ids, targets, store=store)
    assert stored - narrow == cfg.layers * per_layer + head
    assert store.bytes == 0 and all(torch.isfinite(g).all() for g in grads.values())


def test_21_fp8_costs_accuracy_and_recomputation_none(l21):
    _, m = l21
    cfg = Config.from_preset("tiny", dtype="bf16")
    params = init_params(cfg, seed=0)
    ids, targets = make_batch(cfg, 2, 32, "cpu", 0)
    results, fp32_error = m.compare(params, cfg, ids, targets)
    base = results["bf16, store all"]
    for label in ("recompute: cheap", "recompute: full"):
        assert all(torch.equal(results[label][3][k], base[3][k]) for k in base[3]), label
        assert results[label][0] < base[0]
    assert results["fp8 all but stream and stats"][1] > base[1] > fp32_error
    assert results["fp8 all but stream and stats"][0] < results["fp8 MLP (gate, up, act)"][0] < base[0]


def test_21_narrow_store_round_trip(l21):
    _, m = l21
    store = m.NarrowStore({"x"}, torch.bfloat16)
    x = (torch.randn(64, 32) * 7).to(torch.bfloat16)
    store.put(0, "x", x)
    assert store.bytes == 64 * 32 + 4 and store.inventory(0)["x"][1] == "float8_e4m3fn"
    back = store.pop(0, "x")
    assert back.dtype == torch.bfloat16 and store.bytes == 0
    assert (back.float() - x.float()).abs().max() <= x.float().abs().max() * 2**-4  # e4m3: 3 mantissa bits
    store.put(0, "z", torch.zeros(4, dtype=torch.bfloat16))  # not narrowed: as ActivationStore
    assert store.inventory(0)["z"][1] == "bfloat16"


# ---- lesson 23 --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def l23():
    return lesson("23")


def test_23_answers(l23):
    path, m = l23
    tp_ratio, tokens, pcie = answers(path)
    assert close(tp_ratio, m.tp_overlap_ratio(8192, 8, m.H100_BF16, m.LINKS["NVLink 4"]))
    assert close(tokens, m.hiding_tokens(8, m.H100_BF16, m.LINKS["InfiniBand NDR"], policy="full"))
    big = Config.from_preset("llama3-70b", dtype="bf16")
    phases = m.tp_layer_seconds(big, 1, 4096, 8, m.H100_BF16, m.LINKS["PCIe Gen5 x16"], "full")
    assert close(pcie, sum(v[1] for v in phases.values()) / sum(v[0] for v in phases.values()))


def test_23_model(l23):
    _, m = l23
    assert m.tp_overlap_ratio(8192, 8, 989e12, 450e9) == pytest.approx(2 * 7 / (2 * 8192) * 989e12 / 450e9)
    none, full = (m.hiding_tokens(8, 989e12, 50e9, policy=p) for p in ("none", "full"))
    assert full == pytest.approx(none * 4 / 6)
    assert m.dp_overlap_ratio(none, 8, 989e12, 50e9) == pytest.approx(1.0)
    cfg = Config.from_preset("llama3-8b", dtype="bf16")
    none_layer, full_layer = (m.tp_layer_seconds(cfg, 1, 2048, 4, 1e15, 1e11, p) for p in ("none", "full"))
    assert full_layer["recompute"] == none_layer["forward"] and "recompute" not in none_layer
    assert none_layer["forward"][1] == pytest.approx(2 * 2 * 3 / 4 * 2048 * cfg.hidden * 2 / 1e11)
    assert none_layer["backward"][0] == pytest.approx(2 * none_layer["forward"][0])


def test_23_fit_and_comm_pricing(l23):
    _, m = l23
    sizes = [2**k for k in range(10, 22, 2)]
    alpha, beta = m.fit_latency_bandwidth(sizes, [50e-6 + s / 2e9 for s in sizes])
    assert alpha == pytest.approx(50e-6) and beta == pytest.approx(2e9)
    assert m.fit_latency_bandwidth([1, 2, 3], [3e-4, 2e-4, 1e-4]) == (pytest.approx(2e-4), math.inf)  # noise only
    report = {"comm_bytes": {"forward": 3000, "backward": 1000}, "comm_calls": {"forward": 3, "backward": 1},
              "comm_bytes_by_kind": {"forward": {"all_reduce": 2000, "all_gather": 1000},
                                     "backward": {"all_reduce": 1000}}}
    priced = m.modelled_comm_seconds(report, 1e-3, 1e3, 2)
    assert priced == pytest.approx({"forward": 3e-3 + (2000 + 500) / 1e3, "backward": 1e-3 + 1000 / 1e3})


# ---- lesson 24 --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def l24():
    return lesson("24")


def test_24_answers(l24):
    path, m = l24
    agree, shared_bytes, flops = answers(path)
    r0, r1 = m.rank_masks(m.SCHEMES[1], (4, 8, 128, 128), 1, seed=0)
    assert close(agree, m.agreement(r0, r1))
    exercise = m.small(experts=4, shared_expert_ffn=224)
    assert shared_bytes == sum(r[2] for n, r in layer_inventory(exercise, 4, 128).items() if n in m.SHARED)
    assert flops == rebuild_flops(exercise, 4, 128, m.SHARED)


def test_24_mask_schemes(l24):
    _, m = l24
    state = torch.get_rng_state()
    for label, whole, dim in m.regions(m.small(), 2, 64):
        single = m.single_mask(whole, 3)
        naive, megatron, sliced = (m.rank_masks(s, whole, dim, 3) for s in m.SCHEMES)
        joined = sliced[0] if dim is None else torch.cat(sliced, dim)
        assert torch.equal(joined, single), label  # picockpt: the single process's mask
        assert torch.equal(naive[0], naive[1]), label  # one generator state: every rank the same mask
        if dim is None:  # replicated: every scheme keeps the ranks equal
            assert torch.equal(megatron[0], megatron[1]) and torch.equal(sliced[0], sliced[1])
        else:  # split: independent-looking halves, about 1 - 2p(1-p) agreement
            for masks in (megatron, sliced):
                assert abs(m.agreement(*masks) - (1 - 2 * m.DROPOUT * (1 - m.DROPOUT))) < 0.02, label
    assert torch.equal(torch.get_rng_state(), state)  # the generator is put back


def test_24_shared_expert_rows_equal_closed_form(l24):
    _, m = l24
    cfg = Config.from_preset("tiny", experts=4)
    rows = m.shared_rows(cfg, 2, 16, torch.device("cpu"), 0, (0, 16, 40))
    assert rows[0]["measured"] == rows[0]["predicted"] == 0
    for fs in (16, 40):
        row = rows[fs]
        assert row["measured"] == row["predicted"] == 3 * 2 * 16 * fs * 4
        assert row["peak"] == row["peak_predicted"] and row["saved"] == cfg.layers * row["predicted"]
        assert row["recompute"] == row["recompute_predicted"] == cfg.layers * 2 * 32 * cfg.hidden * 2 * fs
        assert row["bitwise"]

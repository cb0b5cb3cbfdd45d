"""The activation store counts unique storages, and what a layer stores equals the closed form."""
import pytest
import torch

from picockpt import ActivationStore, Config
from picockpt.planning.step_forms import head_inventory, layer_inventory
from picockpt.measurement.measure import measured_inventory
from picockpt.recompute.policy import CHEAP, SELECTIVE


def test_views_are_counted_once():
    store = ActivationStore()
    x = torch.zeros(4, 8)  # 128 bytes
    store.put(0, "a", x)
    store.put(0, "b", x.T)  # a view of the same storage
    store.put(0, "c", x[1:])
    assert store.bytes == 128
    store.put(1, "d", torch.zeros(3))
    assert store.bytes == 140
    store.pop(0, "a")
    store.pop(0, "b")
    assert store.bytes == 140  # "c" still holds the storage
    store.pop(0, "c")
    assert store.bytes == 12 and store.peak_bytes == 140
    kinds = [(e.kind, e.layer, e.name) for e in store.events]
    assert kinds[:2] == [("put", 0, "a"), ("put", 0, "b")] and kinds[-1] == ("pop", 0, "c")


def test_missing_and_double_put_are_clear_errors():
    store = ActivationStore()
    store.put(3, "attn.q", torch.zeros(2))
    with pytest.raises(KeyError, match="already stored"):
        store.put(3, "attn.q", torch.zeros(2))
    with pytest.raises(KeyError, match="layer 3 attn.k is not stored.*attn.q"):
        store.pop(3, "attn.k")


def test_rebuild_is_not_stored():
    store = ActivationStore()
    got = store.pop(0, "mlp.act", rebuild=lambda: torch.ones(5))
    assert got.sum() == 5 and store.bytes == 0 and store.events[-1].kind == "rebuild"


SHAPES = [
    (dict(), 2, 13),
    (dict(hidden=48, heads=6, kv_heads=2, ffn=72), 3, 37),
    (dict(hidden=48, heads=6, kv_heads=6, dropout=0.1), 1, 20),
    (dict(dtype="bfloat16", heads=4, kv_heads=1), 2, 9),
    (dict(dtype="float64", dropout=0.3), 2, 11),
]


@pytest.mark.parametrize("drop_name,unstored", [("none", frozenset()), ("selective", SELECTIVE), ("cheap", CHEAP)])
@pytest.mark.parametrize("fields,batch,seq", SHAPES)
def test_stored_bytes_per_layer_equal_the_closed_form(fields, batch, seq, drop_name, unstored):
    cfg = Config.from_preset("tiny", layers=2, **fields)
    puts = measured_inventory(cfg, batch, seq, drop_name)
    for layer in range(cfg.layers):
        measured = {name: nbytes for (lay, name), nbytes in puts.items() if lay == layer}
        closed = {name: nbytes for name, (_, _, nbytes) in layer_inventory(cfg, batch, seq, unstored).items()}
        assert measured == closed
    measured = {name: nbytes for (lay, name), nbytes in puts.items() if lay is None}
    assert measured == {name: nbytes for name, (_, _, nbytes) in head_inventory(cfg, batch, seq, unstored).items()}


def test_inventory_formula_by_hand():
    # B=2, T=16, h=32, H=4, KV=2, hd=8, f=80, fp32: the table in picockpt/model/layer.py's docstring
    cfg = Config.from_preset("tiny")
    inv = {name: nbytes for name, (_, _, nbytes) in layer_inventory(cfg, 2, 16).items()}
    BTh, e = 2 * 16 * 32, 4
    assert inv["attn.probs"] == 2 * 4 * 16 * 16 * e
    assert inv["attn.k"] == 2 * 16 * 2 * 8 * e
    assert inv["mlp.act"] == 2 * 16 * 80 * e
    assert sum(inv.values()) == (6 * BTh + 2 * (2 * 16 * 2 * 8) + 3 * 2 * 16 * 80 + 2 * 4 * 16 * 16) * e + 2 * 2 * 16 * 4

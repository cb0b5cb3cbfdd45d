"""Attention kinds (eager / tiled / fused) and the chunked head: the same numbers, the bytes of the closed form."""
import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import layer_inventory, predicted_peak_bytes, step_flops
from picockpt.measurement.measure import make_batch
from picockpt.ops import attention_backward, attention_forward
from picockpt.ops.attention_fused import check_fused, fused_attention_backward, fused_attention_forward
from picockpt.ops.attention_tiled import (tile_pairs, tiled_attention_backward, tiled_attention_forward,
                                          tiled_dropout_mask)
from picockpt.planning.planner import plan_model
from picockpt.measurement.reference import ReferenceLlama
from picockpt.measurement.tracker import Tracker

KINDS = ("eager", "tiled", "fused")
POLICIES = ("none", "full", "every:2", "selective", "cheap", "every:3+cheap")


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def qkv(B, H, KV, T, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
            for shape in ((B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd), (B, H, T, hd))]


# ---- the ops against eager ----------------------------------------------------------------------------

SHAPES = {"mha": (2, 4, 4), "gqa": (2, 6, 2), "mqa": (1, 4, 1)}


@pytest.mark.parametrize("dtype,limit", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("heads", SHAPES, ids=str)
@pytest.mark.parametrize("T,tile_q,tile_k", [(37, 8, 8), (37, 16, 5), (1, 4, 4), (50, 7, 13)])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_tiled_matches_eager(dtype, limit, heads, T, tile_q, tile_k, p):
    B, H, KV = SHAPES[heads]
    q, k, v, dout = qkv(B, H, KV, T, 8, dtype)
    seed = torch.tensor(1234)
    out, lse = tiled_attention_forward(q, k, v, dtype, tile_q, tile_k, p, seed)
    mask = tiled_dropout_mask(seed, (B, H, T, T), p, tile_q, tile_k) if p > 0 else None  # the tiles' own mask
    expect, probs, dropped = attention_forward(q, k, v, dtype, mask, p)
    assert rel(out, expect) <= limit
    assert lse.shape == (B, H, T) and lse.dtype == dtype
    grads = tiled_attention_backward(dout, q, k, v, out, lse, dtype, tile_q, tile_k, p, seed)
    for got, want in zip(grads, attention_backward(dout, q, k, v, probs, dropped, dtype, mask, p)):
        if want.abs().max() > 0:
            assert rel(got, want) <= limit
        else:  # T = 1: dq and dk are 0 (one key, softmax = 1); tiled gets P (dP - D) = dP - D, rounding
            assert got.abs().max() <= limit * dout.abs().max()


@pytest.mark.parametrize("dtype,limit", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("heads", SHAPES, ids=str)
@pytest.mark.parametrize("T", [1, 37])
def test_fused_matches_eager(dtype, limit, heads, T):
    B, H, KV = SHAPES[heads]
    q, k, v, dout = qkv(B, H, KV, T, 8, dtype)
    out, lse = fused_attention_forward(q, k, v)
    expect, probs, dropped = attention_forward(q, k, v, dtype)
    assert rel(out, expect) <= limit
    for got, want in zip(fused_attention_backward(dout, q, k, v, out, lse), attention_backward(
            dout, q, k, v, probs, dropped, dtype)):
        assert got.shape == want.shape
        if want.abs().max() > 0:
            assert rel(got, want) <= limit
        else:  # T = 1: dq and dk are 0 (one key, softmax = 1), up to rounding in the kernel's P (dP - D)
            assert got.abs().max() <= limit * dout.abs().max()


def test_tiled_skips_the_tiles_above_the_diagonal():
    pairs = tile_pairs(10, 4, 3)  # query tiles 0-3, 4-7, 8-9; key tiles 0-2, 3-5, 6-8, 9
    assert [(i0, i1, j0, j1) for _, i0, i1, _, j0, j1 in pairs] == [
        (0, 4, 0, 3), (0, 4, 3, 6), (4, 8, 0, 3), (4, 8, 3, 6), (4, 8, 6, 9),
        (8, 10, 0, 3), (8, 10, 3, 6), (8, 10, 6, 9), (8, 10, 9, 10)]


def test_fused_refusals():
    with pytest.raises(ValueError, match="attention='fused' with dropout=0.1.*tiled"):
        Config.from_preset("tiny", attention="fused", dropout=0.1)
    with pytest.raises(ValueError, match="flash kernel, which takes bf16 or fp16, not float32"):
        check_fused(torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="Config.attention='flash'"):
        Config.from_preset("tiny", attention="flash")
    with pytest.raises(ValueError, match="Config.loss_chunk=-1"):
        Config.from_preset("tiny", loss_chunk=-1)


# ---- the whole model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("attention", KINDS)
@pytest.mark.parametrize("loss_chunk", [0, 7])
def test_model_matches_autograd_in_fp64(attention, loss_chunk):
    cfg = Config.from_preset("tiny", layers=3, attention=attention, attention_tile=5, loss_chunk=loss_chunk,
                             dtype="fp64")
    params = init_params(cfg, seed=1)
    ids, targets = make_batch(cfg, 2, 13, "cpu", 1)
    loss, grads = loss_and_grads(params, cfg, ids, targets, "full")
    reference = ReferenceLlama(cfg, params)  # eager attention, whole logits: the oracle
    expect = reference(ids, targets)
    expect.backward()
    assert rel(loss, expect.detach()) <= 1e-12
    for name, grad in reference.grads().items():
        assert rel(grads[name], grad) <= 1e-10, name


@pytest.mark.parametrize("chunk", [1, 5, 13, 26, 40])  # B*T = 26: divisors and not
@pytest.mark.parametrize("dtype,limit", [("fp64", 1e-10), ("fp32", 1e-5)])
def test_chunked_loss_matches_whole_logits(chunk, dtype, limit):
    cfg = Config.from_preset("tiny", dtype=dtype)
    params = init_params(cfg, seed=2)
    ids, targets = make_batch(cfg, 2, 13, "cpu", 2)
    targets = targets.clone()  # (a view of the same token stream as ids)
    targets[0, 3] = -100  # an ignored position, in both
    whole = loss_and_grads(params, cfg, ids, targets)
    chunked = loss_and_grads(params, cfg.replace(loss_chunk=chunk), ids, targets)
    assert rel(chunked[0], whole[0]) <= limit
    for name in whole[1]:
        assert rel(chunked[1][name], whole[1][name]) <= limit, name


CASES = [(attention, chunk, dropout) for attention in KINDS for chunk in (0, 7) for dropout in (0.0, 0.1)
         if not (attention == "fused" and dropout)]


@pytest.mark.parametrize("attention,loss_chunk,dropout", CASES)
def test_every_policy_bitwise_and_on_the_closed_form(attention, loss_chunk, dropout):
    cfg = Config.from_preset("tiny", layers=4, attention=attention, attention_tile=5, loss_chunk=loss_chunk,
                             dropout=dropout)
    params = init_params(cfg, seed=0)
    ids, targets = make_batch(cfg, 2, 13, "cpu", 0)
    B, T = ids.shape
    middle = (predicted_peak_bytes(cfg, B, T, "full") + predicted_peak_bytes(cfg, B, T, "none")) // 2
    torch.manual_seed(1)
    base_loss, base_grads = loss_and_grads(params, cfg, ids, targets, "none")
    for policy in POLICIES + (f"budget:{middle}",):
        torch.manual_seed(1)
        with Tracker(physical=False) as tracker:  # the store's bytes and the FLOPs
            loss, grads = loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
        assert torch.equal(loss, base_loss), policy
        assert all(torch.equal(grads[name], base_grads[name]) for name in grads), policy
        assert tracker.peak_logical == predicted_peak_bytes(cfg, B, T, policy), policy
        expect = step_flops(cfg, B, T, policy)
        assert {phase: tracker.flops[phase] for phase in expect} == expect, policy


@pytest.mark.parametrize("attention", ["tiled", "fused"])
def test_no_probabilities_stored_so_selective_drops_nothing(attention):
    cfg = Config.from_preset("tiny", attention=attention, dropout=0.1 if attention == "tiled" else 0.0)
    inventory = layer_inventory(cfg, 2, 16)
    assert not any("probs" in name for name in inventory)
    assert inventory["attn.lse"] == ((2, cfg.heads, 16), "float32", 2 * cfg.heads * 16 * 4)
    if attention == "tiled":
        assert inventory["attn.dropout_seed"] == ((), "int64", 8)
    assert predicted_peak_bytes(cfg, 2, 16, "selective") == predicted_peak_bytes(cfg, 2, 16, "none")
    assert step_flops(cfg, 2, 16, "selective") == step_flops(cfg, 2, 16, "none")
    assert predicted_peak_bytes(cfg, 2, 16, "cheap") < predicted_peak_bytes(cfg, 2, 16, "none")  # still saves


def test_chunked_head_keeps_one_number_per_token():
    cfg = Config.from_preset("tiny", loss_chunk=8)
    whole = predicted_peak_bytes(cfg.replace(loss_chunk=0), 2, 16, "none")  # its peak: every layer and the head
    chunked = predicted_peak_bytes(cfg, 2, 16, "none")
    assert whole - chunked == 2 * 16 * (cfg.vocab - 1) * 4  # (B, T, V) logits out, (B, T) fp32 lse in


def test_planner_under_tiled_attention_measures_what_it_plans():
    cfg = Config.from_preset("tiny", layers=5, attention="tiled", attention_tile=4, loss_chunk=10)
    B, T = 2, 19
    budget = (predicted_peak_bytes(cfg, B, T, "full") + predicted_peak_bytes(cfg, B, T, "none")) // 3
    plan = plan_model(cfg, B, T, budget)
    params = init_params(cfg, seed=0)
    ids, targets = make_batch(cfg, B, T, "cpu", 0)
    with Tracker(physical=False) as tracker:
        loss_and_grads(params, cfg, ids, targets, f"budget:{budget}", tracker=tracker)
    assert tracker.peak_logical == plan.peak_bytes <= budget
    assert tracker.flops["recompute"] == plan.recompute_flops


def live_peak(attention, T, policy="none"):
    cfg = Config.from_preset("tiny", layers=1, attention=attention, attention_tile=16, max_seq=256)
    params = init_params(cfg, seed=0)
    ids, targets = make_batch(cfg, 1, T, "cpu", 0)
    with Tracker(flops=False) as tracker:
        loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
    return tracker.peak_physical


@pytest.mark.parametrize("policy", ["none", "full"])
def test_live_memory_linear_in_T_without_materialised_probabilities(policy):
    for attention in ("tiled", "fused"):
        assert live_peak(attention, 192, policy) / live_peak(attention, 96, policy) < 2.2, attention
    assert live_peak("eager", 192, policy) / live_peak("eager", 96, policy) > 2.5  # the T^2 term shows

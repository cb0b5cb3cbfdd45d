"""What must also hold on a GPU (skipped without CUDA): the attention kinds, the chunked head, the
deterministic embedding gradient and the policies' exactness, on CUDA kernels."""
import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.inventory import predicted_peak_bytes
from picockpt.measure import make_batch
from picockpt.routing import route_by_token
from picockpt.parallel import run_ranks
from picockpt.reproduce import rank_device
from picockpt.ops import embedding_backward
from picockpt.tracker import Tracker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
POLICIES = ("none", "full", "every:2", "selective", "cheap")


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def setup(**fields):
    cfg = Config.from_preset("tiny", layers=4, max_seq=256, **fields)
    params = init_params(cfg, seed=0, device="cuda")
    ids, targets = make_batch(cfg, 2, 96, "cuda", 0)
    return cfg, params, ids, targets


@pytest.mark.parametrize("attention,dtype", [("eager", "bf16"), ("eager", "fp32"), ("tiled", "fp32")])
def test_every_policy_bitwise_equal_to_none_on_cuda(attention, dtype):
    cfg, params, ids, targets = setup(attention=attention, attention_tile=32, dtype=dtype, dropout=0.1)
    torch.manual_seed(0)
    base = loss_and_grads(params, cfg, ids, targets, "none")
    for policy in POLICIES:
        torch.manual_seed(0)
        with Tracker("cuda", flops=False) as tracker:
            loss, grads = loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
        assert torch.equal(loss, base[0]), policy
        assert [k for k in grads if not torch.equal(grads[k], base[1][k])] == [], policy
        assert tracker.peak_logical == predicted_peak_bytes(cfg, 2, 96, policy), policy


def test_fused_policies_give_none_s_gradients_under_deterministic_algorithms():
    """The loss comes from the forward, the same under every policy by construction: gradients are what a
    broken recomputation changes. Under torch.use_deterministic_algorithms the flash backward is asked for
    its deterministic path; if two `none` runs are then bitwise equal, every policy must be too. If they
    are not (the kernel's dq still sums with atomics), each policy must lie within FUSED_GRAD_TOLERANCE of
    `none`, relative in the max norm: atomics reorder fp32 sums (~1e-3 at most here), a wrong recompute
    moves a gradient by O(1)."""
    cfg, params, ids, targets = setup(attention="fused", dtype="bf16")
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn_only: cuBLAS would need CUBLAS_WORKSPACE_CONFIG
    try:
        _, first = loss_and_grads(params, cfg, ids, targets, "none")
        _, again = loss_and_grads(params, cfg, ids, targets, "none")
        deterministic = all(torch.equal(first[k], again[k]) for k in first)
        for policy in POLICIES:
            _, grads = loss_and_grads(params, cfg, ids, targets, policy)
            if deterministic:
                assert [k for k in grads if not torch.equal(grads[k], first[k])] == [], policy
            else:
                worst = max(rel(grads[k], first[k]) for k in grads)
                assert worst < FUSED_GRAD_TOLERANCE, (policy, worst)
    finally:
        torch.use_deterministic_algorithms(False)


FUSED_GRAD_TOLERANCE = 1e-2


def test_route_by_token_builds_its_routers_on_the_parameters_device():
    cfg = Config.from_preset("tiny", experts=4, experts_per_token=2, layers=2)
    params = route_by_token(init_params(cfg, seed=0, device="cuda"), cfg)
    assert {str(t.device) for t in params.values()} == {"cuda:0"}
    ids, targets = make_batch(cfg, 2, 32, "cuda", 0)
    loss, _ = loss_and_grads(params, cfg, ids, targets, "full")
    assert torch.isfinite(loss)


def test_phase_times_use_events_not_a_synchronize_per_phase_switch(monkeypatch):
    """Tiled attention switches to "recompute" and back for every tile pair: hundreds of switches a step.
    Times come from CUDA events, synchronised once: at most two synchronize calls (start and end)."""
    cfg, params, ids, targets = setup(attention="tiled", attention_tile=16, dtype="fp32")
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    with Tracker("cuda", flops=False, physical=False, times=True) as tracker:
        loss_and_grads(params, cfg, ids, targets, "full", tracker=tracker)
    assert len(calls) <= 2, len(calls)
    assert tracker.seconds["forward"] > 0 and tracker.seconds["backward"] > 0 and tracker.seconds["recompute"] > 0


def test_tiled_dropout_reads_its_seed_once_per_call_not_per_tile_pair():
    """torch.cuda.set_sync_debug_mode('warn') warns at each host sync: a step of 4 layers with 21 tile pairs
    each (T=96, tile 16) syncs a few times per layer (the seed, once per forward and backward), not per pair."""
    cfg, params, ids, targets = setup(attention="tiled", attention_tile=16, dtype="fp32", dropout=0.1)
    import warnings
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss_and_grads(params, cfg, ids, targets, "none")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 4 * cfg.layers, len(syncs)  # the batch check's one, two per layer, and the loss's


def test_rank_groups_are_bound_to_their_gpu():
    """init_process_group(device_id=...): the NCCL group knows its device (no guess at each barrier)."""
    assert run_ranks(bound_device, 1, device="cuda") == ["cuda:0"]


def bound_device(comm):
    import torch.distributed as dist
    return str(dist.distributed_c10d._get_default_group().bound_device_id)


def test_reproduce_plans_the_lessons_multi_rank_parts_from_the_gpu_count():
    device, note = rank_device("cuda", torch.cuda.device_count() + 1)
    assert device.type == "cpu" and "runs on the CPU over gloo" in note
    assert rank_device("cuda", torch.cuda.device_count()) == (torch.device("cuda"), None)


def test_fused_flash_kernel_matches_eager_in_bf16():
    """The CUDA flash kernel's backward may add in any order (atomics): losses are compared bitwise
    across policies, gradients against eager's within bf16's precision."""
    cfg, params, ids, targets = setup(attention="fused", dtype="bf16")
    eager = loss_and_grads(params, cfg.replace(attention="eager"), ids, targets)
    fused = loss_and_grads(params, cfg, ids, targets)
    assert rel(fused[0], eager[0]) < 1e-2
    for name in eager[1]:
        assert rel(fused[1][name], eager[1][name]) < 5e-2, name
    for policy in POLICIES:
        assert torch.equal(loss_and_grads(params, cfg, ids, targets, policy)[0], fused[0]), policy
    with pytest.raises(ValueError, match="flash kernel, which takes bf16 or fp16"):
        loss_and_grads(params, cfg.replace(dtype="fp32"), ids, targets)


def test_chunked_head_matches_whole_logits_on_cuda():
    cfg, params, ids, targets = setup(dtype="fp32")
    whole = loss_and_grads(params, cfg, ids, targets)
    chunked = loss_and_grads(params, cfg.replace(loss_chunk=50), ids, targets)
    assert rel(chunked[0], whole[0]) < 1e-5
    for name in whole[1]:
        assert rel(chunked[1][name], whole[1][name]) < 1e-5, name


def test_embedding_gradient_is_deterministic_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 7, (8, 512), device="cuda", generator=g)  # many repeats of few ids: atomics would race
    dy = torch.randn(8, 512, 64, device="cuda", generator=g).to(torch.bfloat16)
    first = embedding_backward(dy, ids, (7, 64))
    assert first.dtype == torch.float32
    assert all(torch.equal(first, embedding_backward(dy, ids, (7, 64))) for _ in range(5))

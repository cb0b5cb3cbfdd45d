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


# ---- offloading to host memory (picockpt/offload.py): pinned buffers, the side stream, its events ----
OFFLOAD_POLICIES = ("offload", "none+offload", "every:2+offload", "offload:mlp.gate,mlp.up", "cheap+offload")


@pytest.mark.parametrize("attention", ["eager", "tiled", "fused"])
def test_offload_policies_bitwise_none_on_cuda_with_exact_device_and_host_bytes(attention):
    cfg, params, ids, targets = setup(attention=attention, attention_tile=32, dtype="bf16")
    base = loss_and_grads(params, cfg, ids, targets, "none")
    from picockpt.inventory import predicted_host_bytes
    for policy in OFFLOAD_POLICIES:
        with Tracker("cuda", flops=False) as tracker:
            loss, grads = loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
        assert torch.equal(loss, base[0]), policy
        assert [k for k in grads if not torch.equal(grads[k], base[1][k])] == [], policy
        assert tracker.peak_logical == predicted_peak_bytes(cfg, 2, 96, policy), policy
        assert tracker.peak_host == predicted_host_bytes(cfg, 2, 96, policy) > 0, policy
        assert tracker.exposed_copy_seconds is not None and tracker.exposed_copy_seconds >= 0, policy


def _tier_with_one_tensor():
    from picockpt.offload import HostTier
    from picockpt.store import ActivationStore
    store = ActivationStore(host=HostTier("cuda"))
    store.host.rule = lambda layer, name: True
    tensor = torch.arange(1 << 22, dtype=torch.float32, device="cuda")  # 16 MiB
    store.put(0, "x", tensor)
    return store, tensor.clone()


def test_offloaded_tensors_live_in_pinned_host_buffers():
    store, _ = _tier_with_one_tensor()
    copy = store.host_tensors[(0, "x")]
    assert copy.host.device.type == "cpu" and copy.host.is_pinned()


def test_prefetch_runs_on_the_side_stream_while_the_compute_stream_is_busy():
    """A prefetch issued after a long kernel on the compute stream must finish before that kernel does: if the
    copy ran on the compute stream, it would wait behind it, and the compute stream would be idle by then."""
    store, _ = _tier_with_one_tensor()
    torch.cuda.synchronize()
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time on the compute stream
    store.prefetch(0)
    arrival = store.arriving[(0, "x")]
    assert store.host.stream != compute
    arrival.done.synchronize()  # the copy has landed ...
    assert not compute.query(), "the prefetch waited for the compute stream: it ran on it, or was ordered behind it"
    torch.cuda.synchronize()


def test_a_prefetched_tensor_is_never_read_before_its_copy_event():
    """The side stream is held up (a long kernel queued on it before the prefetch), and its buffer is filled with
    NaN first: a read that did not wait for the copy's event would see NaN, not the offloaded values."""
    store, expected = _tier_with_one_tensor()
    side = store.host.stream
    with torch.cuda.stream(side):
        junk = torch.full_like(expected, float("nan"))  # the block the prefetch's buffer is likely to reuse
        del junk
        torch.cuda._sleep(1_000_000_000)
    store.prefetch(0)
    value = store.pop(0, "x") * 1  # a kernel on the compute stream, reading the prefetched tensor
    assert torch.equal(value, expected)
    assert store.host.exposed_seconds() > 0  # it did wait: the copy's time was exposed


def test_the_offload_copy_waits_for_the_tensor_it_copies():
    """The tensor is written by a kernel queued after a long one on the compute stream; the offload copy must
    wait for it (an event), or the host copy would hold the old values."""
    from picockpt.offload import HostTier
    from picockpt.store import ActivationStore
    store = ActivationStore(host=HostTier("cuda"))
    store.host.rule = lambda layer, name: True
    tensor = torch.zeros(1 << 22, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    tensor.fill_(7.0)  # queued behind the sleep
    store.put(0, "x", tensor)
    store.host_tensors[(0, "x")].done.synchronize()
    assert torch.equal(store.host_tensors[(0, "x")].host, torch.full((1 << 22,), 7.0))


def test_context_parallel_blocks_on_the_cuda_flash_kernel():
    """Context parallelism's blocks on the CUDA flash kernel (bf16): each query chunk against its own chunk
    (causal) and a whole block of earlier keys of another length (causal=False: at zigzag cp = 4 the last
    chunk reads six earlier chunks at once), merged by log-sum-exp, equals causal attention over the whole
    sequence; so do the gradients, block by block with the merged output and lse."""
    from picockpt.ops.attention_fused import fused_attention_backward, fused_attention_forward
    from picockpt.parallel.context_parallel.cp_attention import gathered_attention_backward, gathered_attention_forward
    from picockpt.parallel.context_parallel.cp_layout import SequenceLayout
    cfg = Config.from_preset("tiny", dtype="bf16", attention="fused")
    B, H, KV, T, hd = 2, cfg.heads, cfg.kv_heads, 64, cfg.head_dim
    q, dout = (torch.randn(B, H, T, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kv = torch.randn(2, B, KV, T, hd, device="cuda", dtype=torch.bfloat16)
    out, lse = fused_attention_forward(q, kv[0], kv[1])  # the single process's
    dq, dk, dv = fused_attention_backward(dout, q, kv[0], kv[1], out, lse)
    split = SequenceLayout("zigzag", 4, T)
    kv_all = torch.cat([split.rows(kv, r, dim=3) for r in range(4)], dim=3)  # (2, B, KV, T, hd) in rank order
    dkv_all = torch.zeros(kv_all.shape, dtype=torch.float32, device="cuda")
    for r in range(4):
        mine = split.positions(r, "cuda")
        q_r = split.rows(q, r, dim=2)
        out_r, lse_r = gathered_attention_forward(q_r, kv_all, cfg, split, r)
        assert rel(out_r, out[:, :, mine]) < 2e-2 and rel(lse_r, lse[:, :, mine]) < 1e-3, r
        dq_r, dkv_r = gathered_attention_backward(split.rows(dout, r, dim=2), q_r, out_r, lse_r, kv_all, cfg, split, r,
                                                  torch.no_grad)
        assert rel(dq_r, dq[:, :, mine]) < 5e-2, r
        dkv_all += dkv_r  # the reduce-scatter's sum
    expected = torch.cat([split.rows(torch.stack((dk, dv)), r, dim=3) for r in range(4)], dim=3)
    assert rel(dkv_all, expected) < 5e-2

"""What must also hold on a GPU (skipped without CUDA): the attention kinds, the chunked head, the
deterministic embedding gradient and the policies' exactness, on CUDA kernels; the flash kernel's refusals
and its grouped-query call (k and v at their KV heads)."""
import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.step_forms import predicted_peak_bytes
from picockpt.measurement.measure import make_batch
from picockpt.ops.attention_fused import fused_attention_backward, fused_attention_forward
from picockpt.model.routing import route_by_token
from picockpt.parallel import run_ranks
from picockpt.teaching.reproduce import rank_device
from picockpt.ops import embedding_backward
from picockpt.measurement.tracker import Tracker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
POLICIES = ("none", "full", "every:2", "selective", "cheap")


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def setup(seq=96, **fields):
    cfg = Config.from_preset("tiny", layers=4, max_seq=max(256, seq), **fields)
    params = init_params(cfg, seed=0, device="cuda")
    ids, targets = make_batch(cfg, 2, seq, "cuda", 0)
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


LONG = 512  # tokens: several of the flash backward's key blocks (128 rows or more each), whose partial sums of dq
#             meet by atomic adds unless the deterministic path is asked for (at T <= 128, one block: nothing races)
FUSED_GRAD_TOLERANCE = 2 ** -7  # one bf16 step of a gradient's largest entry: bf16 keeps 8 significant bits, so
#   its step is 2^-8 to 2^-7 of a value. Atomics reorder fp32 sums (differences ~2^-24 of them), which move a
#   bf16-rounded value by one step where they cross a rounding boundary; a wrong recomputation moves a gradient by O(1)


def test_fused_policies_bitwise_equal_to_none_under_deterministic_algorithms(monkeypatch):
    """torch.use_deterministic_algorithms(True) with warn_only=False: the flash backward takes its deterministic
    path (with warn_only=True it only warns, and keeps its atomics); cuBLAS then asks for CUBLAS_WORKSPACE_CONFIG.
    Compared bitwise at T=512: two `none` runs, then every policy's loss and gradients against `none`'s (the
    gradients are what a broken recomputation changes)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cfg, params, ids, targets = setup(seq=LONG, attention="fused", dtype="bf16")
    torch.use_deterministic_algorithms(True)
    try:
        loss, first = loss_and_grads(params, cfg, ids, targets, "none")
        _, again = loss_and_grads(params, cfg, ids, targets, "none")
        assert [k for k in first if not torch.equal(first[k], again[k])] == []  # the deterministic path was taken
        for policy in POLICIES:
            policy_loss, grads = loss_and_grads(params, cfg, ids, targets, policy)
            assert torch.equal(policy_loss, loss), policy
            assert [k for k in grads if not torch.equal(grads[k], first[k])] == [], policy
    finally:
        torch.use_deterministic_algorithms(False)


def test_fused_policies_within_one_bf16_step_of_none_with_the_default_atomics():
    """Without deterministic algorithms the flash backward sums dq over T=512's key blocks by atomics, in any
    order: a second `none` run and every policy lie within FUSED_GRAD_TOLERANCE of the first `none` run, each
    gradient relative in the max norm."""
    cfg, params, ids, targets = setup(seq=LONG, attention="fused", dtype="bf16")
    _, first = loss_and_grads(params, cfg, ids, targets, "none")
    for policy in ("none",) + POLICIES:
        _, grads = loss_and_grads(params, cfg, ids, targets, policy)
        worst = max(rel(grads[k], first[k]) for k in grads)
        assert worst < FUSED_GRAD_TOLERANCE, (policy, worst)


def test_fused_refuses_a_head_dim_the_flash_kernel_cannot_take():
    """hidden=48 over 4 heads: head_dim 12, which the CUDA flash kernel cannot take (multiples of 8): refused by
    name, a ValueError, not the kernel's RuntimeError."""
    cfg, params, ids, targets = setup(attention="fused", dtype="bf16", hidden=48)
    with pytest.raises(ValueError, match=r"not head_dim=12 \(hidden/heads\): choose hidden and heads for head_dim "
                                         r"8 or 16"):
        loss_and_grads(params, cfg, ids, targets)


def test_the_flash_kernel_reads_k_and_v_at_their_kv_heads():
    """32 query heads over 4 KV heads: the forward allocates its output and lse, not k and v expanded to 32 heads
    (2 x 16 MiB, what repeat_interleave would add); its output and lse equal the kernel's on k, v expanded by hand,
    bitwise (the same tiles, read from the group's KV head), and the gradients within one bf16 step (dq's
    atomics; dk, dv summed over each group inside the kernel)."""
    B, H, KV, T, hd = 1, 32, 4, 4096, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(B, H, T, hd, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, KV, T, hd, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out, lse = fused_attention_forward(q, k, v)  # (B, H, T, hd), (B, H, T)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    expanded = 2 * B * H * T * hd * 2  # bytes of k and v at H heads, bf16
    assert extra < out.nbytes + lse.nbytes + expanded // 4, (extra, out.nbytes + lse.nbytes, expanded)
    k_all, v_all = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))  # (B, H, T, hd) each
    out_all, lse_all = fused_attention_forward(q, k_all, v_all)
    assert torch.equal(out, out_all) and torch.equal(lse, lse_all)
    dq, dk, dv = fused_attention_backward(dout, q, k, v, out, lse)
    dq_all, dk_all, dv_all = fused_attention_backward(dout, q, k_all, v_all, out_all, lse_all)
    assert dk.shape == dv.shape == (B, KV, T, hd)
    assert rel(dq, dq_all) < FUSED_GRAD_TOLERANCE
    for got, want in ((dk, dk_all), (dv, dv_all)):
        assert rel(got, want.float().view(B, KV, H // KV, T, hd).sum(2)) < FUSED_GRAD_TOLERANCE


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


# ---- offloading to host memory (picockpt/recompute/offload.py): pinned buffers, the side stream, its events ----
OFFLOAD_POLICIES = ("offload", "none+offload", "every:2+offload", "offload:mlp.gate,mlp.up", "cheap+offload")


@pytest.mark.parametrize("attention", ["eager", "tiled", "fused"])
def test_offload_policies_bitwise_none_on_cuda_with_exact_device_and_host_bytes(attention):
    cfg, params, ids, targets = setup(attention=attention, attention_tile=32, dtype="bf16")
    base = loss_and_grads(params, cfg, ids, targets, "none")
    from picockpt.planning.step_forms import predicted_host_bytes
    for policy in OFFLOAD_POLICIES:
        with Tracker("cuda", flops=False) as tracker:
            loss, grads = loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
        assert torch.equal(loss, base[0]), policy
        assert [k for k in grads if not torch.equal(grads[k], base[1][k])] == [], policy
        assert tracker.peak_logical == predicted_peak_bytes(cfg, 2, 96, policy), policy
        assert tracker.peak_host == predicted_host_bytes(cfg, 2, 96, policy) > 0, policy
        assert tracker.exposed_copy_seconds is not None and tracker.exposed_copy_seconds >= 0, policy


def _tier_with_one_tensor():
    from picockpt.recompute.offload import HostTier
    from picockpt.recompute.store import ActivationStore
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
    from picockpt.recompute.offload import HostTier
    from picockpt.recompute.store import ActivationStore
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


# ---- time and device memory measured as the GPU runs (events, not host clocks; few allocator reads) ---------------

def test_timeline_spans_hold_gpu_time_and_never_wait_for_the_gpu_at_an_edge(monkeypatch):
    """A span around ~1 s of GPU work returns to the host at once (no synchronize at its edges) and still holds
    that GPU time, read once in finish()."""
    import time
    from picockpt.parallel.timeline import Timeline
    timeline = Timeline("cuda")
    syncs = []
    real_sync, real_stream_sync = torch.cuda.synchronize, torch.cuda.Stream.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (syncs.append(1), real_sync(*a, **k))[1])
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda s: (syncs.append(1), real_stream_sync(s))[1])
    timeline.begin()
    host = time.monotonic()
    for _ in range(20):
        with timeline.span("forward", 0):
            torch.cuda._sleep(50_000_000)
    host = time.monotonic() - host
    assert syncs == []
    timeline.finish()
    assert len(syncs) == 1
    assert timeline.totals()["forward"] > 5 * host, (timeline.totals()["forward"], host)


def test_device_memory_is_read_at_phase_changes_not_per_tile_pair_on_cuda(monkeypatch):
    cfg, params, ids, targets = setup(attention="tiled", attention_tile=16, dtype="fp32")  # 21 tile pairs a layer
    reads = []
    real = torch.cuda.max_memory_allocated
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: (reads.append(1), real(*a, **k))[1])
    with Tracker("cuda", flops=False) as tracker:
        loss_and_grads(params, cfg, ids, targets, "full", tracker=tracker)
    assert len(reads) == 4 + 2 * cfg.layers + 1  # into and out of forward, backward, each recompute; the end
    assert tracker.peaks["recompute"]["cuda"] > 0 and tracker.peak_cuda >= tracker.peaks["backward"]["cuda"] > 0


def test_free_cuda_memory_counts_the_caching_allocator_s_unused_blocks():
    from picockpt.device import available_bytes
    block = torch.empty(1 << 26, dtype=torch.uint8, device="cuda")  # 64 MiB, then back to the allocator's cache
    del block
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert cached >= 1 << 26
    have, where = available_bytes("cuda")
    assert have == torch.cuda.mem_get_info()[0] + cached and where == "free memory on cuda (with the allocator's cache)"


def test_a_reused_pinned_buffer_is_not_written_before_its_last_read():
    """Tier a's prefetch reads its host buffer on a stream held up ~1 s, and gives the buffer back; tier b (another
    step's, its own stream) offloads into that same buffer at once: it must wait for a's read (an event), or a
    would bring back b's values."""
    from picockpt.recompute.offload import HostTier
    from picockpt.recompute.store import ActivationStore
    a, b = ActivationStore(host=HostTier("cuda")), ActivationStore(host=HostTier("cuda"))
    a.host.rule = b.host.rule = lambda layer, name: True
    x = torch.arange(1 << 22, dtype=torch.float32, device="cuda")  # 16 MiB
    a.put(0, "x", x)
    torch.cuda.synchronize()
    buffer = a.host_tensors[(0, "x")].host.data_ptr()
    with torch.cuda.stream(a.host.stream):
        torch.cuda._sleep(1_000_000_000)
    a.prefetch(0)  # queued behind the sleep; the buffer is back in the pool already
    b.put(0, "y", torch.full((1 << 22,), -1.0, device="cuda"))
    assert b.host_tensors[(0, "y")].host.data_ptr() == buffer  # the same buffer, reused
    assert torch.equal(a.pop(0, "x"), x)
    b.host_tensors[(0, "y")].done.synchronize()
    assert torch.equal(b.host_tensors[(0, "y")].host, torch.full((1 << 22,), -1.0))


def test_a_bucket_s_all_reduce_is_timed_on_the_gpu_not_when_nccl_queued_it():
    """One NCCL rank: the compute stream is ~1 s busy when the bucket's all-reduce is launched; NCCL returns at
    once, so the host's clock would say it was launched (and done) at about 0; the events say after the work."""
    start, end = run_ranks(bucket_times, 1, device="cuda")[0]
    assert 0.2 < start <= end, (start, end)


def bucket_times(comm):
    import types
    from picockpt.parallel.comm import CommLog
    from picockpt.parallel.data_parallel.dp_comm import GradientBuckets
    from picockpt.parallel.timeline import Timeline
    timeline = Timeline(comm.device)
    group = types.SimpleNamespace(group=None, phase="backward", log=CommLog())
    buckets = GradientBuckets({0: ["w"]}, {"w": (1 << 20,)}, torch.float32, comm.device, group, True, timeline)
    timeline.begin()
    torch.cuda._sleep(1_000_000_000)
    buckets.ready(0)
    buckets.finish()
    timeline.finish()
    (_, _, start, end), = buckets.events
    return start, end


def test_a_measured_profile_and_rates_on_cuda():
    """plan --cost measured on a GPU: every op of the table timed by CUDA events (positive, a spread that holds
    its median), the measured plan fitting its budget; the GPU's measured rates below the H100/H200 datasheet's."""
    from picockpt.planning.cost import HARDWARE, measured_rates, plan_priced, price_chain
    from picockpt.planning.op_times import measure_op_seconds
    from picockpt.planning.planner import least_budget, model_chain
    cfg = Config.from_preset("small", attention="fused", dtype="bf16")
    profile = measure_op_seconds(cfg, 4, 256, "cuda", repeats=3)
    assert profile.seconds and all(0 < lo <= profile.seconds[op] <= hi for op, (lo, hi) in profile.spread.items())
    chain = model_chain(cfg, 4, 256)
    budget = (least_budget(chain) + sum(max(a for _, a, _ in s.variants) for s in chain)) // 2
    plan = plan_priced(chain, price_chain(chain, cfg, 4, 256, profile.seconds), budget)
    assert plan.peak_bytes <= budget and plan.recompute_seconds >= 0
    rates = measured_rates("cuda", "bfloat16", repeats=3)
    assert 0 < rates.matmul <= 1.05 * HARDWARE["h200"].matmul and 0 < rates.memory <= 1.05 * HARDWARE["h200"].memory

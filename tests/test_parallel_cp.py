"""Context parallelism with recomputation on gloo, against the single-process engine: the loss and gradients
(fp64 rel <= 1e-10, fp32 rel <= 1e-5) for MHA and GQA, zigzag and contiguous layouts, ring and all-gather
(with and without the kept K/V), tiled and fused attention, and cp = 2 beside tp = 2, dp = 2 and pp = 2; every
policy bitwise equal to `none` within a layout and variant; every rank's stored peak, communication bytes per
phase, gradient reduction and FLOPs equal to their closed forms (picockpt/parallel/context_parallel/
cp_forms.py, through picockpt/parallel/report_forms.py); zigzag's attention balanced, contiguous's not.

One launch per world size (2 ranks: cp = 2, the whole matrix; 4 ranks: cp = 4 and cp = 2 with tp, dp or pp),
every job in turn.
Relative error of a gradient: max |g - g_single| / max |g_single| over the tensor.
"""
import contextlib
import json
import multiprocessing

import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.measurement.measure import make_batch
from picockpt.parallel import Layout, ParallelJob, run_jobs
from picockpt.ops.attention_tiled import tiled_attention_backward, tiled_attention_forward
from picockpt.parallel.context_parallel.cp_attention import gathered_attention_backward, gathered_attention_forward
from picockpt.parallel.context_parallel.cp_forms import kept_kv_bytes, rank_attention_flops
from picockpt.parallel.context_parallel.cp_layout import SequenceLayout
from picockpt.parallel.context_parallel.cp_check import check_context_parallel
from picockpt.parallel.job import checked_job

from processes import no_process_left_behind  # noqa: F401 (a fixture)

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
BATCH, SEQ = 2, 16
BASE = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=40, max_seq=64)
MODELS = {  # name -> Config fields
    "gqa fp64 tiled": dict(dtype="float64", attention="tiled", attention_tile=4),  # contiguous: 2 tiles a chunk
    "mha fp64 fused": dict(dtype="float64", attention="fused", kv_heads=4),
    "gqa fp32 fused chunked tied": dict(dtype="float32", attention="fused", loss_chunk=5, tie_embeddings=True),
    "mha fp32 tiled ignored": dict(dtype="float32", attention="tiled", kv_heads=4),
}
VARIANTS = [("ring", False), ("allgather", False), ("allgather", True)]
POLICIES = ["every:2", "selective", "cheap", "budget:60000"]  # beside none and full, on the first model's ring
# budget: between that model's least feasible store (35,584 B per rank at cp = 2) and none's (106,112 B)
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}

pytestmark = pytest.mark.usefixtures("no_process_left_behind")


def model(name):
    cfg = Config(**{**BASE, **MODELS[name]})
    params = init_params(cfg, seed=1)
    input_ids, targets = make_batch(cfg, BATCH, SEQ, "cpu", seed=1)
    if "ignored" in name:  # unequal shares: the first half of sequence 0 and the end of sequence 1 count nothing
        targets = targets.clone()
        targets[0, :8] = -100
        targets[1, 13:] = -100
    return cfg, params, input_ids, targets


def steps_cp2():
    """The first model: every policy on the ring, none and full on the kept all-gather, full on the other;
    the others under full: both layouts (the fp32 models one each) x every variant."""
    out = []
    layouts = {"gqa fp32 fused chunked tied": ("zigzag",), "mha fp32 tiled ignored": ("contiguous",)}
    for first, name in enumerate(MODELS):
        cfg, params, ids, targets = model(name)
        for layout in layouts.get(name, ("zigzag", "contiguous")):
            for comm, keep in VARIANTS:
                if first:
                    policies = ["full"]
                else:
                    policies = ["none", "full"] + POLICIES if comm == "ring" else ["none", "full"] if keep else ["full"]
                for policy in policies:
                    out.append((name, job(name, policy, layout, comm, keep)))
    return out


def job(name, policy, layout="zigzag", comm="ring", keep=False, cp=2, **layout_sizes):
    cfg, params, ids, targets = model(name)
    return ParallelJob(params, cfg, ids, targets, policy,
                       Layout(cp=cp, cp_layout=layout, cp_comm=comm, cp_keep_kv=keep, **layout_sizes))


def steps_4_ranks():
    """cp = 4 on its own, then cp = 2 beside tp = 2 (the tensor-parallel layer on a rank's T/cp tokens, with and
    without sp), beside dp = 2 (the gradients summed over dp x cp ranks) and beside pp = 2 (2 micro-batches;
    selective and full: a stage of one layer, where every:C has no C but full's)."""
    out = [(name, job(name, policy, layout, comm, keep, cp=4))
           for name, layout, comm, keep, policy in [("gqa fp64 tiled", "zigzag", "ring", False, "none"),
                                                    ("gqa fp64 tiled", "zigzag", "ring", False, "full"),
                                                    ("gqa fp64 tiled", "contiguous", "allgather", True, "full"),
                                                    ("gqa fp32 fused chunked tied", "contiguous", "ring", False,
                                                     "full")]]
    out += [("gqa fp64 tiled", job("gqa fp64 tiled", "none", tp=2)),
            ("gqa fp64 tiled", job("gqa fp64 tiled", "full", tp=2)),
            ("gqa fp32 fused chunked tied", job("gqa fp32 fused chunked tied", "every:2", "contiguous", "allgather",
                                                tp=2, sp=False)),
            ("gqa fp64 tiled", job("gqa fp64 tiled", "full", dp=2)),
            ("mha fp32 tiled ignored", job("mha fp32 tiled ignored", "none", "contiguous", "allgather", True, dp=2)),
            ("gqa fp64 tiled", job("gqa fp64 tiled", "selective", pp=2, microbatches=2)),
            ("mha fp64 fused", job("mha fp64 fused", "full", "contiguous", "allgather", pp=2, microbatches=2))]
    return out


def cp_of(step):
    return (step.layout.cp, step.layout.dp, step.layout.pp, step.layout.tp)


@pytest.fixture(scope="module")
def runs():
    """[(layout sizes, model name, job, (loss, grads, per-rank reports))] for both world sizes, and the single
    process's step of each model."""
    single = {}
    for name in MODELS:
        cfg, params, ids, targets = model(name)
        single[name] = loss_and_grads(params, cfg, ids, targets, "none")
    out = []
    for world, steps in ((2, steps_cp2()), (4, steps_4_ranks())):
        results = run_jobs([step for _, step in steps], world, start_method=START, timeout_s=120)
        out += [(cp_of(step), name, step, result) for (name, step), result in zip(steps, results)]
    return single, out


def relative(value, reference):
    return (value.double() - reference.double()).abs().max().item() / reference.double().abs().max().item()


def label(sizes, name, step):
    return (sizes, name, step.policy, step.layout.cp_layout, step.layout.cp_comm, step.layout.cp_keep_kv)


@pytest.mark.ranks
def test_loss_and_gradients_equal_the_single_process(runs):
    single, out = runs
    assert {sizes for sizes, *_ in out} == {(2, 1, 1, 1), (4, 1, 1, 1), (2, 1, 1, 2), (2, 2, 1, 1), (2, 1, 2, 1)}
    for sizes, name, step, (loss, grads, _) in out:
        loss0, grads0 = single[name]
        tolerance, where = TOLERANCE[step.cfg.dtype], label(sizes, name, step)
        assert abs(loss.item() - loss0.item()) <= tolerance * abs(loss0.item()), where  # the ranks' shares added
        assert set(grads) == set(grads0), where
        for key in grads0:
            assert grads[key].dtype == grads0[key].dtype, (where, key)
            assert relative(grads[key], grads0[key]) <= tolerance, (where, key, relative(grads[key], grads0[key]))


@pytest.mark.ranks
def test_every_policy_is_bitwise_equal_to_none_within_a_layout(runs):
    _, out = runs
    none = {(sizes, name, step.layout.cp_layout, step.layout.cp_comm, step.layout.cp_keep_kv): result
            for sizes, name, step, result in out if step.policy == "none"}
    compared = 0
    for sizes, name, step, (loss, grads, _) in out:
        base = none.get((sizes, name, step.layout.cp_layout, step.layout.cp_comm, step.layout.cp_keep_kv))
        if base is None or step.policy == "none":
            continue
        compared += 1
        assert torch.equal(loss, base[0]), label(sizes, name, step)
        for key, grad in base[1].items():
            assert torch.equal(grads[key], grad), (label(sizes, name, step), key)
    assert compared == 2 * (1 + len(POLICIES) + 1) + 2  # cp = 2: both layouts; cp = 4 and tp x cp: full, ring


@pytest.mark.ranks
def test_every_rank_stores_moves_and_computes_its_closed_form(runs):
    _, out = runs
    for sizes, name, step, (_, _, reports) in out:
        assert [r["rank"] for r in reports] == list(range(step.world_size))
        assert sorted((r["stage"], r["dp_rank"], r["cp_rank"], r["tp_rank"]) for r in reports) == [
            (s, d, c, t) for s in range(step.layout.pp) for d in range(step.layout.dp) for c in range(step.layout.cp)
            for t in range(step.layout.tp)]
        for r in reports:
            where = label(sizes, name, step) + (r["rank"],)
            assert r["peak_activation_bytes"] == r["predicted_activation_bytes"], where
            assert r["microbatch_stored_bytes"] == r["predicted_microbatch_stored_bytes"], where
            assert r["layer_stored_bytes"] == r["predicted_layer_stored_bytes"], where
            assert r["comm_bytes"] == r["predicted_comm_bytes"], where
            assert r["dp_bytes"] == r["predicted_dp_bytes"] > 0, where  # the gradients summed over dp x cp ranks
            assert r["p2p_bytes"] == r["predicted_p2p_bytes"], where
            assert r["flops"] == r["predicted_flops"], where
            assert r["peak_live_bytes"] >= r["peak_activation_bytes"], where


@pytest.mark.ranks
def test_full_recomputation_repeats_the_forwards_communication(runs):
    _, out = runs
    by = {label(sizes, name, step): reports[0] for sizes, name, step, (_, _, reports) in out}
    for (sizes, name, policy, layout, comm, keep), r in by.items():
        if policy in ("none", "selective", "cheap"):  # nothing is recomputed across the ranks
            assert r["comm_bytes"]["recompute"] == 0, (sizes, name, policy, layout, comm, keep)
        if policy == "full" and sizes[3] > 1:  # beside tp: the layers' tp collectives again too, not the head's
            assert 0 < r["comm_bytes"]["recompute"] < r["comm_bytes"]["forward"], (sizes, name, layout, comm, keep)
        elif policy == "full":
            expected = 0 if keep else r["comm_bytes"]["forward"]  # the kept K/V: nothing gathered again
            assert r["comm_bytes"]["recompute"] == expected > 0 or keep, (sizes, name, layout, comm, keep)
            assert r["comm_bytes"]["forward"] > 0
    for sizes, name, step, (_, _, reports) in out:  # the kept K/V show in the stored peak: (cp-1)/cp per layer
        plain = by.get(label(sizes, name, step)[:5] + (False,))
        if step.layout.cp_keep_kv and plain is not None:
            r, cfg, cp = reports[0], step.cfg, step.layout.cp
            kept = kept_kv_bytes(cfg, BATCH, SEQ, cp, "allgather", True)
            assert kept == 2 * BATCH * cfg.kv_dim * SEQ * (cp - 1) // cp * torch.finfo(cfg.torch_dtype).bits // 8
            assert r["peak_activation_bytes"] - plain["peak_activation_bytes"] == cfg.layers * kept
            assert r["comm_bytes"]["backward"] < plain["comm_bytes"]["backward"]


@pytest.mark.ranks
def test_zigzag_balances_attention_and_contiguous_does_not(runs):
    _, out = runs
    for sizes, name, step, (_, _, reports) in out:  # the forward's FLOPs, whatever the policy
        if sizes[1:] != (1, 1, 1):
            continue  # beside tp, dp or pp: a rank's FLOPs are its slice's, replica's or stage's
        cp = step.layout.cp
        flops = [r["flops"]["forward"] for r in reports]
        attention = [r["predicted_attention_flops"] for r in reports]
        if step.layout.cp_layout == "zigzag":
            assert max(flops) <= 1.01 * min(flops) and len(set(attention)) == 1, label(sizes, name, step)
        else:  # rank r: its diagonal block and r chunks before it, each c x c
            c, cfg = SEQ // cp, step.cfg
            square = 2 * BATCH * cfg.heads * cfg.head_dim * c * c
            assert [a - attention[0] for a in attention] == [r * square for r in range(cp)], label(sizes, name, step)
            assert flops == sorted(flops) and flops[-1] > flops[0]


def test_a_budget_plans_with_the_ring_a_recomputed_layer_repeats():
    """Under cp a budget plans each rank with a recomputed layer's ring bytes as FLOPs of the same time
    (cp_forms.recompute_comm_flops). Dense layers under tiled or fused attention rebuild nothing that costs
    FLOPs, so the plan that recomputes the fewest FLOPs already recomputes the fewest layers: the ring never
    changes it. A layer whose rebuild costs FLOPs (a mixture of experts' projections, closed forms only: experts
    are refused under cp) shows the trade: fewer layers recomputed for more FLOPs, within the same budget."""
    from picockpt.parallel.context_parallel.cp_forms import recompute_comm_flops
    from picockpt.parallel.pipeline_parallel.pp_forms import ChunkForms
    from picockpt.planning.planner import least_budget

    def plans(cfg, n):
        ring = recompute_comm_flops(cfg, BATCH, 2 * n, 2)
        assert ring > 0
        none = ChunkForms(cfg, BATCH, n, "none", Layout(), 0)
        least = least_budget(none.chain)
        for i in range(24):
            budget = f"budget:{least + (none.peak_bytes - least) * i // 24}"
            yield (ChunkForms(cfg, BATCH, n, budget, Layout(), 0),
                   ChunkForms(cfg, BATCH, n, budget, Layout(), 0, layer_comm_flops=ring))

    def layers_recomputed(forms):
        return sum(last - first + 1 for first, last in forms.local_schedule.sweeps(len(forms.layers)))
    dense = Config(**{**BASE, **MODELS["gqa fp64 tiled"], "layers": 4})
    assert all(flops.local_schedule == ring.local_schedule for flops, ring in plans(dense, SEQ // 2))
    moe = dense.replace(experts=4, experts_per_token=2)
    traded = [(flops, ring) for flops, ring in plans(moe, SEQ // 2) if flops.local_schedule != ring.local_schedule]
    assert traded
    for flops, ring in traded:
        assert layers_recomputed(ring) < layers_recomputed(flops) and ring.recompute_flops > flops.recompute_flops
        assert ring.peak_bytes <= ring.policy.budget


@pytest.mark.parametrize("change, message", [
    (dict(seq=12, cp=4), "multiple of 8"),  # zigzag: 2 cp chunks
    (dict(seq=12, cp=4, layout="contiguous"), None),  # 4 chunks of 3: fine
    (dict(seq=10, cp=4, layout="contiguous"), "multiple of 4"),
    (dict(cfg=dict(attention="eager")), "use attention='tiled' or 'fused'"),
    (dict(cfg=dict(attention="tiled", dropout=0.1)), "dropout=0"),
    (dict(keep_kv=True), "cp_comm='allgather'"),
    (dict(cp_comm="alltoall"), "'ring'"),
    (dict(layout="striped"), "zigzag"),
    (dict(policy="offload"), "offloading is not planned"),
    (dict(cp=0), "cp=0"),
])
def test_bad_input_is_a_value_error_before_any_work(change, message):
    cfg = Config(**{**BASE, **MODELS["gqa fp64 tiled"], **change.pop("cfg", {})})
    args = {**dict(cfg=cfg, cp=2, seq=SEQ, layout="zigzag", cp_comm="ring", keep_kv=False, policy="none"), **change}
    if message is None:
        check_context_parallel(**args)
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_context_parallel(**args)


def test_more_ranks_than_processes_is_a_value_error(monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)  # as torchrun would start 2 processes
    cfg = Config(**{**BASE, **MODELS["gqa fp64 tiled"]})
    with pytest.raises(ValueError, match="cp=4: torchrun started 2 processes"):
        check_context_parallel(cfg, 4, SEQ)


def test_zigzag_attention_flops_are_equal_on_every_rank_at_llama_shapes():
    cfg = Config.from_preset("llama3-8b", attention="fused")
    for cp in (2, 4, 8, 16):
        counts = [rank_attention_flops(cfg, 1, 131072, cp, "zigzag", r) for r in range(cp)]
        assert len(set(counts)) == 1
        contiguous = [rank_attention_flops(cfg, 1, 131072, cp, "contiguous", r) for r in range(cp)]
        assert contiguous[-1] / (sum(contiguous) / cp) > 1.5 if cp > 2 else contiguous[1] > contiguous[0]


@pytest.mark.parametrize("attention", ["tiled", "fused"])
@pytest.mark.parametrize("layout, cp", [("zigzag", 1), ("zigzag", 2), ("zigzag", 4), ("contiguous", 4)])
def test_blocks_merged_by_their_log_sum_exp_are_causal_attention(attention, layout, cp):
    """Every rank's queries against every rank's K/V (the all-gather's blocks, in one process): the merged
    output, lse and gradients equal one causal attention over the whole sequence (fp64). Zigzag at cp = 4
    merges six earlier chunks into one whole block of 6c keys against c queries."""
    cfg = Config(**{**BASE, "dtype": "float64", "attention": attention, "attention_tile": 3})
    B, H, KV, T, hd = 2, cfg.heads, cfg.kv_heads, SEQ, cfg.head_dim
    generator = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(B, H, T, hd, dtype=torch.float64, generator=generator) for _ in range(2))
    kv = torch.randn(2, B, KV, T, hd, dtype=torch.float64, generator=generator)
    out, lse = tiled_attention_forward(q, kv[0], kv[1], torch.float64, 4, 4)  # the single process's
    dq, dk, dv = tiled_attention_backward(dout, q, kv[0], kv[1], out, lse, torch.float64, 4, 4)
    split = SequenceLayout(layout, cp, T)
    kv_all = torch.cat([split.rows(kv, r, dim=3) for r in range(cp)], dim=3)  # (2, B, KV, T, hd) in rank order
    dkv_all = torch.zeros_like(kv_all)
    for r in range(cp):
        mine = split.positions(r)
        q_r, do_r = split.rows(q, r, dim=2), split.rows(dout, r, dim=2)
        out_r, lse_r = gathered_attention_forward(q_r, kv_all, cfg, split, r)
        torch.testing.assert_close(out_r, out[:, :, mine], rtol=0, atol=1e-12)
        torch.testing.assert_close(lse_r, lse[:, :, mine], rtol=0, atol=1e-12)
        dq_r, dkv_r = gathered_attention_backward(do_r, q_r, out_r, lse_r, kv_all, cfg, split, r,
                                                  contextlib.nullcontext)
        torch.testing.assert_close(dq_r, dq[:, :, mine], rtol=0, atol=1e-12)
        dkv_all += dkv_r  # the reduce-scatter's sum
    expected = torch.cat([split.rows(torch.stack((dk, dv)), r, dim=3) for r in range(cp)], dim=3)
    torch.testing.assert_close(dkv_all, expected, rtol=0, atol=1e-12)


@pytest.mark.ranks
def test_the_api_and_the_command_run_context_parallelism(capsys):
    """parallel.loss_and_grads(..., cp=2) and `python -m picockpt parallel --cp 2 --json`: the single process's
    loss and gradients, every rank's stored peak and K/V bytes per phase equal to their closed forms, zigzag's
    equal attention FLOPs; a clear error for a layout not supported yet."""
    from picockpt import parallel
    from picockpt.cli import main
    cfg = Config(**{**BASE, "attention": "tiled", "attention_tile": 4})
    params = init_params(cfg, seed=0)
    input_ids, targets = make_batch(cfg, 2, SEQ, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"^cp=2 with ep=2 is not supported yet"):
        parallel.loss_and_grads(params, cfg, input_ids, targets, "full", Layout(ep=2, cp=2))
    with pytest.raises(ValueError, match=r"^cp_keep_kv=True with pp=2, microbatches=2 is not supported yet"):
        parallel.loss_and_grads(params, cfg, input_ids, targets, "full",
                                Layout(pp=2, cp=2, microbatches=2, cp_comm="allgather", cp_keep_kv=True))
    loss0, grads0 = loss_and_grads(params, cfg, input_ids, targets, "none")
    loss, grads, ranks = parallel.loss_and_grads(params, cfg, input_ids, targets, "full",
                                                 Layout(cp=2, cp_comm="allgather", cp_keep_kv=True), start_method=START)
    assert abs(loss.item() - loss0.item()) <= 1e-5 * abs(loss0.item())
    assert max(((grads[k] - grads0[k]).abs().max() / grads0[k].abs().max()).item() for k in grads0) <= 1e-5
    for r in ranks:
        assert r["peak_activation_bytes"] == r["predicted_activation_bytes"] and r["comm_bytes"]["recompute"] == 0
        assert r["comm_bytes"] == r["predicted_comm_bytes"] and r["flops"] == r["predicted_flops"]
    assert main(["parallel", "--cp", "2", "--attention", "tiled", "--policy", "full", "--preset", "tiny", "--batch",
                 "2", "--seq", "16", "--device", "cpu", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["cp"], row["cp_layout"], row["cp_comm"]) == (2, "zigzag", "ring")
    layout = ("tp", "sp", "pp", "microbatches", "schedule", "dp", "ep", "zero", "prefetch")  # every layout's keys
    assert {key: row[key] for key in layout} == dict(tp=1, sp=False, pp=1, microbatches=1, schedule="1f1b", dp=1, ep=1,
                                                     zero=0, prefetch=True)
    assert row["grad_max_rel_diff_vs_single"] <= 1e-5
    first, second = row["ranks"]
    assert first["predicted_attention_flops"] == second["predicted_attention_flops"]  # zigzag: balanced
    for r in row["ranks"]:
        assert r["comm_bytes"] == r["predicted_comm_bytes"]
        assert r["comm_bytes"]["recompute"] == r["comm_bytes"]["forward"]


def test_cp_beside_another_dimension_under_torchrun_is_checked_as_the_whole_layout(monkeypatch):
    """Under torchrun the rank count is the layout's product: cp=2 with tp=2 is 4 processes, not cp's 2 (the check
    of cp alone, check_context_parallel's, is for cp alone)."""
    for name, value in dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)  # as torchrun would start 4 processes
    cfg = Config(**{**BASE, **MODELS["gqa fp64 tiled"]})
    params = init_params(cfg, seed=0)
    input_ids, targets = make_batch(cfg, 2, SEQ, "cpu", seed=0)
    job = ParallelJob(params, cfg, input_ids, targets, "full", Layout(cp=2, tp=2))
    assert checked_job(job, "cpu", None).layout.world_size == 4
    with pytest.raises(ValueError, match=r"^cp=2: torchrun started 4 processes, one per rank; pass cp=4"):
        checked_job(ParallelJob(params, cfg, input_ids, targets, "full", Layout(cp=2)), "cpu", None)

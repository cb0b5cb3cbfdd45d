"""Expert parallelism from the outside: loss_and_grads(..., ep=) and its clear errors, a recomputation that
keeps its routing when the router would now choose otherwise, and `python -m picockpt parallel --ep`."""
import json
import multiprocessing
import re

import pytest
import torch

from picockpt import Config, init_params
from picockpt.cli import main
from picockpt.recompute.engine import Step
from picockpt.measurement.measure import make_batch
from picockpt.model.moe import route
from picockpt.model.routing import step_routing
from picockpt.ops.router import combine_weights
from picockpt.model.params import layer_key, layer_weights
from picockpt.parallel import loss_and_grads, run_ranks
from picockpt.parallel.expert_parallel.ep_forms import ep_comm_bytes, ep_peak_bytes
from picockpt.parallel.expert_parallel.ep_model import apply_expert_parallel
from picockpt.parallel.rank_model import RankModel
from picockpt.recompute.policy import parse_policy

from processes import no_process_left_behind  # noqa: F401 (a fixture)
from conftest import split_layout
from picockpt.parallel import Layout

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


pytestmark = pytest.mark.usefixtures("no_process_left_behind")


def tiny(batch=4, seq=8, **fields):
    cfg = Config.from_preset("tiny", **{"experts": 4, **fields})  # heads 4, kv_heads 2, ffn 80, vocab 64, L=2
    return cfg, init_params(cfg, seed=0), *make_batch(cfg, batch, seq, "cpu", seed=0)


# ---- clear errors, before any rank starts ----------------------------------------------------------
@pytest.mark.parametrize("fields,batch,kwargs,message", [
    (dict(), 4, dict(ep=3), r"^ep=3 does not divide experts=4: each rank holds E/ep whole experts; use ep in "
                            r"\[1, 2, 4\]$"),
    (dict(), 3, dict(ep=2), r"^batch=3 is not divisible by ep=2: each rank computes batch/ep whole sequences; use a "
                            r"batch that is a multiple of 2, or ep in \[1\]$"),
    (dict(shared_expert_ffn=3), 4, dict(ep=2, tp=2), r"^tp=2 does not divide shared_expert_ffn=3: the shared "
                                                     r"expert is split as the MLP is; use a tp that divides it$"),
    (dict(), 4, dict(ep=2, distribute_saved=True), r"^ep=2 with distribute_saved=True is not supported yet: its "
                                                   r"closed forms split no expert-parallel checkpoint; leave "
                                                   r"distribute_saved out with ep$"),
    (dict(), 4, dict(ep=2, dp=2, microbatches=2), r"^batch=1 \(per replica and micro-batch\) is not divisible by "
                                                  r"ep=2"),
    (dict(experts=0), 4, dict(ep=2), r"^ep=2 with Config.experts=0: expert parallelism splits a mixture of experts "
                                     r"over the ranks, and this model's MLP is dense; set experts to a multiple of 2$"),
    (dict(), 4, dict(ep=2, policy="budget:1MiB"), r"^policy 'budget:1MiB' with ep=2: a budget is planned per rank, "
                                                  r"but a rank's bytes depend on the tokens routed to its experts"),
    (dict(attention="tiled", dropout=0.1), 4, dict(ep=2), r"^attention='tiled' with dropout=0.1 and ep=2: each tile's "
                                                          r"mask comes from a generator seeded by the tile's index"),
    (dict(), 4, dict(ep=0), r"^ep=0: use a whole number of expert-parallel ranks, 1 or more$"),
    (dict(), 4, dict(ep=2, keep_dispatched="yes"), r"^keep_dispatched='yes': use True \(keep the dispatched rows\) "
                                                   r"or False \(dispatch them again when recomputing\)$"),
])
def test_user_mistakes_are_value_errors_naming_the_values(fields, batch, kwargs, message):
    cfg, params, input_ids, targets = tiny(batch=batch, **fields)
    with pytest.raises(ValueError, match=message):
        layout, kwargs = split_layout(kwargs, Layout(tp=2))
        loss_and_grads(params, cfg, input_ids, targets, layout=layout, **kwargs)


# ---- the routing decision is made once -------------------------------------------------------------
def test_route_uses_a_given_routing_decision_and_keeps_it_only_once():
    cfg, params, input_ids, _ = tiny(router_jitter=0.1)
    w = layer_weights(params, 0)
    xn = torch.randn(2, 8, cfg.hidden)
    kept = {}
    torch.manual_seed(3)
    _, index, weights = route(xn, w, cfg, kept.__setitem__)
    assert set(kept) == {"moe.jitter", "moe.router_probs", "moe.expert_index"}
    other = (index + 1) % cfg.experts  # a decision the router would not make
    again = {}
    torch.manual_seed(3)
    _, reused, reweighted = route(xn, w, cfg, again.__setitem__, index=other)
    assert reused is other and set(again) == {"moe.jitter", "moe.router_probs"}
    assert torch.equal(reweighted, combine_weights(again["moe.router_probs"], other))
    torch.manual_seed(3)
    assert torch.equal(route(xn, w, cfg, {}.__setitem__, index=index)[2], weights)  # its own: the same weights


def recompute_with_another_router(comm, params, cfg, input_ids, targets):
    """Full recomputation on one rank, the routers negated between the forward and the backward: the rows
    each recomputed expert projects, per layer, read from the store's puts."""
    model = apply_expert_parallel(RankModel(params, cfg, input_ids, targets), comm)
    step = Step(model, parse_policy("full", cfg).schedule(cfg, *input_ids.shape))
    model.store = step.store
    with torch.no_grad():
        step.forward()
        for weights in model.weights_of:
            weights.router.neg_()  # the router would now send every token elsewhere
        step.backward()
    rows = [[0] * cfg.experts for _ in range(cfg.layers)]
    for event in step.store.events:
        if event.kind == "put" and event.name.startswith("moe.gate_up["):
            rows[event.layer][int(event.name[len("moe.gate_up["):-1])] = event.bytes // (2 * cfg.ffn * 4)
    return rows


@pytest.mark.ranks
def test_a_recomputed_layer_keeps_its_routing_when_the_router_would_choose_otherwise():
    cfg, params, input_ids, targets = tiny(batch=2)
    rows = run_ranks(recompute_with_another_router, 1, params, cfg, input_ids, targets, start_method=START)[0]
    assert rows == step_routing(params, cfg, input_ids)  # the first forward's routing, every layer
    negated = {name: -p if name == layer_key(0, "router") or name == layer_key(1, "router") else p
               for name, p in params.items()}
    assert step_routing(negated, cfg, input_ids) != rows  # choosing again would have sent tokens elsewhere


# ---- python -m picockpt parallel --ep ----------------------------------------------------------------
@pytest.mark.ranks
def test_parallel_command_runs_expert_parallel_against_its_closed_forms(capsys):
    args = ["parallel", "--ep", "2", "--experts", "4", "--policy", "full", "--keep-dispatched", "--preset", "tiny",
            "--seq", "8", "--batch", "2", "--router-jitter", "0.1", "--device", "cpu", "--json"]
    assert main(args) == 0
    row = json.loads(capsys.readouterr().out)
    cfg = Config.from_preset("tiny", experts=4, router_jitter=0.1)
    assert (row["ep"], row["keep_dispatched"], row["policy"]) == (2, True, "full")
    assert [r["rank"] for r in row["ranks"]] == [0, 1] and [r["experts"] for r in row["ranks"]] == [[0, 1], [2, 3]]
    for r, other in zip(row["ranks"], row["other_choice"]["ranks"]):
        assert r["peak_activation_bytes"] == r["predicted_activation_bytes"] == ep_peak_bytes(
            cfg, 2, 8, "full", 2, r["rank"], row["routing"], True)
        assert r["comm_bytes"] == r["predicted_comm_bytes"] == ep_comm_bytes(cfg, 2, 8, "full", 2, r["rank"],
                                                                             row["routing"], True)
        assert r["peak_live_bytes"] >= r["peak_activation_bytes"]
        assert other["predicted_comm_bytes"] == ep_comm_bytes(cfg, 2, 8, "full", 2, r["rank"], row["routing"], False)
        # keeping the rows: the dispatch is not repeated, and the rows are stored instead
        moved = other["predicted_comm_bytes"]["recompute"] - r["comm_bytes"]["recompute"]
        assert moved == cfg.layers * 8 * cfg.experts_per_token * (cfg.hidden * 4 + 4)  # P (h e + s) per layer
        assert r["peak_activation_bytes"] > other["predicted_activation_bytes"]
    assert row["grad_max_rel_diff_vs_single"] <= 1e-5
    assert row["loss"] == pytest.approx(row["single_process_loss"], rel=1e-6)


@pytest.mark.ranks
def test_parallel_command_prints_every_rank_and_what_the_other_choice_would_cost(capsys):
    args = ["parallel", "--ep", "2", "--experts", "4", "--policy", "moe", "--preset", "tiny", "--seq", "8", "--batch",
            "2", "--device", "cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    cfg = Config.from_preset("tiny", experts=4)
    params = init_params(cfg, seed=0)
    input_ids, _ = make_batch(cfg, 2, 8, "cpu", seed=0)
    routing = step_routing(params, cfg, input_ids)
    assert out.startswith("parallel step ep=2, policy moe on cpu, float32, eager attention: L=2 h=32 H=4 KV=2 f=80 "
                          "V=64 E=4 k=2, global batch 2 x 8 tokens")
    assert out.splitlines()[1] == "expert parallel, dispatching again to recompute: E=4 k=2"
    for rank in (0, 1):
        peak = ep_peak_bytes(cfg, 2, 8, "moe", 2, rank, routing)
        rows = " ".join(str(sum(counts[2 * rank:2 * rank + 2])) for counts in routing)
        assert re.search(rf"^{rank} +{2 * rank}\.\.{2 * rank + 1} +{rows} +{peak:,} B +{peak:,} B ", out, re.MULTILINE)
        moved = ep_comm_bytes(cfg, 2, 8, "moe", 2, rank, routing)["recompute"]  # the dispatch again, every layer
        assert moved == cfg.layers * 8 * 2 * (cfg.hidden * 4 + 4)
        assert f"rank {rank}: recomputation moves {moved / 1024:.2f} KiB again" in out
        assert "with --keep-dispatched it would move 0 B and store " in out
    assert "stored peaks, communication bytes per phase and FLOPs equal their closed forms " \
           "(picockpt/parallel/expert_parallel/ep_forms.py): yes" in out


def test_parallel_command_refuses_a_split_that_cannot_be(capsys):
    assert main(["parallel", "--ep", "3", "--experts", "4", "--preset", "tiny", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == "error: --ep 3 does not divide --experts 4: each rank holds E/ep whole " \
                                      "experts; use --ep in [1, 2, 4]\n"
    assert main(["parallel", "--ep", "2", "--experts", "4", "--sp", "--preset", "tiny", "--device", "cpu"]) == 2
    assert re.match(r"error: --sp with --ep 2 and no --tp: sequence parallelism", capsys.readouterr().err)

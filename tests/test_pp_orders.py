"""Pipeline orders on one clock (picockpt/parallel/pipeline_parallel/pp_orders.py): the clock gives 1F1B's and the
interleaved schedule's bubbles as their closed forms, ZB-H1's as Qi et al.'s, and every order runs each
micro-batch's forward, backward (and weight pass) once, in that order, without waiting on itself."""
import pytest

from picockpt import Config
from picockpt.planning.cost import bubble_idle
from picockpt.parallel.pipeline_parallel.pp_orders import one_f_one_b_orders, run_orders, w_pending_bytes
from picockpt.parallel.pipeline_parallel.pp_schedules import bubble_fraction, in_flight, interleaved_actions, zb_h1_actions

SHAPES = [(1, 3), (2, 3), (4, 4), (4, 8), (8, 16), (3, 7)]


def each_once_in_order(orders, microbatches, virtual=1, kinds=("F", "B")):
    for order in orders:
        seen = {}
        for kind, m, c in order:
            assert (kind, m, c) not in seen, f"{kind}{m} chunk {c} twice"
            seen[(kind, m, c)] = len(seen)
        for m in range(microbatches):
            for c in range(virtual):
                positions = [seen[(kind, m, c)] for kind in kinds]
                assert positions == sorted(positions)  # F before B (before W)


@pytest.mark.parametrize("P,M", SHAPES)
def test_the_clock_gives_1f1b_its_closed_form(P, M):
    """Backward twice a forward: every stage idles (P - 1) / (M + P - 1) of the step, and holds what in_flight
    counts from the same actions."""
    result = run_orders(one_f_one_b_orders(P, M), P, times={"F": 1, "B": 2})
    assert result["step"] == 3 * (M + P - 1)
    assert result["idle"] == pytest.approx([bubble_fraction(P, M)] * P)
    assert result["held"] == [in_flight("1f1b", P, M, s) for s in range(P)]
    each_once_in_order(one_f_one_b_orders(P, M), M)


@pytest.mark.parametrize("P,M", [(2, 4), (4, 4), (4, 8), (8, 16), (3, 6)])
@pytest.mark.parametrize("V", [2, 3])
def test_interleaving_shrinks_the_bubble_to_its_closed_form(P, M, V):
    """Each chunk takes 1/V of a stage's time: idle (P - 1) / (V M + P - 1) everywhere; stage 0 holds
    1 + (P - 1) / (P V) times 1F1B's P micro-batches (Korthikanti et al. 2022, sec. 4.2.3) once M > P."""
    orders = [interleaved_actions(P, M, V, s) for s in range(P)]
    each_once_in_order(orders, M, V)
    result = run_orders(orders, P, V, times={"F": 1 / V, "B": 2 / V})
    assert result["idle"] == pytest.approx([bubble_idle(P, M, "interleaved", V)] * P)
    if M > P:
        assert result["held"][0] / V == pytest.approx(P * (1 + (P - 1) / (P * V)))


@pytest.mark.parametrize("P,M", SHAPES)
def test_zb_h1_leaves_a_third_of_1f1bs_bubble(P, M):
    """Equal F, B, W times: the step is 3M + (P - 1), against 1F1B's 3M + 3(P - 1); stage s holds 1F1B's
    activations and what s waiting W's read (here half a micro-batch's each), so stage 0's peak is 1F1B's."""
    orders = [zb_h1_actions(P, M, s) for s in range(P)]
    each_once_in_order(orders, M, kinds=("F", "B", "W"))
    result = run_orders(orders, P, held=(1.0, 0.5))
    assert result["step"] <= 3 * (M + P - 1)  # never slower than 1F1B
    if M >= P:
        assert result["step"] == 3 * M + P - 1
        assert result["idle"] == pytest.approx([bubble_idle(P, M, "zb-h1")] * P)  # the search's closed form
        assert result["held"] == [in_flight("1f1b", P, M, s) + 0.5 * s for s in range(P)]
        assert max(result["held"]) == in_flight("1f1b", P, M, 0)


def test_w_pending_bytes_by_hand():
    cfg = Config.from_preset("tiny")  # h 32, f 80, 4 heads of 8, 2 K/V heads: kv 16, fp32
    B, T = 2, 8
    inputs = B * T * (32 + 32 + 32 + 80)  # x (q, k, v), context (o), normed x (gate, up), SwiGLU product (down)
    grads = B * T * (32 + 2 * 16) + B * T * 32 + 2 * B * T * 80 + B * T * 32  # dq dk dv, do, dgate dup, ddown
    assert w_pending_bytes(cfg, B, T) == 4 * (inputs + grads)


def test_interleaving_refuses_micro_batches_not_in_groups_of_pp():
    with pytest.raises(ValueError, match="microbatches=6 with pp=4"):
        interleaved_actions(4, 6, 2, 0)
    with pytest.raises(ValueError, match="virtual_stages=0"):
        interleaved_actions(4, 8, 0, 0)

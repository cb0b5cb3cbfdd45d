"""Collectives by topology (picockpt/planning/collectives.py): NVLink inside a node, the node's NICs shared by the group's
members there, and NCCL's own tuning model (src/graph/tuning.cc) choosing among ring, tree and PAT."""
import math

import pytest

from picockpt.planning.collectives import (BASE_LATENCY, NETWORK_LATENCY, NVLINK_LATENCY, PAT_RANK_LATENCY, RING_PLATEAU,
                                  algorithm_seconds, bus_rate, chosen_algorithm, collective_seconds, members_per_node,
                                  per_layer_seconds)
from picockpt.planning.cost import HARDWARE
from picockpt.planning.hardware import INFINIBAND_NDR, NVLINK_4

H100 = HARDWARE["h100"]


def test_nccls_constants_as_tuning_cc_has_them():
    assert BASE_LATENCY == {"ring": 8.4e-6, "tree": 8.4e-6, "pat": 8.0e-6}
    assert NVLINK_LATENCY["ring"] == 3.4e-6 and NETWORK_LATENCY["ring"] == 14.0e-6  # 9.6 us before NCCL 2.18.1


def test_a_ring_inside_one_node_by_hand():
    nbytes = 2**28
    assert collective_seconds("all_gather", nbytes, 8, H100, 8) == pytest.approx(
        8.4e-6 + 7 * 3.4e-6 + 7 / 8 * nbytes / NVLINK_4)
    assert chosen_algorithm("all_reduce", nbytes, 8, H100, 8)[0] == "ring"
    assert collective_seconds("all_gather", nbytes, 1, H100, 1) == 0.0  # one rank: nothing moves


def test_whole_nodes_share_their_nics():
    """A group with 8 GPUs in each node moves 8 NICs' worth between nodes (capped by NVLink); one a node, one NIC's."""
    assert bus_rate(512, 8, H100) == min(NVLINK_4, 8 * INFINIBAND_NDR) == 400e9
    assert bus_rate(64, 1, H100) == INFINIBAND_NDR
    assert bus_rate(8, 8, H100) == NVLINK_4
    nbytes = 2**36  # large: bandwidth is nearly all of it
    one, eight = (collective_seconds("reduce_scatter", nbytes, 512, H100, k) for k in (1, 8))
    assert one / eight == pytest.approx(8, rel=0.02)


def test_a_ring_between_nodes_by_hand():
    """64 ranks, 8 a node: 63 steps, 7 of them between nodes; an all-reduce's latency x1.4 between nodes."""
    latency = 8.4e-6 + 56 * 3.4e-6 + 7 * 14.0e-6
    assert algorithm_seconds("all_gather", 0, 64, H100, 8)["ring"] == pytest.approx(latency)
    ar = 8.4e-6 + (126 - 14) * 3.4e-6 + 14 * 14.0e-6
    assert algorithm_seconds("all_reduce", 0, 64, H100, 8)["ring"] == pytest.approx(RING_PLATEAU * ar)


def test_tree_latency_by_hand_and_chosen_for_small_all_reduces_across_many_nodes():
    times = algorithm_seconds("all_reduce", 0, 1024, H100, 8)  # 128 nodes
    assert times["tree"] == pytest.approx(8.4e-6 + 2 * (7 * 4.0e-6 + 7 * 14.0e-6))
    assert chosen_algorithm("all_reduce", 2**16, 1024, H100, 8)[0] == "tree"
    assert chosen_algorithm("all_reduce", 2**34, 64, H100, 8)[0] == "ring"  # bandwidth: 2(n-1)/n against 1/0.46
    assert chosen_algorithm("all_reduce", 2**34, 1024, H100, 8)[0] == "tree"  # 2,046 ring steps outweigh it


def test_pat_only_with_one_gpu_a_node_and_chosen_where_its_latency_wins():
    assert "pat" not in algorithm_seconds("all_gather", 2**20, 64, H100, 8)
    times = algorithm_seconds("all_gather", 0, 128, H100, 1)
    assert times["pat"] == pytest.approx(8.0e-6 + 7 * 14.0e-6 / 3.5 + 128 * PAT_RANK_LATENCY)
    assert times["pat"] < times["ring"]  # log(nodes) and 2.8 us a rank against 127 network steps
    assert chosen_algorithm("all_gather", 2**20, 128, H100, 1)[0] == "pat"
    assert chosen_algorithm("reduce_scatter", 2**34, 128, H100, 1)[0] == "ring"  # PAT runs at 0.75 of the bus


def test_a_send_inside_a_node_and_between_nodes():
    assert collective_seconds("p2p", 100, 2, H100, 1) == pytest.approx(8.4e-6 + 14.0e-6 + 100 / INFINIBAND_NDR)
    assert collective_seconds("p2p", 100, 2, H100, 2) == pytest.approx(8.4e-6 + 3.4e-6 + 100 / NVLINK_4)


def test_fsdp_pays_each_layers_latency():
    """One collective a layer: the same bytes in L pieces pay L latencies (tiny messages: latency is all of it)."""
    whole = collective_seconds("all_gather", 126, 64, H100, 1)
    assert per_layer_seconds("all_gather", 126, 126, 64, H100, 1) == pytest.approx(
        126 * collective_seconds("all_gather", 1, 64, H100, 1))
    assert per_layer_seconds("all_gather", 126, 126, 64, H100, 1) > 100 * whole


@pytest.mark.parametrize("dims,expected", [
    (((8, 1),), 8),  # tp 8: the whole node
    (((64, 128),), 1),  # dp 64 at tp 8 pp 16: one a node
    (((4, 2),), 4),  # cp 4 at tp 2: 4 in a node
    (((2, 4), (4, 8)), 2),  # cp 2 at tp 4, dp 4 at stride 8 (pp 1): the cp pair shares a node
    (((16, 8), (8, 1024)), 1),  # the 128K layout: cp 16 at tp 8
    (((1, 8), (64, 8)), 1),  # dp over whole nodes at tp 8, pp 1
])
def test_members_per_node(dims, expected):
    assert members_per_node(dims, 8) == expected


def test_the_search_never_prices_a_gpu_a_node_where_a_node_holds_eight():
    """Data parallelism over whole nodes (tp 1, pp 1): 8 members a node, 8 NICs, so 8x the bus rate of one a node."""
    per_node = members_per_node(((1, 1), (1024, 1)), 8)
    assert per_node == 8 and math.isclose(bus_rate(1024, per_node, H100), 8 * INFINIBAND_NDR)

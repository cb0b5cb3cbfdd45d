"""A collective's time on a cluster of nodes: which links its group crosses, and which algorithm NCCL would run.

    group        n ranks, k of them in each node (k = n inside one node; k = 1 when every member is in its own
                 node): inside a node the ranks talk over NVLink; between nodes the k members of a node share
                 that node's network, one NIC a GPU, so a node moves k NICs' worth (NCCL builds several rings or
                 trees, one a channel, over the node's NICs: a group with several GPUs a node uses all of theirs)
    bus bytes    what crosses each rank's link: 2(n-1)/n of an all-reduce's size, (n-1)/n of an all-gather's output
                 or a reduce-scatter's input (nccl-tests' bus-bandwidth factors, doc/PERFORMANCE.md)
    bus rate     NVLink's inside one node; across nodes the slower of NVLink and the node's k NICs (a ring enters
                 and leaves each node once a channel, and the node's channels share its k NICs)
    algorithm    NCCL's tuning model (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel and ncclTopoGetAlgoTime,
                 Simple protocol) for each algorithm it offers, and the least time chosen, as NCCL's enqueue.cc
                 picks from that table:
                   ring   base 8.4 us; a step inside a node 3.4 us (NVLink), a step between nodes 14.0 us (NCCL
                          2.18.1 on; 9.6 before; a step inside a node never under the host's network overhead, 3 us
                          on Intel hosts, 6 on AMD: the Intel figure kept); 2(n-1) steps of an all-reduce, 2(N-1) of
                          them between nodes, n-1 and N-1 for an all-gather or reduce-scatter; an all-reduce between
                          nodes x1.4 ("plateau effect of ring", compute capability 8.0 on)
                   tree   all-reduce only: base 8.4 us + 2((k-1) 4.0 us + log2(N) 14.0 us); half the bus rate as
                          algorithm rate, the bus rate x0.92, and NCCL's measured correction for medium sizes (its
                          per-channel cap, which needs the topology search's channel count, is left out)
                   PAT    all-gather and reduce-scatter only, and only with one GPU a node (since NCCL 2.23): base
                          8.0 us + log2(N) 14.0/3.5 us + n 2.8 us; 0.75 of the bus rate, on the whole tensor
                 NVLink SHARP (NVLS) and CollNet need switch support and are left out; so are the LL and LL128
                 protocols, which win only below the sizes a training step sends.
    p2p          a pipeline's send: the ring's base and one step's latency, then the bytes over one link (NVLink
                 inside a node, the GPU's own NIC between nodes)

Bandwidths are datasheet ceilings (picockpt/planning/hardware.py): a measured bus bandwidth sits below them.
"""
import functools
import math

# ---- NCCL's tuning constants (NVIDIA/nccl src/graph/tuning.cc, ncclTunerConstantsDefaults), Simple protocol, s ----
BASE_LATENCY = {"ring": 8.4e-6, "tree": 8.4e-6, "pat": 8.0e-6}  # baseLatencies[algorithm][Simple]
NVLINK_LATENCY = {"ring": 3.4e-6, "tree": 4.0e-6, "pat": 4.0e-6}  # hwLatencies[NVLINK][algorithm][Simple]
NETWORK_LATENCY = {"ring": 14.0e-6, "tree": 14.0e-6, "pat": 14.0e-6}  # hwLatencies[NET][algorithm][Simple]
#   (the ring's network step was 9.6 us before NCCL 2.18.1; with one GPU a node NCCL takes the tree's, also 14.0)
RING_PLATEAU = 1.4  # an all-reduce's ring latency between nodes, compute capability >= 8.0 ("plateau effect")
TREE_BUS_SHARE = 0.92  # tree all-reduce: busBw * .92
PAT_BUS_SHARE = 0.75  # PAT: busBw *= .75
PAT_LOG_DIVISOR = 3.5  # PAT's latency: log2(nodes) * (network latency / 3.5) ...
PAT_RANK_LATENCY = 2.8e-6  # ... + ranks * 2.8 us ("still a linear part")
# treeCorrectionFactor[Simple]: the tree's bandwidth at 64 B * 2^i (i = 0..23), measured below the model at medium sizes
TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9)

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n}
ALGORITHMS = {"all_reduce": ("ring", "tree"), "all_gather": ("ring", "pat"), "reduce_scatter": ("ring", "pat")}


@functools.lru_cache(maxsize=None)
def members_per_node(dims, node):
    """How many members of one group share a node: dims = ((size, stride), ...) in global ranks (a grid's dimension of
    `size` ranks `stride` apart), nodes of `node` consecutive ranks. The group of rank 0 is every group's shape."""
    ranks = [0]
    for size, stride in dims:  # only the members below `node` can share rank 0's node
        ranks = [r + i * stride for r in ranks for i in range(min(size, node // stride + 1))]
    return max(1, sum(1 for r in ranks if r < node))


def bus_rate(ranks, per_node, hw):
    """Bytes/s on each rank's share of the busiest link: NVLink in one node; between nodes the node's per_node NICs
    (one a GPU) carry what crosses, never faster than NVLink."""
    return hw.nvlink if per_node >= ranks else min(hw.nvlink, per_node * hw.network)


def _log2i(n):
    return max(0, int(math.log2(n)))


def algorithm_seconds(kind, nbytes, ranks, hw, per_node):
    """{algorithm: seconds} NCCL's model gives one collective over `ranks` GPUs, per_node of them in each node: nbytes
    is the whole tensor (an all-reduce's buffer, an all-gather's output, a reduce-scatter's input)."""
    if ranks <= 1:
        return {"none": 0.0}
    per_node = min(per_node, ranks)
    nodes = math.ceil(ranks / per_node)
    rate = bus_rate(ranks, per_node, hw)
    out = {}
    for algorithm in ALGORITHMS[kind]:
        base, intra, inter = BASE_LATENCY[algorithm], NVLINK_LATENCY[algorithm], NETWORK_LATENCY[algorithm]
        if algorithm == "ring":
            steps = 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1
            crossing = 0 if nodes == 1 else 2 * (nodes - 1) if kind == "all_reduce" else nodes - 1
            latency = base + (steps - crossing) * intra + crossing * inter
            if kind == "all_reduce" and nodes > 1:
                latency *= RING_PLATEAU
            out[algorithm] = latency + BUS_FACTOR[kind](ranks) * nbytes / rate
        elif algorithm == "tree":
            latency = base + 2 * ((per_node - 1) * intra + _log2i(nodes) * inter)
            size_index = _log2i(max(1, int(nbytes) >> 6))
            correction = TREE_CORRECTION[size_index] if size_index < len(TREE_CORRECTION) else 1.0
            out[algorithm] = latency + nbytes / (0.5 * TREE_BUS_SHARE * rate * correction)
        elif per_node == 1:  # PAT: one GPU a node only
            latency = base + _log2i(nodes) * inter / PAT_LOG_DIVISOR + ranks * PAT_RANK_LATENCY
            out[algorithm] = latency + nbytes / (PAT_BUS_SHARE * rate)
    return out


def chosen_algorithm(kind, nbytes, ranks, hw, per_node):
    """(algorithm, seconds): the least of NCCL's modelled times, as NCCL picks."""
    return min(algorithm_seconds(kind, nbytes, ranks, hw, per_node).items(), key=lambda item: (item[1], item[0]))


@functools.lru_cache(maxsize=2**16)
def collective_seconds(kind, nbytes, ranks, hw, per_node):
    """One collective's seconds: the algorithm NCCL would choose for it (chosen_algorithm); "p2p" is one send of nbytes
    between two ranks, per_node 2 when both are in one node, 1 when the send crosses to another."""
    if kind == "p2p":
        inside = per_node >= 2
        return (BASE_LATENCY["ring"] + (NVLINK_LATENCY if inside else NETWORK_LATENCY)["ring"]
                + nbytes / (hw.nvlink if inside else hw.network))
    return chosen_algorithm(kind, nbytes, ranks, hw, per_node)[1]


def per_layer_seconds(kind, nbytes, layers, ranks, hw, per_node):
    """`layers` collectives of nbytes / layers each, one a layer, each paying its own latency: FSDP issues one
    all-gather and one reduce-scatter per unit, a transformer block (torch's fully_shard on each block, as torchtitan
    wraps them); Megatron's gradient buckets are at least 40M parameters, no smaller than a large model's layer."""
    if layers < 1 or ranks <= 1:
        return 0.0
    return layers * collective_seconds(kind, nbytes / layers, ranks, hw, per_node)

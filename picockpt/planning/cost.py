"""Time from a shape: an op's roofline, a collective's alpha-beta, a pipeline's bubble. One term a line.

    op           max(FLOPs / matmul rate, bytes moved / memory bandwidth), summed over its kernels (roofline:
                 Williams et al. 2009); a matmul is priced by FLOPs, an elementwise op by bytes
    collective   picockpt/planning/collectives.py: NCCL's own tuning model of ring, tree and PAT over a group's nodes
    bubble       the idle share of a pipeline step with equal stage times: (p-1)/(m+p-1) for 1F1B, (p-1)/(V m+p-1)
                 interleaved over V virtual stages a rank (Narayanan et al. 2021, sec. 2.2)

Hardware is named (HARDWARE: datasheet ceilings from picockpt/planning/hardware.py) or measured on this machine
(measured_rates()). A ceiling is never reached: the model prices a step at the datasheet's rates, and the gap to a
measured step (a real GEMM's efficiency, kernels' launch gaps, stragglers) is what it leaves out, said where it matters.

The ops of one layer's forward (layer_ops) mirror picockpt/model/layer.py kernel by kernel, on one rank's shapes (tensor
parallel t, sequence parallel, context parallel cp). price_chain() turns the planner's chain from FLOPs into seconds,
and plan_priced() runs the planner's recurrence (picockpt/planning/planner.py) on those seconds: it only adds and
compares costs, so it minimises time as readily as FLOPs. The prices part where FLOPs call a rebuild free (a norm's
output, SwiGLU's product) that moves bytes, and where a matmul's FLOPs are cheap next to an elementwise op's memory
traffic.
"""
from dataclasses import dataclass, replace

from .layer_forms import attention_matmul_flops, dropped, layer_inventory
from ..model.config import BYTES
from .planner import plan_chain, replay
from .host_walk import model_costs
from .kernel_rates import KernelRates, published
from .hardware import (A100_SXM_BF16, A100_SXM_GIB, A100_SXM_HBM, A100_SXM_REPORTED, H100_SXM_BF16, H100_SXM_GIB,
                       H100_SXM_HBM, H100_SXM_REPORTED, H200_SXM_BF16, H200_SXM_GIB, H200_SXM_HBM, H200_SXM_REPORTED,
                       INFINIBAND_HDR, INFINIBAND_NDR, NVLINK_3, NVLINK_4)
from ..recompute.schedule import Mode

@dataclass(frozen=True)
class Hardware:
    name: str
    matmul: float  # FLOP/s of dense matmuls in the compute dtype
    memory: float  # bytes/s of device memory (reads and writes together)
    nvlink: float  # bytes/s one direction, a GPU to another in its node (None: no such link)
    network: float  # bytes/s one direction, a GPU to another node (its own NIC)
    node: int  # GPUs a node
    source: str
    kernels: KernelRates = None  # how far below `matmul` its kernels run, by shape (kernel_rates.py); None: at it
    capacity: int = None  # bytes of memory on the datasheet (its "GB" are GiB: hardware.py); None: not a named GPU
    reported: int = None  # bytes of memory its driver reports, all a program can allocate (a little below capacity)


HARDWARE = {  # 8 GPUs a node, one 400 Gb/s (H100, H200) or 200 Gb/s (A100) NIC a GPU: the DGX systems' layout
    "h100": Hardware("h100", H100_SXM_BF16, H100_SXM_HBM, NVLINK_4, INFINIBAND_NDR, 8,
                     "H100 SXM 80 GB datasheet; NVLink 4; NDR InfiniBand, one port a GPU (DGX H100)",
                     published("h100"), H100_SXM_GIB * 2**30, H100_SXM_REPORTED),
    "h200": Hardware("h200", H200_SXM_BF16, H200_SXM_HBM, NVLINK_4, INFINIBAND_NDR, 8,
                     "H200 SXM 141 GB datasheet; NVLink 4; NDR InfiniBand, one port a GPU (DGX H200)",
                     published("h200"), H200_SXM_GIB * 2**30, H200_SXM_REPORTED),
    "a100": Hardware("a100", A100_SXM_BF16, A100_SXM_HBM, NVLINK_3, INFINIBAND_HDR, 8,
                     "A100 SXM 80 GB datasheet; NVLink 3; HDR InfiniBand, one port a GPU (DGX A100)",
                     None, A100_SXM_GIB * 2**30, A100_SXM_REPORTED),
}
DEFAULT_HARDWARE = "h100"  # what predict --search prices when --hardware is left out
HARDWARE_NAMES = (*HARDWARE, "cpu-measured")


def hardware(name, dtype="float32"):
    """A Hardware by name; "cpu-measured" times this machine's matmul rate and copy bandwidth now (a few seconds)."""
    if name == "cpu-measured":
        return measured_rates("cpu", dtype)
    if name not in HARDWARE:
        raise ValueError(f"--hardware={name!r}: use one of {', '.join(HARDWARE_NAMES)}")
    return HARDWARE[name]


def measured_rates(device="cpu", dtype="float32", repeats=5):
    """A device's rates, measured now: the best of `repeats` n^3 matmuls in `dtype` (n = 1024 on the CPU, 4096 on a
    GPU) and of copies of 64 MiB (256 MiB on a GPU); a copy reads and writes, so it moves twice its bytes. The first
    of each warms up. Links: none on the CPU (one process); on a GPU the H100's datasheet links stand in."""
    import time

    import torch
    device = torch.device(device)
    n, floats = (1024, 2**24) if device.type == "cpu" else (4096, 2**26)
    a, b = (torch.randn(n, n, dtype=getattr(torch, dtype), device=device) for _ in range(2))
    src, dst = (torch.empty(floats, dtype=torch.float32, device=device) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    matmul, copy = [], []
    for _ in range(repeats + 1):
        for out, run in ((matmul, lambda: a @ b), (copy, lambda: dst.copy_(src))):
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            out.append(time.perf_counter() - start)
    links = (None, None, 1) if device.type == "cpu" else (NVLINK_4, INFINIBAND_NDR, 8)
    return Hardware(f"{device.type}-measured", 2 * n**3 / min(matmul[1:]), 2 * src.nbytes / min(copy[1:]), *links,
                    f"this {device.type.upper()}, measured now: best of {repeats} matmuls of {n}^3 ({dtype}) and "
                    f"{src.nbytes // 2**20} MiB copies")


# ---- an op: its kernels' (FLOPs, bytes moved), priced by the roofline --------------------------------------------
@dataclass(frozen=True)
class Op:
    name: str
    kernels: tuple  # ((matmul FLOPs, bytes read and written), ...): elementwise kernels count 0 FLOPs
    makes: frozenset = frozenset()  # the stored names it writes: what rebuilding a dropped one runs again
    shapes: tuple = ()  # each kernel's shape, for kernel_rates.op_seconds: ("gemm", rows, d_in, d_out),
    #                     ("attention", keys a query row runs over) or None (elementwise); () all None

    @property
    def flops(self):
        return sum(f for f, _ in self.kernels)

    @property
    def bytes(self):
        return sum(b for _, b in self.kernels)


def roofline_seconds(op, hw):
    """An op's time on `hw`: each kernel waits for the slower of its math and its memory traffic."""
    return sum(max(f / hw.matmul, b / hw.memory) for f, b in op.kernels)


def layer_ops(cfg, batch, seq, t=1, sp=False, cp=1, causal_skip=False):
    """The ops of one layer's forward on one rank, in picockpt/model/layer.py's order, with each kernel's FLOPs and
    bytes: t tensor-parallel ranks (heads and the MLP split t ways), sp (norms and residuals on seq/(cp t) tokens), cp
    context-parallel ranks (seq/cp queries a rank, against all seq keys). Also "probs" for eager attention: not a
    forward op but what rebuilding the dropped probabilities runs (the scores and their softmax). causal_skip: a GPU
    flash kernel skips the key blocks above the diagonal, about half the square (the CPU's, like FlopCounterMode,
    computes and counts it whole)."""
    e, s = BYTES[cfg.dtype], BYTES[cfg.dtype_names[1]]
    n = seq // cp  # this rank's queries
    BT, Bt = batch * n, batch * n // (t if sp and t > 1 else 1)  # tokens through the heads; through norms
    h, hd, f, H, KV = cfg.hidden, cfg.head_dim, cfg.ffn // t, cfg.heads // t, cfg.kv_heads // t
    q, kv = H * hd, KV * hd

    def linear(rows, d_in, d_out):  # x (rows, d_in) @ w^T (d_out, d_in): read x and w, write the output
        return 2 * rows * d_in * d_out, e * (rows * d_in + d_in * d_out + rows * d_out)

    def matmuls(name, *dims, makes=()):  # an op of linears, each kernel with its shape
        return Op(name, tuple(linear(*d) for d in dims), frozenset(makes), tuple(("gemm", *d) for d in dims))

    def norm(name, makes):  # read x, write the output and one statistic a row
        return Op(name, ((0, 2 * e * Bt * h + s * Bt),), frozenset(makes))

    square = batch * H * n * seq  # a rank's query rows against every key
    core = attention_matmul_flops(cfg, batch, seq) // (t * cp)
    core = core // 2 if causal_skip and cfg.attention == "fused" else core
    scores = ((core, e * (BT * q + batch * seq * kv + square)), (0, 2 * e * square),  # q k^T (masked), the scale
              (0, (e + s) * square + (s + e) * square))  # softmax: read e, write stat, read it, write e
    if cfg.attention == "eager":
        attention = scores + ((core, e * (square + batch * seq * kv + BT * q)),)  # P v
    else:  # one flash kernel: q, k, v in and the output out; the T x T tiles never leave on-chip memory
        attention = ((2 * core, e * (2 * BT * q + 2 * batch * seq * kv) + s * batch * H * n),)
    ops = [norm("attn_norm", ("attn_norm.output", "attn_norm.rstd")),
           matmuls("qkv", (BT, h, q), (BT, h, kv), (BT, h, kv)),
           Op("rope", ((0, 2 * e * BT * q), (0, 2 * e * BT * kv))),
           Op("attention", attention, frozenset({"attn.context", "attn.lse"}),
              () if cfg.attention == "eager" else (("attention", seq),)),
           matmuls("o_proj", (BT, q, h)),
           Op("attn_residual", ((0, 3 * e * Bt * h),), frozenset({"mlp_norm.input"})),
           norm("mlp_norm", ("mlp_norm.output", "mlp_norm.rstd")),
           matmuls("gate_up", (BT, h, f), (BT, h, f), makes=("mlp.gate", "mlp.up")),
           Op("swiglu", ((0, 3 * e * BT * f),), frozenset({"mlp.act"})),
           matmuls("down", (BT, f, h)),
           Op("mlp_residual", ((0, 3 * e * Bt * h),))]
    if cfg.attention == "eager":
        ops.append(Op("probs", scores, frozenset({"attn.probs"})))  # a rebuild only
    return tuple(ops)


FORWARD_EXCLUDES = frozenset({"probs"})  # layer_ops entries that are rebuilds, not forward ops
REBUILT_BY = {"attn.probs": "probs", "attn.probs_dropped": "probs", "attn_norm.output": "attn_norm",
              "mlp_norm.output": "mlp_norm", "mlp.act": "swiglu"}  # a dropped name -> the op that rebuilds it


def head_ops(cfg, batch, seq, t=1, sp=False):
    """The model head's forward on one rank: the final norm (on seq/t tokens under sequence parallelism), the
    vocab-parallel logits of every token, the loss over them."""
    e, s, BT, h, V = BYTES[cfg.dtype], BYTES[cfg.dtype_names[1]], batch * seq, cfg.hidden, cfg.vocab // t
    Bt = BT // (t if sp and t > 1 else 1)
    return (Op("final_norm", ((0, 2 * e * Bt * h + s * Bt),), frozenset({"final_norm.output"})),
            Op("logits", ((2 * BT * h * V, e * (BT * h + h * V + BT * V)),), shapes=(("gemm", BT, h, V),)),
            Op("loss", ((0, (e + s) * BT * V),)))  # read the logits, write the log-softmax's statistics


def check_dense(cfg, what):
    if cfg.experts:
        raise ValueError(f"Config.experts={cfg.experts}: {what} prices a dense layer's ops (picockpt/model/layer.py's "
                         f"MLP); a mixture of experts' ops are not in its table: use --cost flops, or experts=0")


def roofline_op_seconds(cfg, batch, seq, hw):
    """{op name: seconds} for a layer's ops and the head's, by the roofline on `hw`."""
    check_dense(cfg, "the roofline")
    return {op.name: roofline_seconds(op, hw) for op in layer_ops(cfg, batch, seq) + head_ops(cfg, batch, seq)}


# ---- the planner's chain in seconds ------------------------------------------------------------------------------
def rebuild_seconds(seconds, names):
    """What a layer's backward spends rebuilding the dropped `names`: each rebuilding op once, summed in a fixed
    order (a set's order changes with Python's hash seed, and a float sum's last bit with the order)."""
    return sum(seconds[op] for op in sorted({REBUILT_BY[name] for name in names if name in REBUILT_BY}))


def price_chain(chain, cfg, batch, seq, seconds, unstored=frozenset()):
    """The planner's chain (planner.model_chain: costs in FLOPs) with every cost in seconds instead: a layer's forward
    is its ops' seconds, a variant's rebuild the seconds of the ops its dropped names need, the tail the down
    projection, the recompute inside an op (tiled attention's q k^T, a chunked head's logits) priced at its op's
    seconds a FLOP. `seconds` {op name: seconds}, from roofline_op_seconds() or a measured profile (op_times.py)."""
    check_dense(cfg, "a chain priced in seconds")
    stored = set(layer_inventory(cfg, batch, seq))
    forward = sum(v for name, v in seconds.items() if name in {op.name for op in layer_ops(cfg, batch, seq)}
                  and name not in FORWARD_EXCLUDES)
    ops = {op.name: op for op in layer_ops(cfg, batch, seq) + head_ops(cfg, batch, seq)}

    def per_flop(name, flops):  # an op's seconds, in proportion to the FLOPs of it that run again
        return seconds[name] * flops / ops[name].flops if flops else 0.0

    layer, head = chain[0], chain[-1]
    variants = tuple((mode, a,
                      rebuild_seconds(seconds, {n for n in stored if dropped(n, Mode(mode).unstored(unstored))}))
                     for mode, a, _ in layer.variants)
    priced = replace(layer, forward_flops=forward, variants=variants, tail_flops=seconds["down"],
                     inner_flops=per_flop("attention", layer.inner_flops))
    head_variants = tuple((mode, a,
                           seconds["final_norm"] if "final_norm.output" in Mode(mode).unstored(unstored) else 0.0)
                          for mode, a, _ in head.variants)
    priced_head = replace(head, variants=head_variants, inner_flops=per_flop("logits", head.inner_flops))
    return (priced,) * (len(chain) - 1) + (priced_head,)


def priced_costs(cfg, batch, seq, seconds, unstored=frozenset()):
    """host_walk's Costs in seconds (a layer's ops, the head's; backward 2x the forward), for its walk at rate 1."""
    forward = sum(seconds[op.name] for op in layer_ops(cfg, batch, seq) if op.name not in FORWARD_EXCLUDES)
    head = sum(seconds[op.name] for op in head_ops(cfg, batch, seq))
    return replace(model_costs(cfg, batch, seq, unstored), layer_forward=forward, layer_backward=2 * forward,
                   head_forward=head, head_backward=2 * head)


def plan_priced(chain, priced, budget):
    """The Plan of least modelled recompute time within `budget` bytes: decided on `priced` (price_chain's seconds),
    reported with `chain`'s exact FLOPs and the seconds beside them (Plan.recompute_seconds)."""
    if len(priced) != len(chain) or any(p.input_bytes != c.input_bytes or [v[:2] for v in p.variants] !=
                                        [v[:2] for v in c.variants] for p, c in zip(priced, chain)):
        raise ValueError("priced: a chain of the same stages, bytes and modes as `chain`, only its costs in seconds "
                         "(price_chain)")
    plan = plan_chain(priced, budget)
    _, flops = replay(chain, plan.schedule)
    return replace(plan, recompute_flops=flops, recompute_seconds=plan.recompute_flops)


# ---- the bubble ---------------------------------------------------------------------------------------------
def bubble_idle(pp, microbatches, schedule="1f1b", virtual_stages=1):
    """The idle share of a pipeline step, equal stage times: 1F1B and AFAB (p-1)/(m+p-1); interleaved 1F1B
    (p-1)/(V m+p-1), each of the V chunks a rank holds 1/V of its layers; ZB-H1 with equal F, B and W times
    (p-1)/(3m+p-1), its idle (p-1)(F+B-W) against a step of m(F+B+W) (Qi et al. 2023), m >= p. Each is what
    pipeline_parallel/pp_orders.py's clock gives (tests/test_pp_orders.py)."""
    if schedule == "zb-h1":
        return (pp - 1) / (3 * microbatches + pp - 1)
    v = virtual_stages if schedule == "interleaved" else 1
    return (pp - 1) / (v * microbatches + pp - 1)

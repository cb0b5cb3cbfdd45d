"""How far below the datasheet a GPU's kernels run, by shape: the layout model's kernel efficiency.

The roofline (cost.py) runs every matmul at the datasheet's peak. Real kernels do not, and not by one factor:

    gemm        an (m, n, k) matmul runs at the best rate a matmul of that GPU has been measured at (its
                "maximum achievable matmul FLOPS", MAMF: a search over shapes for the fastest), times the share
                of the SMs its output tiles keep busy: a product of fewer tiles than SMs leaves SMs idle (NVIDIA's
                Matrix Multiplication Background User's Guide, "wave quantization"; the tile size below is
                an assumption, cuBLAS picks among several)
    attention   a flash kernel's rate forward and backward by the length of the keys each query row runs over,
                read off a published benchmark at the same head size, interpolated in log2(keys) and flat past
                its ends. Flash benchmarks count a backward as 2.5 forwards of FLOPs (it recomputes the scores:
                Dao-AILab/flash-attention benchmarks/benchmark_flash_attention.py, flops()); the model counts 2,
                so a backward rate is stored here as published x 2 / 2.5
    elementwise the datasheet's bandwidth, as the roofline (no published per-kernel rates are used)

Three sources: "peak" (none of this: the roofline, lesson 23's first model), a published table (PUBLISHED, each
number with where it was read), or a table measured on the machine at hand (lessons/kernel_rates.py writes one;
from_json reads it: a shape not measured takes the efficiency of the nearest measured one, and says so).
"""
import json
import math
from dataclasses import dataclass

SEQ_POINTS = (512, 1024, 2048, 4096, 8192, 16384)  # the published attention benchmarks' sequence lengths
BACKWARD_COUNT = 2.5 / 2  # flash benchmarks' backward FLOPs over the model's (2.5 forwards against 2)
TILE = (128, 256)  # rows x columns of one output tile a thread block computes (assumed: a common Hopper tile)


@dataclass(frozen=True)
class KernelRates:
    """What one GPU's kernels reach. gemm_efficiency: the best measured matmul over the datasheet's peak; sms: the GPU's
    streaming multiprocessors; attention: ((keys, forward FLOP/s, backward FLOP/s in the model's count), ...) ascending;
    gemms: ((m, n, k, FLOP/s), ...) measured, empty for a published table; source: where every number comes from."""
    name: str
    gemm_efficiency: float
    sms: int
    attention: tuple
    source: str
    gemms: tuple = ()

    def gemm_rate(self, m, n, k, peak):
        """FLOP/s of an (m, n, k) matmul (m x k by k x n): the measured row nearest in log-shape, else the best
        matmul's rate times the share of the SMs its tiles fill."""
        if self.gemms:
            return min(self.gemms, key=lambda g: sum(math.log(a / b) ** 2 for a, b in zip(g[:3], (m, n, k))))[3]
        tiles = math.ceil(m / TILE[0]) * math.ceil(n / TILE[1])
        return peak * self.gemm_efficiency * min(1.0, tiles / self.sms)

    def attention_rate(self, direction, keys):
        """FLOP/s (the model's count) of a flash kernel whose query rows each run over `keys` keys: the table
        interpolated in log2(keys), its first or last rate beyond its ends."""
        points = [(math.log2(row[0]), row[1 if direction == "forward" else 2]) for row in self.attention]
        x = math.log2(max(1, keys))
        if x <= points[0][0]:
            return points[0][1]
        for (x0, r0), (x1, r1) in zip(points, points[1:]):
            if x <= x1:
                return r0 + (r1 - r0) * (x - x0) / (x1 - x0)
        return points[-1][1]

    def to_json(self):
        return {"name": self.name, "gemm_efficiency": self.gemm_efficiency, "sms": self.sms,
                "attention": [list(row) for row in self.attention], "gemms": [list(g) for g in self.gemms],
                "source": self.source}


FIELDS = ("name", "gemm_efficiency", "sms", "attention", "source")  # what a table must hold ("gemms" may be left out)


def from_json(path):
    """A KernelRates from a table lessons/kernel_rates.py measured (its JSON), or a clear error."""
    try:
        with open(path) as f:
            data = json.load(f)
        missing = [key for key in FIELDS if key not in data] if isinstance(data, dict) else None
        if missing is None:
            raise ValueError("it is not a JSON object of named fields, {...}")
        if missing:
            raise ValueError(f"it has no {_listed(missing)} field{'s' if len(missing) > 1 else ''}")
        return KernelRates(data["name"], float(data["gemm_efficiency"]), int(data["sms"]),
                           tuple(tuple(row) for row in data["attention"]), data["source"],
                           tuple(tuple(g) for g in data.get("gemms", ())))
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"--kernels {path}: not a kernel-rate table ({error}); give published, peak, or a JSON "
                         f"file that lessons/kernel_rates.py wrote") from None


def _listed(keys):
    """'a', 'a' or 'b', 'a', 'b' or 'c': the keys quoted, for a sentence."""
    quoted = [repr(key) for key in keys]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _published_attention(forward, backward):
    """Rows (keys, forward, backward in the model's count) from TFLOP/s read at SEQ_POINTS."""
    return tuple((s, f * 1e12, b * 1e12 / BACKWARD_COUNT) for s, f, b in zip(SEQ_POINTS, forward, backward))


# ---- published tables ---------------------------------------------------------------------------------------------
MAMF_SOURCE = ("stas00/ml-engineering compute/accelerator/README.md, Maximum Achievable Matmul FLOPS table: "
               "H100 SXM 792.1 of 989 TFLOPS (80.1%), BF16, CUDA 12.1")
FA3_SOURCE = ("Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, Figs. 5 and 6: H100 80GB SXM5, BF16, head dim "
              "128, 16 heads, 16k tokens a batch; forward with the causal mask, backward as published (no causal "
              "backward is given)")
# TFLOP/s at 512, 1k, 2k, 4k, 8k and 16k keys (FA3_SOURCE)
H100_ATTENTION = {
    "cudnn": _published_attention((315, 410, 484, 518, 529, 539), (305, 408, 465, 499, 518, 516)),
    "flash2": _published_attention((191, 260, 298, 319, 333, 335), (214, 260, 291, 310, 318, 322)),
    "flash3": _published_attention((292, 423, 521, 579, 602, 616), (316, 424, 501, 542, 559, 561)),
}
ATTENTION_KERNELS = tuple(H100_ATTENTION)  # cudnn first: what torch's sdpa picks on Hopper (the first GPU run)
H100_SMS = 132  # NVIDIA's H100 SXM5 datasheet / Hopper whitepaper: 132 SMs


def published(hardware_name, kernel="cudnn"):
    """The published KernelRates of an H100 (the H200 is the same GH100 chip, so it takes the H100's: its faster
    memory is in its datasheet bandwidth), or None where none is wired (the A100: the roofline)."""
    if hardware_name not in ("h100", "h200"):
        return None
    if kernel not in H100_ATTENTION:
        raise ValueError(f"--attention-kernel {kernel!r}: use one of {', '.join(ATTENTION_KERNELS)}")
    note = "" if hardware_name == "h100" else "; the H200 priced as the H100 (the same chip), not measured"
    return KernelRates(f"{hardware_name} published, {kernel} attention", 792.1 / 989, H100_SMS,
                       H100_ATTENTION[kernel], f"GEMMs: {MAMF_SOURCE}; attention ({kernel}): {FA3_SOURCE}{note}")


# ---- an op's seconds with these rates -----------------------------------------------------------------------------
def gemm_passes(shape, direction):
    """The (m, n, k) of each matmul a linear ("gemm", rows, d_in, d_out) runs: forward y = x w^T (rows, d_out, d_in);
    backward the input's gradient dy w (rows, d_in, d_out) and the weight's dy^T x (d_out, d_in, rows)."""
    _, rows, d_in, d_out = shape
    return ((rows, d_out, d_in),) if direction == "forward" else ((rows, d_in, d_out), (d_out, d_in, rows))


def op_seconds(op, hw, rates=None, direction="forward"):
    """An op's seconds on `hw`, forward or backward (twice the forward's FLOPs and bytes, as the model counts a
    backward). rates None: the roofline, every kernel at hw's peak. Else a matmul at rates.gemm_rate of each pass's
    shape, a flash kernel at rates.attention_rate, an elementwise kernel at the bandwidth; each kernel still waits
    for its bytes when they take longer."""
    passes = 1 if direction == "forward" else 2
    total = 0.0
    for (flops, nbytes), shape in zip(op.kernels, op.shapes or (None,) * len(op.kernels)):
        kind = shape[0] if shape is not None and rates is not None else None
        if kind == "gemm":
            total += sum(max(flops / rates.gemm_rate(m, n, k, hw.matmul), nbytes / hw.memory)
                         for m, n, k in gemm_passes(shape, direction))
        elif kind == "attention":
            total += passes * max(flops / rates.attention_rate(direction, shape[1]), nbytes / hw.memory)
        else:
            total += passes * max(flops / hw.matmul, nbytes / hw.memory)
    return total

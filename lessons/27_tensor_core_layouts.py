# %% [markdown]
# # Lesson 27: tensor-core-friendly layouts for recomputed ops
#
# A recompute runs the forward's matmuls again: `full` re-runs every projection of a layer, `selective` the
# $Q K^\top$ of attention, a chunked loss (lesson 13) the logits. Whatever a shape or a layout costs, a
# recomputed matmul pays it twice. NVIDIA's *Matrix Multiplication Background User's Guide* gives the rules:
#
# - **Tensor Core requirements** (sec. 2.2): performance is best when $M$, $N$ and $K$ are multiples of 16
#   bytes, 8 elements in fp16 / bf16 (on an A100, 128 bytes: 64 elements). With cuBLAS before 11.0 this was a
#   requirement for using tensor cores at all; since, it is a matter of speed.
# - **Tile quantization** (sec. 3.1): cuBLAS splits the output into tiles (256 x 128 and 128 x 256 the most
#   efficient, 64 x 64 the least) and every tile costs the same. A 256 x 256 output takes four 128 x 128
#   tiles, a 257 x 256 output six: a third of the work computed is thrown away.
# - **Wave quantization** (sec. 3.2): tiles run in waves of one per SM (for 256 x 128 tiles). An A100 has 108
#   SMs, so 109 tiles take two waves, the second nearly empty. An H100 SXM has 132 SMs (NVIDIA H100 Tensor
#   Core GPU architecture whitepaper). The guide's rule is the A100-era picture of one tile per thread block
#   launched in a grid. On Hopper, CUTLASS 3.0's warp-specialized *persistent* kernels (its release notes,
#   NVIDIA/cutlass CHANGELOG.md) launch one block per SM that loops over tiles, and *stream-K* scheduling
#   (Osama et al. 2023, "Stream-K: Work-centric Parallel Decomposition for Dense Matrix-Matrix Multiplication
#   on the GPU") splits the last wave's tiles along $K$ across the idle SMs: the tail is softened, so the wave
#   efficiency below is a worst case, not a prediction of an H100's time.
# - **Layout**: cuBLAS takes either operand transposed by a flag, so `x @ w.T` costs no copy, and its
#   strided-batched GEMM takes any stride between the matrices of a batch and any leading dimension. The
#   heads of a (B, T, H, hd) tensor viewed as (B, H, T, hd) are such a batch, with one catch in PyTorch:
#   `torch.matmul` folds the two batch dimensions (B, H) into one before calling `bmm`, and that fold needs
#   the stride of B to be H times the stride of H. The view's is T times too large, so at B > 1 matmul copies
#   each operand first (an elementwise pass priced by its bytes, lesson 26); at B = 1 the fold is free and no
#   copy is made (the section below records which ops each call dispatches). `scaled_dot_product_attention`
#   takes the strided views as they are, and FlashAttention's own layout is (batch, seqlen, heads, headdim)
#   (`flash_attn_func`'s docstring, Dao-AILab/flash-attention flash_attn/flash_attn_interface.py), the
#   projections' output without any transpose. `picockpt/model/layer.py` copies q, k and v into (B, H, T, hd) once,
#   with `.contiguous()`, right after RoPE, so its eager attention's matmuls never copy.
#
# This lesson measures on this CPU what a CPU shows of it (an odd inner dimension and an odd vocabulary
# against padded ones; strided heads against contiguous copies, for `torch.matmul` where its fold copies and
# where it does not, and for `scaled_dot_product_attention`), models what only a GPU would show (tile and wave
# quantization, on the guide's tile sizes and the H100's SM count), and applies both to picockpt's shapes.
#
# **Run it** as a script, `python lessons/27_tensor_core_layouts.py` (the CPU run, well under a minute;
# `--fast` for seconds), or step through this notebook, where the same flags come from the environment variable
# `PICOCKPT_LESSON_ARGS` (unset: the CPU run). The measured part always runs on this machine's CPU; the
# tensor-core part is a model of the guide's rules.

# %%
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from _check import check
from _lesson import (FAST_TIMING, Spread, callouts, choose, clock_words, compute_clock, device_name,
                     interleaved_seconds, lesson_args, paired_ratios, small, timed_claim, timing_verdict, wrote)
from picockpt import Config
from picockpt.ops.linear import linear_forward
from picockpt.teaching.plotting import save_figure

H100_SMS = 132  # streaming multiprocessors of an H100 SXM5: NVIDIA H100 Tensor Core GPU architecture whitepaper
A100_SMS = 108  # of an A100: the Matrix Multiplication Background User's Guide, sec. 3.2
TILE = (256, 128)  # rows x columns of the output a thread block computes: the guide's most efficient tile
ALIGN_BYTES = 16  # the guide, sec. 2.2: dimensions in multiples of 16 bytes (8 elements of fp16 / bf16)

# %% [markdown]
# ## The rules as arithmetic
#
# `tiles` and `tile_efficiency` count the output tiles of an $M \times N$ product and the share of their area
# that is real output; `waves` and `wave_efficiency` how many rounds of `sms` tiles they take and the share
# of those SM slots that hold a tile; `pad_to_multiple` rounds a dimension up; `aligned` checks the guide's
# 16-byte rule.

# %%
def tiles(m, n, tile=TILE):
    """Output tiles of an (m, n) product: ceil(m / tile rows) x ceil(n / tile columns)."""
    if m < 1 or n < 1:
        raise ValueError(f"m={m}, n={n}: a product's output has at least one row and one column")
    return math.ceil(m / tile[0]) * math.ceil(n / tile[1])


def tile_efficiency(m, n, tile=TILE):
    """The share of the computed tile area that is real output: m n / (tiles x tile area)."""
    return m * n / (tiles(m, n, tile) * tile[0] * tile[1])


def waves(tile_count, sms=H100_SMS, per_sm=1):
    """Rounds the GPU runs tile_count tiles in, per_sm tiles on each of its sms at a time."""
    return math.ceil(tile_count / (sms * per_sm))


def wave_efficiency(tile_count, sms=H100_SMS, per_sm=1):
    """The share of the SM slots of all waves that hold a tile."""
    return tile_count / (waves(tile_count, sms, per_sm) * sms * per_sm)


def pad_to_multiple(n, multiple):
    """The least multiple of `multiple` that is at least n (a padded vocabulary, a padded ffn)."""
    if multiple < 1:
        raise ValueError(f"multiple={multiple}: pad to a positive multiple, e.g. 8 or 64")
    return -(-n // multiple) * multiple


def aligned(n, element_bytes=2, alignment=ALIGN_BYTES):
    """Whether n elements of element_bytes fill whole `alignment`-byte units (the guide's sec. 2.2 rule)."""
    return n * element_bytes % alignment == 0


# %% [markdown]
# ## picockpt's shapes under the rules
#
# The matmuls a recompute re-runs, as (output rows $M$, output columns $N$, inner $K$), for the `small`
# preset at batch 4 x 128 and for Llama 3 8B at one sequence of 4096 tokens: the seven projections of a
# layer, one head's $Q K^\top$ (rebuilt by `selective` and by FlashAttention's backward) and the logits (rebuilt
# by a chunked loss). For each: whether $N$ and $K$ are multiples of 8 (16 bytes in bf16) and of 64 (128 bytes),
# the tile efficiency with 256 x 128 tiles, and the waves on an H100's 132 SMs. Attention's two products are
# batched: one launch runs every (sequence, head) pair's product in one grid, so their tiles are counted for
# all B·H heads together (the shape shown is one head's).

# %%
def recomputed_matmuls(cfg, tokens, seq):
    """{name: (M, N, K, products in one launch)} of the matmuls a recompute of one layer (and the logits) runs
    again: attention's are batched over the B sequences and H heads, one grid for all of them."""
    h, f, hd = cfg.hidden, cfg.ffn, cfg.head_dim
    heads = tokens // seq * cfg.heads  # B·H products of one head's shape, in one launch
    return {"q": (tokens, cfg.heads * hd, h, 1), "k, v": (tokens, cfg.kv_heads * hd, h, 1), "o": (tokens, h, h, 1),
            "gate, up": (tokens, f, h, 1), "down": (tokens, h, f, 1), "q k^T (B·H heads)": (seq, seq, hd, heads),
            "p v (B·H heads)": (seq, hd, seq, heads), "logits": (tokens, cfg.vocab, h, 1)}


def shape_table(cfg, tokens, seq):
    """{name: row of the table below}."""
    rows = {}
    for name, (m, n, k, batched) in recomputed_matmuls(cfg, tokens, seq).items():
        count = batched * tiles(m, n)  # every product's tiles in the one grid
        rows[name] = {"shape": (m, n, k), "x8": aligned(n) and aligned(k), "x64": aligned(n, alignment=128)
                      and aligned(k, alignment=128), "tile": tile_efficiency(m, n), "tiles": count,
                      "waves": waves(count), "wave": wave_efficiency(count)}
    return rows


models = {"small, 4 x 128": (small(dtype="bf16"), 4 * 128, 128),
          "Llama 3 8B, 1 x 4096": (Config.from_preset("llama3-8b", dtype="bf16"), 4096, 4096)}
tables = {label: shape_table(cfg, tokens, seq) for label, (cfg, tokens, seq) in models.items()}
for label, table in tables.items():
    print(f"\n{label} (modelled: 256 x 128 tiles, {H100_SMS} SMs):")
    print(f"{'matmul':<16}{'M x N x K':>22}{'x8':>5}{'x64':>5}{'tile eff.':>10}{'tiles':>8}{'waves':>6}"
          f"{'wave eff.':>10}")
    for name, row in table.items():
        m, n, k = row["shape"]
        print(f"{name:<16}{f'{m} x {n} x {k}':>22}{'yes' if row['x8'] else 'NO':>5}{'yes' if row['x64'] else 'no':>5}"
              f"{row['tile']:>10.1%}{row['tiles']:>8,}{row['waves']:>6}{row['wave']:>10.1%}")
few = [row["tiles"] for row in tables["small, 4 x 128"].values()]
print(f"the small preset's matmuls make {min(few)} to {max(few)} tiles of 256 x 128 for {H100_SMS} SMs")
for vocab in (128256, 50257, pad_to_multiple(50257, 64)):
    print(f"vocab {vocab:,}: multiple of 8 {'yes' if vocab % 8 == 0 else 'NO'}, "
          f"of 64 {'yes' if vocab % 64 == 0 else 'no'}, "
          f"logits tile efficiency at 4096 tokens {tile_efficiency(4096, vocab):.2%}")

# %% [markdown]
# Every dimension of Llama 3 8B is a multiple of 64, its vocabulary of 128,256 included (1,002 x 128), so its
# tile efficiency is 100% everywhere; the `small` preset's are multiples of 8, its head dimension of 32 not of
# 64. GPT-2's 50,257 is not a multiple of 8; nanoGPT pads it to 50,304, "the nearest multiple of 64 for
# efficiency". Its tile waste is a tenth of a percent: what the odd size costs is alignment, which the guide
# measures and this model does not. Not in the weight: it is (V, h), each of its rows h = 768 elements long,
# so every row starts on a 16-byte boundary. The misaligned dimension is V where it is a *leading* dimension:
# the logits (tokens, V) and their gradient, whose row $i$ starts $i \cdot V \cdot 2$ bytes in bf16, a
# multiple of 16 only when V is a multiple of 8; the logits' matmul writes them and the gradient's two matmuls
# (into the hidden states and into the weight) read them with that stride. The
# `small` shapes make a handful of tiles for an H100's 132 SMs (the line above): a model this size cannot
# occupy the GPU (cuBLAS would choose smaller tiles, which trade efficiency for parallelism), and its
# recomputes cost launch latency more than arithmetic.
#
# ## Measured on this CPU: odd dimensions, strided heads, matmul's fold copy
#
# Five pairs, each timed in its own interleaved repeats (each repeat runs the pair's two steps once each, so a
# slow moment of the machine slows both alike, and each ratio is taken within a repeat):
#
# - the down projection of the `small` preset at batch 4 x 128 (`linear_forward`, $x W^\top$ with $W$ of shape
#   (h, f)) with an odd inner dimension $f = 447$ against $f = 448$;
# - the logits of a vocabulary of odd size, $V = 4001$, against the same vocabulary padded to a multiple of 64,
#   $V = 4032$ (`pad_to_multiple`, as nanoGPT pads GPT-2's): the padded one does 0.8% more FLOPs, and its rows
#   of logits start on 256-byte boundaries in fp32 where the odd one's start on 4-byte ones;
# - the scores $q k^\top$ of every head with q and k as strided views of the projections' output, (B, T, H, hd)
#   viewed as (B, H, T, hd), against the contiguous copies `picockpt/model/layer.py` makes: once at B = 1, where
#   `torch.matmul`'s fold of (B, H) into one batch dimension is a view, and once at B = 4, where it is a copy
#   (`_matmul_impl` in PyTorch's aten/src/ATen/native/LinearAlgebra.cpp expands each operand and calls
#   `.reshape({expand_batch_product, n, m1})` before `bmm`: `reshape` returns a view when the strides allow
#   one and copies when they do not);
# - `scaled_dot_product_attention` on the same strided views at B = 4 against contiguous copies: no copy is
#   dispatched for it (the fold lines after the timings record what each call dispatches).

# %%
VOCAB_ODD = 4001  # an odd vocabulary (GPT-2's 50,257 is odd too); padded: pad_to_multiple(4001, 64) = 4032


def odd_and_padded(tokens, hidden, ffn, odd_by=1):
    """{name: step()}: the down projection with ffn - odd_by and with ffn inputs."""
    steps = {}
    for name, f in (("odd f", ffn - odd_by), ("padded f", ffn)):
        x, w = torch.randn(tokens, f), torch.randn(hidden, f)  # (tokens, f), (h, f)
        steps[name] = lambda x=x, w=w: linear_forward(x, w)  # (tokens, h)
    return steps


def odd_and_padded_vocab(tokens, hidden, vocab=VOCAB_ODD, multiple=64):
    """{name: step()}: the head's logits x W^T with an odd vocabulary, and with it padded to `multiple`."""
    steps = {}
    x = torch.randn(tokens, hidden)  # (tokens, h): the final norm's output
    for name, v in (("odd V", vocab), ("padded V", pad_to_multiple(vocab, multiple))):
        w = torch.randn(v, hidden)  # (V, h): the head's weight
        steps[name] = lambda w=w: linear_forward(x, w)  # (tokens, V): row i starts i * V elements in
    return steps


def strided_heads(batch, seq, heads, head_dim):
    """(q, k): (B, H, T, hd) strided views of two (B, T, H, hd) projections' outputs."""
    q = torch.randn(batch, seq, heads, head_dim).transpose(1, 2)  # (B, H, T, hd) a strided view
    k = torch.randn(batch, seq, heads, head_dim).transpose(1, 2)  # (B, H, T, hd) a strided view
    return q, k


def strided_and_contiguous(batch, seq, heads, head_dim, tag=""):
    """{name: step()}: q k^T by torch.matmul over (B, H, T, hd) strided views of (B, T, H, hd), and over
    contiguous copies; each name ends in `tag` (e.g. " B=4")."""
    q, k = strided_heads(batch, seq, heads, head_dim)
    qc, kc = q.contiguous(), k.contiguous()  # (B, H, T, hd) each, as layer.py keeps them
    return {f"strided{tag}": lambda: q @ k.transpose(-1, -2),  # (B, H, T, T)
            f"contiguous{tag}": lambda: qc @ kc.transpose(-1, -2)}  # (B, H, T, T)


def sdpa_strided_and_contiguous(batch, seq, heads, head_dim):
    """{name: step()}: causal scaled_dot_product_attention over the strided views, and over contiguous copies."""
    q, k = strided_heads(batch, seq, heads, head_dim)
    qc, kc = q.contiguous(), k.contiguous()  # (B, H, T, hd) each
    return {"sdpa strided": lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True),  # (B, H, T, hd)
            "sdpa contiguous": lambda: F.scaled_dot_product_attention(qc, kc, kc, is_causal=True)}


def fold_is_a_view(batch, seq, heads, head_dim):
    """Whether matmul's fold of a strided (B, H, T, hd) view into (B*H, T, hd) shares the view's memory (the
    same data pointer: a view) or not (a copy), made as `_matmul_impl` makes it, by reshape."""
    q, _ = strided_heads(batch, seq, heads, head_dim)
    folded = q.reshape(batch * heads, seq, head_dim)  # (B*H, T, hd): what bmm is given
    return folded.data_ptr() == q.data_ptr()


def timed_pair(pair, device, repeats, calls, least=5e-3):
    """{name: Spread of seconds a call} of the two steps of `pair`, interleaved with each other only; each timed
    step repeats its call so that it lasts at least `least` seconds (one call of microseconds is mostly the
    clock's and the dispatcher's), and calls[name] records how many times."""
    once = interleaved_seconds(pair, device, 3, clock=compute_clock(device))  # a first look: how long one call takes
    n = max(1, math.ceil(least / min(spread.median for spread in once.values())))
    steps = {name: (lambda step=step: [step() for _ in range(n)]) for name, step in pair.items()}
    calls.update({name: n for name in pair})
    return {name: Spread(tuple(t / n for t in spread.samples))
            for name, spread in interleaved_seconds(steps, device, repeats, clock=compute_clock(device)).items()}


class Dispatched(TorchDispatchMode):
    """Records the name of every aten op that runs under it (below autograd: what the kernels are asked to do)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def copies_of_strided_heads(batch, seq, heads, head_dim):
    """{call: copies dispatched}: q k^T by torch.matmul and scaled_dot_product_attention on (B, H, T, hd) strided
    views of (B, T, H, hd); a copy is a `clone` or a `copy_` (matmul's fold of (B, H) into one batch dimension)."""
    q, k = strided_heads(batch, seq, heads, head_dim)
    calls = {"matmul": lambda: q @ k.transpose(-1, -2),  # (B, H, T, T)
             "sdpa": lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True)}  # (B, H, T, hd)
    copies = {}
    for name, call in calls.items():
        with Dispatched() as seen:
            call()
        copies[name] = sum(op in ("clone", "copy_", "contiguous") for op in seen.ops)
    return copies


# %%
args = lesson_args()
fast = args.mode == "fast"
if args.device.type != "cpu":
    print(f"--device {args.device}: the measured part runs on the CPU")
cfg = small()
batch, seq, repeats = choose(args.mode, fast=(4, 32, 1), cpu=(4, 128, 21), large=(4, 128, 31))
cpu = torch.device("cpu")
pairs = {"f": odd_and_padded(batch * seq, cfg.hidden, cfg.ffn), "V": odd_and_padded_vocab(batch * seq, cfg.hidden),
         "B=1": strided_and_contiguous(1, seq, cfg.heads, cfg.head_dim, " B=1"),
         f"B={batch}": strided_and_contiguous(batch, seq, cfg.heads, cfg.head_dim, f" B={batch}"),
         "sdpa": sdpa_strided_and_contiguous(batch, seq, cfg.heads, cfg.head_dim)}
timing, calls = {}, {}
for pair in pairs.values():  # each pair interleaved on its own: a big step just before a small one would evict its
    timing.update(timed_pair(pair, cpu, repeats, calls))  # operands from the caches, a cost of the order, not of it
print(f"measured on {device_name(cpu)}, fp32, T = {seq}, H = {cfg.heads}, hd = {cfg.head_dim}, median [min..max] of "
      f"{repeats} interleaved repeats of each pair, {clock_words(compute_clock(cpu))}, a call's time (a step repeats "
      f"the call to last 5 ms or more):")
for name, spread in timing.items():
    print(f"  {name:<16}{spread.text('{:.4f}', 1e3)} ms   ({calls[name]} call{'s' * (calls[name] > 1)} a step)")
odd_ratio = paired_ratios(timing["odd f"], timing["padded f"])
odd_claim = timed_claim(args.mode, odd_ratio, f"time, inner dimension f = {cfg.ffn - 1} / f = {cfg.ffn}", ">1")
print(odd_claim.text)
print(f"  by FLOPs the odd shape does {(cfg.ffn - 1) / cfg.ffn:.4f}x the padded one's work")
if odd_claim.conclusive:
    print(f"  the odd inner dimension costs {odd_ratio.median - 1:.1%} more time for less work")
padded_vocab = pad_to_multiple(VOCAB_ODD, 64)
vocab_ratio = paired_ratios(timing["odd V"], timing["padded V"])
vocab_claim = timed_claim(args.mode, vocab_ratio, f"time, logits V = {VOCAB_ODD:,} / V = {padded_vocab:,}", ">1")
print(vocab_claim.text)
print(f"  by FLOPs the odd vocabulary does {VOCAB_ODD / padded_vocab:.4f}x the padded one's work")
if vocab_claim.conclusive:
    print(f"  the padded vocabulary's logits take {1 / vocab_ratio.median:.3f}x the odd one's time for "
          f"{padded_vocab / VOCAB_ODD:.3f}x its FLOPs: padding pays on this CPU")
fold = {b: (fold_is_a_view(b, seq, cfg.heads, cfg.head_dim), copies_of_strided_heads(b, seq, cfg.heads, cfg.head_dim))
        for b in (1, batch)}
for b, (view, copies) in fold.items():
    print(f"  B = {b}: matmul's fold of the strided q into (B*H, T, hd) is {'a view' if view else 'a copy'}; copies "
          f"dispatched for q k^T on the strided views: matmul {copies['matmul']}, scaled_dot_product_attention "
          f"{copies['sdpa']}")
stride_ratio = {b: paired_ratios(timing[f"strided B={b}"], timing[f"contiguous B={b}"]) for b in (1, batch)}
stride_claim = timed_claim(args.mode, stride_ratio[batch],
                           f"time, q k^T on strided / contiguous heads at B = {batch} (matmul copies)", ">1", work=1.0)
print(stride_claim.text)
print(timing_verdict(args.mode, stride_ratio[1], "time, q k^T on strided / contiguous heads at B = 1 (no copy)"))
sdpa_ratio = paired_ratios(timing["sdpa strided"], timing["sdpa contiguous"])
print(timing_verdict(args.mode, sdpa_ratio, f"time, sdpa on strided / contiguous heads at B = {batch} (no copy)"))
if stride_claim.conclusive and not stride_ratio[1].excludes(1.0):
    print(f"  the strided views cost {stride_ratio[batch].median - 1:.1%} more at B = {batch}, where matmul copies "
          f"both operands, and nothing these repeats resolve at B = 1, where it copies neither: the price is the "
          f"fold's copy")
elif stride_claim.conclusive:
    print(f"  the strided views cost {stride_ratio[batch].median - 1:.1%} more at B = {batch}, where matmul copies "
          f"both operands; at B = 1, with no copy, the repeats agree on {stride_ratio[1].median - 1:+.1%}: what "
          f"the strided reads themselves cost")

# %% [markdown]
# The CPU's BLAS works on its own register tiles (a few rows by a few columns), with no tensor cores and no
# 16-byte rule for an odd dimension to break; whether an odd $f$ or an odd $V$ costs anything on this machine
# is what the first two verdicts say, when the repeats allow them to say anything. What the strided heads
# can cost is the copy they need, bytes, which lesson 26 prices: the fold lines record, by data pointer and by
# the ops dispatched, that at B = 4 `torch.matmul` copies both strided operands before its `bmm` and at
# B = 1 neither, and that `scaled_dot_product_attention` dispatches no copy at either; the three lines after
# them say what this machine's clock shows of it. On a GPU an odd vocabulary would also meet the rules above:
# its logits' rows misaligned for the tensor cores.
#
# ## The figure
#
# Left, tile efficiency against a dimension (256 x 128 tiles, modelled), with picockpt's dimensions marked.
# Middle, wave efficiency of Llama 3 8B's down projection on an H100 against the tokens in the batch
# (modelled). Right, the five measured time ratios of this CPU, each with its spread over the repeats.

# %%
fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1.1, 1.1, 1.1]})
dims = list(range(16, 4097))
left.plot(dims, [tile_efficiency(TILE[0], n) for n in dims], color="#4C72B0", lw=0.8, label="N: 128-wide tiles")
left.plot(dims, [tile_efficiency(m, TILE[1]) for m in dims], color="#DD8452", lw=0.8, alpha=0.7,
          label="M: 256-tall tiles")
marks = {"small: head_dim 32": 32, "small: h 128": 128, "small: f 448": 448, "odd: f 447": 447,
         "8B: kv heads x hd 1024": 1024, "8B: h 4096": 4096}
for label, n in marks.items():
    left.plot(n, tile_efficiency(TILE[0], n), "o", ms=5, color="#C44E52" if "odd" in label else "#333333")
left.set_xscale("log", base=2)
left.set_xlim(16, 2**16)  # room right of the curves for the names
left.set_xlabel("output dimension")
left.set_ylabel("tile efficiency (real output / computed)")
left.set_title("tile quantization, 256 x 128 tiles (modelled, the guide's rule)", fontsize=10)
left.legend(fontsize=7, loc="lower right")
left.grid(alpha=0.3)

llama8 = models["Llama 3 8B, 1 x 4096"][0]
token_counts = list(range(128, 16385, 128))
middle.plot(token_counts, [wave_efficiency(tiles(t, llama8.hidden)) for t in token_counts], color="#55A868", lw=1,
            label=f"H100, {H100_SMS} SMs")
middle.plot(token_counts, [wave_efficiency(tiles(t, llama8.hidden), A100_SMS) for t in token_counts], color="0.6",
            lw=0.8, label=f"A100, {A100_SMS} SMs")
middle.plot(4096, wave_efficiency(tiles(4096, llama8.hidden)), "o", color="#333333")
middle.annotate("s = 4096", (4096, wave_efficiency(tiles(4096, llama8.hidden))), fontsize=8, xytext=(5, -12),
                textcoords="offset points")
middle.set_xlabel("tokens in the batch (M)")
middle.set_ylabel("wave efficiency (SM slots used)")
middle.set_title(f"wave quantization, Llama 3 8B down projection (N = {llama8.hidden}),\n256 x 128 tiles, one per "
                 f"SM (modelled)", fontsize=10)
middle.legend(fontsize=7, loc="lower right")
middle.grid(alpha=0.3)

ratios = {f"f {cfg.ffn - 1} / {cfg.ffn}": odd_ratio, f"V {VOCAB_ODD} / {padded_vocab}": vocab_ratio,
          "matmul q k^T\nstrided / contig.\nB = 1 (view)": stride_ratio[1],
          f"matmul q k^T\nstrided / contig.\nB = {batch} (copy)": stride_ratio[batch],
          f"sdpa\nstrided / contig.\nB = {batch}": sdpa_ratio}
for x, ratio in enumerate(ratios.values()):
    right.bar(x, ratio.median, color="#8172B3", width=0.55)
    right.errorbar(x, ratio.median, yerr=[[ratio.median - ratio.low], [ratio.high - ratio.median]], color="black",
                   capsize=4)
right.axhline(1, color="0.4", lw=0.8)
right.set_xticks(range(len(ratios)), list(ratios), fontsize=7)
right.set_ylabel("time ratio (median, bar: min..max)")
right.set_title(f"measured on this CPU, fp32,\n{repeats} interleaved repeats" + (f"\n({FAST_TIMING})" if fast else ""),
                fontsize=10)
fig.suptitle("Layouts for recomputed matmuls: the tensor cores' quantization (modelled) and this CPU (measured)")
fig.tight_layout()
callouts(left, [(label, (n, tile_efficiency(TILE[0], n)), "#C44E52" if "odd" in label else "#333333")
                for label, n in marks.items()], x=6000, fontsize=7)
path = save_figure(fig, "27_tensor_core_layouts")
wrote(path)

# %% [markdown]
# ## Exercises
#
# **1.** The guide's tile-quantization example: a 257 x 256 output in 128 x 128 tiles. What fraction of the
# area the tiles compute is thrown away?

# %%
answer = 0.3307

# %%
check("the wasted share of a 257 x 256 output in 128 x 128 tiles", answer, 1 - tile_efficiency(257, 256, (128, 128)),
      why=f"{tiles(257, 256, (128, 128))} tiles of 128 x 128 = {tiles(257, 256, (128, 128)) * 128 * 128:,} computed "
          f"for {257 * 256:,} real outputs (256 x 256 needs {tiles(256, 256, (128, 128))} tiles)")

# %% [markdown]
# **2.** Llama 3 8B's down projection at one sequence of 4096 tokens (output 4096 x 4096) on an H100 SXM, with
# 256 x 128 tiles, one per SM at a time: what share of the SM slots of its waves does it use?

# %%
answer = 0.9697

# %%
count = tiles(4096, llama8.hidden)
check("wave efficiency of Llama 3 8B's down projection at 4096 tokens on an H100", answer, wave_efficiency(count),
      why=f"(4096 / 256) x (4096 / 128) = {count} tiles on {H100_SMS} SMs: {waves(count)} waves, "
          f"{count} of {waves(count) * H100_SMS} slots")

# %% [markdown]
# **3.** nanoGPT pads GPT-2's vocabulary of 50,257 to the nearest multiple of 64. To what size?

# %%
answer = 50304

# %%
check("GPT-2's vocabulary padded to a multiple of 64", answer, pad_to_multiple(50257, 64), rel=0,
      why=f"ceil(50257 / 64) = {pad_to_multiple(50257, 64) // 64} rows of 64: {pad_to_multiple(50257, 64) - 50257} "
          f"unused token ids, a multiple of 8 (16 bytes in bf16) as the tensor cores like it")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"time f-1 / f (odd / padded)": odd_claim.short,
                      "time odd / padded V": vocab_claim.short,
                      f"time strided / contiguous heads, B={batch}": stride_claim.short,
                      f"matmul fold is a view at B=1, a copy at B={batch}": fold[1][0] and not fold[batch][0],
                      "8B down proj. wave efficiency": round(wave_efficiency(count), 4),
                      "every 8B dim = multiple of 64": all(row["x64"] for row in
                                                            tables["Llama 3 8B, 1 x 4096"].values())}}

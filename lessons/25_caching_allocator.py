# %% [markdown]
# # Lesson 25: the caching allocator during recomputation: rounding, splitting, fragmentation
#
# Every lesson so far counted the bytes tensors ask for. A GPU shows more: PyTorch's **caching
# allocator** cuts tensors out of big device allocations (*segments*) that it keeps after the tensors
# are gone, so that the next request of a similar size costs no `cudaMalloc`. Three numbers of
# `torch.cuda.memory_stats()` tell the story, and this lesson follows all three:
#
# | number | what it counts | torch name |
# |---|---|---|
# | **requested** | the bytes the live tensors asked for: what the tracker measures | `requested_bytes` |
# | **allocated** | the blocks handed to them, rounding and unsplit remainders included | `allocated_bytes`, `memory_allocated()` |
# | **reserved** | every segment, busy or free | `reserved_bytes`, `memory_reserved()` |
#
# Reserved minus allocated is memory the pool holds free (*cached*), and unless a request fits one of
# its free blocks, that memory is of no use to it: fragmentation. `empty_cache()` gives back only
# segments that are entirely free (the CUDA semantics notes, "Memory management", and
# `torch.cuda.empty_cache`'s documentation), and under the default settings, apart from it, only a failing
# `cudaMalloc` makes the allocator give cached segments back (to retry): reserved bytes otherwise never fall
# (`garbage_collection_threshold`, the last section's setting, is the one that changes this).
#
# `picockpt/measurement/allocator.py` is a model of the allocator's rules as `c10/cuda/CUDACachingAllocator.cpp`
# writes them (PyTorch 2.13, the native backend, one stream), each rule one commented line naming its
# constant: `kMinBlockSize`, `kSmallSize`, `kSmallBuffer`, `kLargeBuffer`, `kMinLargeAlloc`,
# `kRoundLarge`, the best-fit search, splitting, merging, and `max_split_size_mb`. It replays a
# *trace*: the allocations and frees of one training step, in order and with their phase, which
# `picockpt/measurement/alloc_trace.py` reads from the same storage-watching the tracker does. A storage's bytes do
# not depend on the device, so a trace recorded on a CPU is what a GPU's allocator would be asked for,
# less the buffers some kernels take for themselves (the last section). The question for recomputation:
# a recompute phase frees tensors and asks for the same sizes again. Does the pool reuse them, and what
# does that do to the reserved peak, which is what decides an out-of-memory error?
#
# **Run it** as a script, `python lessons/25_caching_allocator.py` (the CPU run, seconds; `--fast` for
# a smaller shape, `--large --device cuda` on a GPU, where the model is also compared with the real
# allocator), or step through this notebook, where the same flags come from the environment variable
# `PICOCKPT_LESSON_ARGS` (unset: the CPU run).

# %%
import matplotlib.pyplot as plt

from _check import check
from _lesson import choose, large, lesson_args, shape_line, small, wrote
from picockpt import init_params
from picockpt.measurement.alloc_trace import only, record_step, step_on_cuda
from picockpt.measurement.allocator import MIB, CachingAllocator, pool_of, replay, round_size, segment_size, should_split
from picockpt.measurement.measure import make_batch
from picockpt.teaching.plotting import mib, phase_spans, policy_color, save_figure, shade_phases

POLICIES = ("none", "full", "every:2", "selective")
PHASES = ("forward", "recompute", "backward")

# %% [markdown]
# ## The rules, on three requests
#
# A request of `size` bytes goes through four steps in `DeviceCachingAllocator::malloc`:
#
# 1. **round** (`round_size`): up to a multiple of `kMinBlockSize` = 512 B, and never below it;
# 2. **pool** (`get_pool`): rounded sizes up to `kSmallSize` = 1 MiB go to the small pool, the rest to
#    the large one; the two pools never lend each other blocks;
# 3. **find a block** (`get_free_block`): the smallest free block of the pool that is big enough, the
#    lowest address among equal sizes; if none, a new segment (`alloc_block`, one `cudaMalloc`) of
#    `get_allocation_size`: `kSmallBuffer` = 2 MiB for a small request, `kLargeBuffer` = 20 MiB for one
#    under `kMinLargeAlloc` = 10 MiB, else the request rounded up to `kRoundLarge` = 2 MiB;
# 4. **split** (`should_split`): the rest of the block becomes a free block of its own when it is at
#    least 512 B (small pool) or *more than* 1 MiB (large pool); otherwise the tensor gets the whole
#    block, and `allocated` counts all of it.
#
# A freed block merges with a free neighbour in its segment (`free_block`, `try_merge_blocks`); blocks
# never merge across segments. Here are a 1,000-byte request, a 1.5 MiB one and a 12 MiB one, each in an
# empty pool:

# %%
def one_request(size):
    """What one request of `size` bytes does in an empty pool: the rules' steps and the three numbers."""
    rounded = round_size(size)
    pool = CachingAllocator()
    pool.malloc("t", size)
    return {"rounded": rounded, "pool": pool_of(rounded), "segment": segment_size(rounded),
            "split": should_split(segment_size(rounded), rounded), **pool.state()}


print(f"{'request':>14}{'rounded':>12}{'pool':>7}{'segment':>12}{'split':>7}{'requested':>12}{'allocated':>12}"
      f"{'reserved':>12}{'free rest':>12}")
for size in (1000, 3 * MIB // 2, 12 * MIB):
    row = one_request(size)
    print(f"{size:>14,}{row['rounded']:>12,}{row['pool']:>7}{row['segment']:>12,}{str(row['split']):>7}"
          f"{row['requested']:>12,}{row['allocated']:>12,}{row['reserved']:>12,}{row['cached']:>12,}")

# %% [markdown]
# 1,000 B becomes 1,024 B in a new 2 MiB small segment; the rest (2 MiB − 1 KiB) stays free for the
# next small tensors. 1.5 MiB needs no rounding but costs a 20 MiB segment: the next 1-to-10 MiB
# requests are cut from the 18.5 MiB left. 12 MiB gets a segment of exactly its size, nothing left over.
# The split rule makes the large pool lumpy: a tensor whose block would leave 1 MiB or less behind takes
# the whole block. Eleven tensors of 1.75 MiB (an MLP activation of this lesson's CPU shape) fill one
# 20 MiB segment: ten get 1.75 MiB, the eleventh gets the last 2.5 MiB.
#
# ## Reuse and fragmentation
#
# Freed blocks stay in the pool. Three 6 MiB tensors, the first and the third freed, then a request of
# 10 MiB: 14 MiB are free in the first segment, but in two pieces (6 MiB, and 8 MiB after merging with
# the 2 MiB rest), so the request needs a segment of its own.

# %%
pool = CachingAllocator()
steps = [("malloc", "a", 6 * MIB), ("malloc", "b", 6 * MIB), ("malloc", "c", 6 * MIB), ("free", "a", 0),
         ("free", "c", 0), ("malloc", "d", 10 * MIB), ("free", "b", 0), ("malloc", "e", 14 * MIB)]
print(f"{'':<18}{'allocated MiB':>14}{'reserved MiB':>13}{'cached MiB':>11}{'largest free':>13}  free blocks (MiB)")
for verb, key, size in steps:
    if verb == "malloc":
        pool.malloc(key, size)
    else:
        pool.free(key)
    state = pool.state()
    label = f"{verb} {key}" + (f" {mib(size):g} MiB" if size else "")
    print(f"{label:<18}{mib(state['allocated']):>14g}{mib(state['reserved']):>13g}{mib(state['cached']):>11g}"
          f"{mib(state['largest_free']):>13g}  {[mib(b.size) for b in pool.free_blocks()]}"
          f"{'  (new segment)' if verb == 'malloc' and pool.last == 'new segment' else ''}")

# %% [markdown]
# Once `b` goes, its segment is one free 20 MiB block again and serves the 14 MiB request without a
# `cudaMalloc`. Reserved bytes never fell: 30 MiB are held for 24 MiB of tensors at the end.
#
# ## One training step, replayed
#
# `record_step` runs `loss_and_grads` under a `Tracker` and reads its log as a trace: every storage the
# step creates (activations, working memory, gradients: the tracker's *total*) with its size and phase,
# and every free. The first check is that the replay's requested bytes are the tracker's to the byte,
# event by event: the model adds rounding and segments on top of what was measured, and nothing else.

# %%
def shape(mode):
    """(Config, batch, seq) of each run mode: at T = 256 the attention probabilities (4 MiB) and the MLP's
    (B, T, f) tensors (1.75 MiB) go to the large pool, the rest to the small one."""
    return choose(mode, fast=(small(layers=2), 2, 192), cpu=(small(), 4, 256), large=(large(layers=4), 2, 1024))


def growth(run, phase):
    """Reserved bytes the replay added in each run of consecutive `phase` events, in order."""
    rows, added = run.timeline, []
    for name, first, last in phase_spans(rows):
        if name == phase:
            added.append(rows[last]["reserved"] - (rows[first - 1]["reserved"] if first else 0))
    return added


def rounding_at_peak(trace, run):
    """(bytes that rounding up to kMinBlockSize adds, bytes that unsplit remainders add) at the requested peak."""
    index = run.at_peak("requested")["index"]
    blocks = [block for block in replay(trace[:index + 1]).pool.live.values() if block is not None]
    return (sum(round_size(b.requested) - b.requested for b in blocks),
            sum(b.size - round_size(b.requested) for b in blocks))


args = lesson_args()
cfg, batch, seq = shape(args.mode)
print(f"lesson 25, caching allocator: {shape_line(cfg, batch, seq, args.device)}")
params = init_params(cfg, seed=args.seed, device=args.device)
input_ids, targets = make_batch(cfg, batch, seq, args.device, args.seed)
traces, runs, equal_total, equal_physical = {}, {}, True, True
for policy in POLICIES:
    trace, tracker = record_step(params, cfg, input_ids, targets, policy)
    traces[policy], runs[policy] = trace, replay(trace)
    measured = [row["total"] for row in tracker.timeline if row["kind"] in ("alloc", "free")]  # after each event
    equal_total &= measured == [row["requested"] for row in runs[policy].timeline]
    equal_physical &= replay(only(trace)).peak("requested") == tracker.peak_physical
    print(f"{policy:<10} {len(trace):>5,} events, {sum(e.kind == 'alloc' for e in trace):,} allocations")
print(f"replay requested bytes = tracker total bytes after every event, every policy: {equal_total}")
print(f"replay of the activations alone = tracker physical peak, every policy: {equal_physical}")

# %% [markdown]
# ## The three numbers per policy
#
# At the moment the step's tensors ask for the most (the requested peak): how much the blocks handed out
# hold beyond what was asked (allocated − requested, the *slack*: rounding up to 512 B, and the remainder a
# block keeps when it is too small to split) and how much the pool holds free (reserved − allocated). Then the segments and
# where they were made, and how many of the recompute phases' requests the pool served from blocks it
# already had.

# %%
print(f"{'policy':<10}{'requested':>10}{'allocated':>10}{'reserved':>10}{'slack':>10}{'cached':>8}"
      f"{'largest':>10}{'segments':>13}{'new segments':>14}{'recompute from':>16}")
print(f"{'':<10}{'peak MiB':>10}{'peak MiB':>10}{'peak MiB':>10}{'MiB':>10}{'MiB':>8}{'free MiB':>10}"
      f"{'small/large':>13}{'fwd/rec/bwd':>14}{'the cache':>16}")
for policy, run in runs.items():
    top = run.at_peak("requested")
    pools = [s.pool for s in run.pool.segments]
    made = "/".join(str(run.new_segments.get(phase, 0)) for phase in PHASES)
    asked = run.cached.get("recompute", 0) + run.new_segments.get("recompute", 0)
    reuse = f"{run.cached.get('recompute', 0):,} of {asked:,}" if asked else "-"
    print(f"{policy:<10}{mib(top['requested']):>10.2f}{mib(run.peak('allocated')):>10.2f}"
          f"{mib(run.peak('reserved')):>10.2f}{mib(top['allocated'] - top['requested']):>10.2f}"
          f"{mib(top['reserved'] - top['allocated']):>8.2f}{mib(top['largest_free']):>10.2f}"
          f"{pools.count('small'):>8}/{pools.count('large'):<4}{made:>14}{reuse:>16}")
none, full = runs["none"], runs["full"]
print("\nreserved peak / requested peak: " + ", ".join(
    f"{p} {r.peak('reserved') / r.peak('requested'):.2f}x" for p, r in runs.items()))
to_512, remainders = rounding_at_peak(traces["none"], none)
print(f"none at its requested peak: rounding up to 512 B adds {to_512:,} B, unsplit remainders {mib(remainders):.2f} MiB")
for policy in ("full", "every:2"):
    run = runs[policy]
    print(f"{policy}: reserved MiB added by the forward {mib(sum(growth(run, 'forward'))):g}, by each recompute phase "
          f"{[mib(added) for added in growth(run, 'recompute')]}, by the backward {mib(sum(growth(run, 'backward'))):g}")
print(f"none reserves {mib(none.peak('reserved')):g} MiB, full {mib(full.peak('reserved')):g} MiB: "
      f"{none.peak('reserved') / full.peak('reserved'):.2f}x, against {none.peak('requested') / full.peak('requested'):.2f}x "
      f"in requested bytes")

# %% [markdown]
# What the table says, at the CPU shape (the printed lines give this run's numbers):
#
# - **Rounding to 512 B costs next to nothing, the split rule and the segments do.** Almost every size
#   here is a multiple of 512 B already (the scalars are the exception: the line on `none`'s peak). The
#   slack column, what `allocated` adds above `requested`, is unsplit remainders: the 1.75 MiB MLP tensors, eleven to a 20
#   MiB segment, the eleventh holding the last 2.5 MiB. The gap from allocated to reserved is larger:
#   free pieces of partly used 20 MiB and 2 MiB segments.
# - **Recomputation reuses the pool.** A recompute phase asks for the sizes the forward asked for, and by
#   then the backward has freed blocks of exactly those sizes: all but a few recompute requests are
#   served from the cache. Only the *first* recompute phase makes the pool grow, since the forward
#   stored little and the first rebuilt layers are the most the step has held so far (under `every:2`,
#   two layers' activations at once); every later recompute phase adds nothing.
#   From then on the micro-spikes of recomputation (the saw-tooth in the figure) rise and fall inside
#   memory that is already reserved.
# - **The policy's saving survives the allocator, in part.** Reserved bytes fall with the requested
#   ones, but by less (the last printed line): a step that stores little still pays for whole segments.
#
# ## The figure: requested, allocated and reserved over the step
#
# One panel per policy, x the trace's events, the phases shaded. Reserved is a staircase that never
# comes down; under `full` and `every:2` the recompute-backward saw-tooth runs beneath a flat line.

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 8), sharey=True)
for ax, (policy, run) in zip(axes.flat, runs.items()):
    x = [row["index"] for row in run.timeline]
    shade_phases(ax, run.timeline, legend=policy == "full")  # the panel with all three phases
    ax.plot(x, mib([row["requested"] for row in run.timeline]), color="0.55", lw=0.8, label="requested")
    ax.plot(x, mib([row["allocated"] for row in run.timeline]), color=policy_color(policy), lw=1.2,
            label="allocated")
    ax.step(x, mib([row["reserved"] for row in run.timeline]), where="post", color="k", lw=1.4, label="reserved")
    ax.set_title(f"{policy}: requested {mib(run.peak('requested')):.1f}, allocated {mib(run.peak('allocated')):.1f}, "
                 f"reserved {mib(run.peak('reserved')):.0f} MiB", fontsize=10)
    ax.set_xlabel("trace event (allocations and frees, in order)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
for ax in axes[:, 0]:
    ax.set_ylabel("MiB")
fig.suptitle(f"The caching allocator model replaying one step: L={cfg.layers}, h={cfg.hidden}, batch {batch} x {seq}, "
             f"{cfg.dtype}")
fig.tight_layout()
path = save_figure(fig, "25_caching_allocator")
wrote(path)

# %% [markdown]
# ## `max_split_size_mb`
#
# `PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N` (at least 20, `kLargeBuffer` in MiB, as
# `c10/core/AllocatorConfig.cpp` checks when it parses the setting) forbids splitting blocks of N MiB or more, and such an *oversize* free block serves no request
# smaller than N MiB (`get_free_block`), and a larger one only within `kLargeBuffer` of its size. The
# documentation calls it a last resort against fragmentation. At its smallest value the rule meets the
# 20 MiB segments: once a 20 MiB segment is wholly free again it is oversize itself, so the next 1-to-10
# MiB request opens a new segment instead of reusing it. The model, on the same traces (with no device
# limit, so no out-of-memory retry ever frees the oversize blocks):

# %%
for policy in ("none", "full"):
    run, limited = runs[policy], replay(traces[policy], max_split_size_mb=20)
    print(f"{policy:<6} reserved peak {mib(run.peak('reserved')):>6g} MiB by default, "
          f"{mib(limited.peak('reserved')):>6g} MiB with max_split_size_mb:20 "
          f"({limited.pool.device_mallocs} segments made instead of {run.pool.device_mallocs})")

# %% [markdown]
# ## The two settings to try first: `expandable_segments` and `garbage_collection_threshold`
#
# `max_split_size_mb` is the documented last resort. Two other settings of the same variable come first, and
# the model above simulates neither (both need a GPU; the section below is where a GPU run would show them):
#
# - **`expandable_segments:True`** is what torch's own out-of-memory error recommends: "If reserved but
#   unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid
#   fragmentation" (`c10/cuda/CUDACachingAllocator.cpp`; recent versions spell the variable
#   `PYTORCH_ALLOC_CONF`). torch's memory-management notes (docs/source/notes/cuda.rst, "Optimizing memory
#   usage with PYTORCH_CUDA_ALLOC_CONF") describe it: instead of one `cudaMalloc` per segment, sized to the
#   rounded request, the allocator reserves a virtual address range per stream and maps physical memory into
#   it as the segment grows. A freed block at a segment's end and the next, larger request then join; the
#   fixed-size segments of this model (2 MiB small, 20 MiB, or the request rounded to 2 MiB) and the
#   orphaned tails they leave stop being the shape of "reserved". The rounding of each block stays.
# - **`garbage_collection_threshold:t`** ($0 < t < 1$): when a request cannot be served from the cached
#   blocks and the reserved memory is above $t$ of what the process may use, the allocator releases the
#   cached blocks that have gone longest without reuse, without synchronizing the device, until usage is
#   back under $t$ (pytorch/pytorch pull request #74261, which added it; the same notes). It trims
#   "reserved", not "allocated", and it returns whole unused segments only: it does nothing for a segment
#   that one live block keeps.
#
# Both act on the gap between "reserved" and "allocated". Recomputation acts on "allocated" itself: the
# three numbers above show which of the two a job is short of before either knob is worth turning.

# %% [markdown]
# ## Against the real allocator (a GPU)
#
# On CUDA, `step_on_cuda` runs one warm-up step, empties the cache, starts the model from the real pool
# (`torch.cuda.memory_snapshot()`: the weights' segments and anything else alive, the same segments and
# blocks the snapshot viewer of "Understanding CUDA Memory Usage" draws), records one step and compares.
# What should agree exactly, and why some numbers may not:
#
# - **requested bytes at the end**: every live block is one the snapshot listed or a storage the tracker
#   saw, so these agree exactly;
# - **allocated and reserved peaks, segments**: equal as long as no kernel takes memory from the pool for
#   itself. Some do: cuBLAS keeps a workspace per handle and stream from its first matmul on
#   (`aten/src/ATen/cuda/CublasHandlePool.cpp`; the warm-up step puts it in the snapshot), a reduction
#   split over many thread blocks takes scratch space for the duration of one op, and library kernels
#   have buffers of their own. None of these is a tensor storage, so the trace cannot contain them; they
#   can only raise the measured allocated peak, and a block taken where the model put a tensor can move
#   later ones and cost a segment. New segments' addresses, which only break ties between free blocks
#   of equal size, are modelled as consecutive.
#
# To see the real allocator's own history of a step, block by block, `python -m picockpt measure --device
# cuda --memory-snapshot step.pickle` writes it for PyTorch's memory viewer (`picockpt/measurement/snapshot.py`).

# %%
if args.device.type == "cuda":
    for policy in POLICIES:
        numbers, _ = step_on_cuda(params, cfg, input_ids, targets, policy)
        print(f"{policy}:")
        for name, (model, measured) in numbers.items():
            verdict = "equal" if model == measured else f"differs by {measured - model:+,}"
            print(f"  {name:<22}{model:>16,} model{measured:>16,} measured  {verdict}")
else:
    print(f"no GPU here ({args.device}): the comparison with torch.cuda.memory_stats() needs CUDA; the model alone above")

# %% [markdown]
# ## Exercises
#
# The first two use the model alone; the third a step of the `small` model with L = 2 at batch 2 × 192
# tokens, whatever shape the run above used.

# %%
exercise = small(layers=2)
ex_params = init_params(exercise, seed=0)
ex_ids, ex_targets = make_batch(exercise, 2, 192, "cpu", 0)
ex_full = replay(record_step(ex_params, exercise, ex_ids, ex_targets, "full")[0])

# %% [markdown]
# **1.** In an empty pool, a tensor of 11 MiB + 1 byte: what does `torch.cuda.memory_allocated()` report,
# in bytes?

# %%
answer = 12 * 2**20  # bytes

# %%
probe = CachingAllocator()
probe.malloc("t", 11 * MIB + 1)
check("memory_allocated() for an 11 MiB + 1 B tensor", answer, probe.allocated, rel=0,
      why=f"rounded to {round_size(11 * MIB + 1):,} B (kMinBlockSize), a segment of {segment_size(round_size(11 * MIB + 1)):,} B "
          f"(over kMinLargeAlloc: rounded up to kRoundLarge); the rest, 1 MiB − 512 B, is not more than kSmallSize, "
          f"so the block is not split and the tensor holds all of it")

# %% [markdown]
# **2.** Twelve tensors of 1.75 MiB each, in an empty pool: how many bytes are reserved?

# %%
answer = 40 * 2**20  # bytes

# %%
probe = CachingAllocator()
for n in range(12):
    probe.malloc(n, 7 * MIB // 4)
check("reserved bytes for twelve 1.75 MiB tensors", answer, probe.reserved, rel=0,
      why=f"each costs a kLargeBuffer (20 MiB) segment when none has room; eleven fit the first (the eleventh takes "
          f"the last 2.5 MiB: a 0.75 MiB rest is not split off), the twelfth opens a second: "
          f"{probe.device_mallocs} segments, {probe.allocated:,} B allocated")

# %% [markdown]
# **3.** Under `full` (L = 2, batch 2 × 192), how many new segments do the recompute phases create?

# %%
answer = 1

# %%
asked = ex_full.cached.get("recompute", 0) + ex_full.new_segments.get("recompute", 0)
check("new segments in the recompute phases of full", answer, ex_full.new_segments.get("recompute", 0), rel=0,
      why=f"the recompute asks for {asked} blocks, of the sizes the forward asked for; {ex_full.cached.get('recompute', 0)} "
          f"come from blocks the pool already holds (the replay of the step's trace)")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"replay requested = tracker total, every event": equal_total,
                      "activations replay = tracker physical peak": equal_physical,
                      "reserved peak none / full / every:2 MiB": " / ".join(
                          f"{mib(runs[p].peak('reserved')):g}" for p in ("none", "full", "every:2")),
                      "slack at the none peak MiB": f"{mib(none.at_peak('requested')['allocated'] - none.at_peak('requested')['requested']):.2f}",
                      "full recompute served from the cache": f"{full.cached.get('recompute', 0)} of "
                      f"{full.cached.get('recompute', 0) + full.new_segments.get('recompute', 0)}"}}

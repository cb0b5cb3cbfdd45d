"""The memory explorer's arithmetic (lessons/01_memory_explorer): every number it shows, from picockpt's
closed forms, so it runs on a CPU in milliseconds and never runs a step.

    setup = Setup(model="llama3-70b", seq=8192, layer_level="full", tp=8, sp=True)
    parts = memory_parts(setup)          # {"weights": bytes, ..., "working memory": bytes} on one GPU
    curve = segment_curve(setup)         # {C: stored peak of every:C} on one GPU: the P(C) curve
    fit = cheapest_fit(setup)            # the least recompute that fits setup.capacity (the planner)

On one GPU (tp = 1) the stored activations are inventory.predicted_peak_bytes, to the byte; with
tensor parallelism, parallel/inventory.rank_peak_bytes of one rank. The rest:

    weights, gradients, optimizer state   picockpt's mixed precision: fp32 master weights (4 bytes per
                                          parameter, plus a 2-byte copy in bf16 compute), fp32
                                          gradients (4) and AdamW's two fp32 moments (8), as
                                          picockpt.device.step_bytes counts them; with tensor
                                          parallelism each rank holds 1/t of every matrix (norms whole);
                                          ZeRO over d data-parallel ranks divides the optimizer state
                                          by d (stage 1), the gradients too (2), the weights too (3: FSDP)
    working memory                        device.step_bytes's estimate, the one part that is not exact:
                                          4 fp32 copies of the largest transient tensor (the logits, a
                                          chunk of them, the T x T scores or the MLP's product), each 1/t
                                          of it per rank. Where the T x T scores are the largest, that is
                                          16 bytes per B·H·T² element; the engine's working memory
                                          measures 12 in fp32 and 10.5 in bf16 on a CPU
                                          (tests/test_explorer.py measures both), so it errs high by a
                                          third in fp32 and by half in bf16 (WORKING_T2_BYTES)

With p > 1 pipeline stages the explorer shows the first stage of 1F1B, the one that must fit: ceil(L/p)
layers and the embedding (the head's weights and activations are on the last stage), holding w
micro-batches at once (1F1B: w = p; Korthikanti et al. 2022, sec. 4.2.3). As lesson 16 measures, every
backward runs while the w - 1 others hold E each, what one micro-batch's forward leaves stored:

    stage peak = (w - 1) * E + one micro-batch's own peak

(parallel/pipeline_parallel/pp_forms.py's ChunkForms, to the byte; tests/test_explorer.py checks it).
"""
import dataclasses
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root: picockpt, no install

from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from picockpt import Config
from picockpt.model.config import PRESETS
from picockpt.planning.fit import WORKING_COPIES
from picockpt.planning.step_forms import chain_sizes, step_flops
from picockpt.parallel.pipeline_parallel.pp_forms import stage_chain
from picockpt.parallel.pipeline_parallel.pp_plan import end_of_forward_bytes, plan_in_flight
from picockpt.parallel.tensor_parallel.tp_forms import rank_chain, rank_flops, rank_sizes
from picockpt.parallel.tensor_parallel.tp_shard import check_tensor_parallel
from picockpt.planning.planner import least_budget, least_plan, model_chain, plan_chain
from picockpt.recompute.policy import OP_LEVEL

GIB = 2**30
MODELS = ("tiny", "small", "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "custom")
SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
CAPACITIES = {"80 GiB (A100, H100)": 80 * GIB, "140 GiB (H200)": 140 * GIB}  # what nvidia-smi reports, rounded down
PARTS = ("weights", "gradients", "optimizer state", "stored activations", "stored checkpoints",
         "segment being recomputed", "head (final norm, logits)", "other micro-batches in flight", "working memory")
STORED = PARTS[3:8]  # the exact closed forms of the activations; the weights' parts are exact too
ESTIMATED = ("working memory",)  # the one estimate, drawn hatched
COLORS = {"weights": "#4C72B0", "gradients": "#64B5CD", "optimizer state": "#8172B3",
          "stored activations": "#2F4858", "stored checkpoints": "#937860", "segment being recomputed": "#DD8452",
          "head (final norm, logits)": "#C44E52", "other micro-batches in flight": "#B07AA1",
          "working memory": "#CCCCCC"}
WORKING_T2_BYTES = {"float32": 12.0, "bfloat16": 10.5}  # measured working memory per B·H·T² element (CPU)
NAMED = ("none", "selective", "cheap", "full", "full+selective", "full+cheap")  # the fixed policies compared
ZERO_STAGES = {0: "nothing sharded", 1: "optimizer state sharded", 2: "optimizer state and gradients sharded",
               3: "weights, gradients and optimizer state sharded, as FSDP"}  # what Setup.zero shards over Setup.dp
MODEL_STATE = ("weights", "gradients", "optimizer state")


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything the explorer's controls set. The shape fields are used when model == "custom"."""
    model: str = "llama3-8b"
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336
    vocab: int = 128256
    seq: int = 4096
    batch: int = 1
    dtype: str = "bf16"
    attention: str = "eager"
    loss_chunk: int = 0             # tokens per chunk of the head and loss; 0: the whole logits
    layer_level: str = "none"       # none | full | every | budget
    segment: int = 2                # C of every:C
    op_level: str = "none"          # none | selective | cheap
    tp: int = 1
    sp: bool = False
    dp: int = 1                     # data-parallel ranks that ZeRO shards the model states over
    zero: int = 0                   # ZeRO stage: 0 shards nothing, 1 the optimizer state, 2 also gradients,
                                    # 3 also weights (the notebook's controls start at ZeRO-3 over dp = 8)
    stages: int = 1                 # pipeline stages p
    in_flight: int = 1              # micro-batches in flight on the stage m
    capacity: int = 80 * GIB        # bytes of one GPU

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    @property
    def policy(self):
        """The picockpt policy string of the fixed choices (budget: see cheapest_fit)."""
        layer = {"none": "", "full": "full", "every": f"every:{self.segment}", "budget": ""}[self.layer_level]
        op = "" if self.op_level == "none" else self.op_level
        return "+".join(part for part in (layer, op) if part) or "none"


def shape_of(model):
    """The shape fields of a preset, as the explorer's controls show them."""
    return {name: PRESETS[model][name] for name in SHAPE}


def model_config(setup):
    """The whole model's Config (ValueError naming the field when the shape cannot be)."""
    fields = dict(PRESETS[setup.model]) if setup.model != "custom" else {name: getattr(setup, name) for name in SHAPE}
    fields.update(max_seq=max(setup.seq, fields.get("max_seq", 0)), dtype=setup.dtype, attention=setup.attention,
                  loss_chunk=setup.loss_chunk)
    return Config(**fields)


def stage_config(setup):
    """The Config of one pipeline stage: ceil(L/p) of the model's layers."""
    cfg = model_config(setup)
    if not 1 <= setup.stages <= cfg.layers:
        raise ValueError(f"stages={setup.stages}: use 1 to L={cfg.layers} pipeline stages")
    if setup.in_flight < 1:
        raise ValueError(f"in_flight={setup.in_flight}: at least one micro-batch is in flight")
    if setup.tp > 1 or setup.sp:
        check_tensor_parallel(cfg, setup.tp, setup.sp, setup.seq)
    return cfg.replace(layers=math.ceil(cfg.layers / setup.stages))


def parameters_per_gpu(cfg, t=1, head=True):
    """Parameters one tensor-parallel rank holds: 1/t of every matrix, the norms whole. head=False: the first
    stage of a pipeline, without the final norm and the LM head (unless tied to the embedding)."""
    h, f, V = cfg.hidden, cfg.ffn, cfg.vocab
    untied_head = 0 if head or cfg.tie_embeddings else V * h // t + h  # the LM head and the final norm
    if t == 1:
        return cfg.num_params() - untied_head
    per_layer = (2 * h * h + 2 * h * cfg.kv_dim + 3 * h * f) // t + 2 * h  # q, o, k, v, the MLP | two norms
    return (1 if cfg.tie_embeddings else 2) * V * h // t + cfg.layers * per_layer + h - untied_head


def first_stage(setup):
    """True when the setup shows the first of several pipeline stages: no head there."""
    return setup.stages > 1


def sizes(setup, cfg=None):
    """(X, A, F) of one GPU: a layer input (a stored checkpoint), a layer stored whole, the head (0 on the
    first of several pipeline stages)."""
    cfg = cfg or stage_config(setup)
    unstored = OP_LEVEL.get(setup.op_level, frozenset())
    if setup.tp == 1:
        X, A, F = chain_sizes(cfg, setup.batch, setup.seq, unstored)
    else:
        X, _, A, F = rank_sizes(cfg, setup.batch, setup.seq, setup.tp, setup.sp, False, unstored)
    return X, A, 0 if first_stage(setup) else F


def stored_parts(L, C, X, A, F):
    """{part: bytes} of the store at its peak under every:C (C = None: every layer kept), the same max
    as inventory.predicted_peak_bytes: the end of the forward, n·X + F, or segment k's backward,
    k·X + n_k·A (n segments of n_k layers)."""
    if C is None:
        return {"stored activations": L * A, "head (final norm, logits)": F}
    n_layers = [min(C, L - start) for start in range(0, L, C)]
    moments = [{"stored checkpoints": len(n_layers) * X, "head (final norm, logits)": F}]
    moments += [{"stored checkpoints": k * X, "segment being recomputed": n * A} for k, n in enumerate(n_layers)]
    return max(moments, key=lambda moment: sum(moment.values()))  # the first of equal peaks


def end_of_forward(L, C, X, A):
    """E: what one micro-batch's forward leaves stored in the stage's layers (C = None: every layer whole)."""
    return L * A if C is None else math.ceil(L / C) * X


def working_bytes(cfg, batch, seq, t=1, logits=True):
    """picockpt.device.step_bytes's working memory, on one of t tensor-parallel ranks (logits=False: a stage
    without the head)."""
    tokens = batch * seq
    logit_rows = min(tokens, cfg.loss_chunk or tokens) if logits else 0
    key_rows = seq if cfg.attention == "eager" else min(seq, cfg.attention_tile)
    largest = max(logit_rows * cfg.vocab // t, batch * cfg.heads // t * seq * key_rows, tokens * cfg.ffn // t)
    return WORKING_COPIES * 4 * largest


def working_margin(cfg, batch, seq, t=1, logits=True):
    """How far the working-memory estimate lies above what the engine measures, as a fraction, when the T x T
    scores are the largest transient tensor (16 bytes per element against WORKING_T2_BYTES); None otherwise."""
    scores = batch * cfg.heads // t * seq * (seq if cfg.attention == "eager" else min(seq, cfg.attention_tile))
    if cfg.attention != "eager" or working_bytes(cfg, batch, seq, t, logits) != WORKING_COPIES * 4 * scores:
        return None
    return WORKING_COPIES * 4 / WORKING_T2_BYTES.get(cfg.dtype, 4 * WORKING_COPIES) - 1


def memory_parts(setup, policy=None):
    """{part: bytes} on one GPU, every part of PARTS, for `policy` (a picockpt policy string; default the
    setup's; "budget" plans for the room the GPU leaves, see cheapest_fit)."""
    cfg = stage_config(setup)
    params = parameters_per_gpu(cfg, setup.tp, head=not first_stage(setup))
    parts = dict.fromkeys(PARTS, 0)
    if setup.dp < 1 or setup.zero not in (0, 1, 2, 3):
        raise ValueError(f"dp={setup.dp}, zero={setup.zero}: use dp >= 1 and a ZeRO stage 0, 1, 2 or 3")
    shard = {part: setup.dp if setup.zero >= stage else 1
             for part, stage in (("optimizer state", 1), ("gradients", 2), ("weights", 3))}
    parts["weights"] = params * (6 if cfg.dtype in ("bfloat16", "float16") else 4) // shard["weights"]
    parts["gradients"] = params * 4 // shard["gradients"]
    parts["optimizer state"] = params * 8 // shard["optimizer state"]
    parts["working memory"] = working_bytes(cfg, setup.batch, setup.seq, setup.tp, logits=not first_stage(setup))
    policy = policy or (setup.policy if setup.layer_level != "budget" else "budget")
    if policy == "budget":
        plan = cheapest_fit(setup)["plan"]
        if plan is None:
            parts["stored activations"] = cheapest_fit(setup)["least"]
        else:
            E = getattr(plan, "end_of_forward", 0)
            parts["stored activations"] = plan.peak_bytes - (setup.in_flight - 1) * E
            parts["other micro-batches in flight"] = (setup.in_flight - 1) * E
        return parts
    from picockpt.recompute.policy import parse_policy
    parsed = parse_policy(policy, cfg)
    X, A, F = sizes(setup.replace(op_level=parsed.op_level or "none"), cfg)
    parts.update(stored_parts(cfg.layers, parsed.segment, X, A, F))
    parts["other micro-batches in flight"] = (setup.in_flight - 1) * end_of_forward(cfg.layers, parsed.segment, X, A)
    return parts


def model_state_by_stage(setup):
    """{stage: weights + gradients + optimizer state on one GPU} under ZeRO stages 0..3 over setup.dp."""
    return {stage: sum(memory_parts(setup.replace(zero=stage), "none")[part] for part in MODEL_STATE)
            for stage in ZERO_STAGES}


def zero_text(setup, short=False):
    """What the setup's ZeRO stage shards: 'ZeRO-3 over 8 data-parallel ranks (weights, ...)'; short: 'ZeRO-3 over 8'."""
    if setup.zero == 0 or setup.dp == 1:
        name = "no ZeRO" if setup.zero == 0 else f"ZeRO-{setup.zero} over 1 rank"
        return name if short else f"{name} ({ZERO_STAGES[0]}; the model state whole on every GPU)"
    name = f"ZeRO-{setup.zero} over {setup.dp}"
    return name if short else f"{name} data-parallel ranks ({ZERO_STAGES[setup.zero]})"


def stored_bytes(parts):
    return sum(parts[part] for part in STORED)


def segment_curve(setup):
    """{C: stored peak bytes on one GPU under every:C (with the setup's op level)}, C = 1..L of the stage."""
    cfg = stage_config(setup)
    X, A, F = sizes(setup, cfg)
    w = setup.in_flight
    return {C: sum(stored_parts(cfg.layers, C, X, A, F).values()) + (w - 1) * end_of_forward(cfg.layers, C, X, A)
            for C in range(1, cfg.layers + 1)}


def _chain(setup, cfg):
    if first_stage(setup):
        return stage_chain(cfg, setup.batch, setup.seq, cfg.layers, False, setup.tp, setup.sp)
    if setup.tp == 1:
        return model_chain(cfg, setup.batch, setup.seq)
    return rank_chain(cfg, setup.batch, setup.seq, setup.tp, setup.sp)


def step_model_flops(setup, cfg=None):
    """Forward + backward matmul FLOPs of one step on one GPU, without recomputation."""
    cfg = cfg or stage_config(setup)
    flops = step_flops(cfg, setup.batch, setup.seq) if setup.tp == 1 else \
        rank_flops(cfg, setup.batch, setup.seq, "none", setup.tp, setup.sp)
    return flops["forward"] + flops["backward"]


def recompute_flops(setup, policy, cfg=None):
    cfg = cfg or stage_config(setup)
    if setup.tp == 1:
        return step_flops(cfg, setup.batch, setup.seq, policy)["recompute"]
    return rank_flops(cfg, setup.batch, setup.seq, policy, setup.tp, setup.sp)["recompute"]


def _plan(chain, room, in_flight):
    """The planner's least-recompute plan whose stored peak fits room, for one micro-batch or w in flight
    ((w - 1)·E + peak, pp_plan.plan_in_flight); None when nothing fits."""
    if in_flight == 1:
        return plan_chain(chain, room) if room >= least_budget(chain) else None
    try:
        return plan_in_flight(chain, room, in_flight)
    except ValueError:  # nothing fits with this many micro-batches in flight
        return None


def cheapest_fit(setup):
    """What fits setup.capacity, and at what price. room: the bytes left for stored activations once the
    weights, gradients, optimizer state and working memory are in. Returns {room, least (the least stored
    peak the planner's least-peak plan needs, with the micro-batches in flight), plan (the planner's plan
    at room, or None), named (the fixed policy of least recompute that fits, or None), named_rows
    {policy: (stored, recompute)}, model_flops}."""
    cfg = stage_config(setup)
    fixed = memory_parts(setup, "full")
    others = sum(fixed[name] for name in ("weights", "gradients", "optimizer state", "working memory"))
    room = setup.capacity - others
    chain = _chain(setup, cfg)
    least = least_budget(chain) + (setup.in_flight - 1) * end_of_forward_bytes(chain, least_plan(chain).schedule)
    plan = _plan(chain, room, setup.in_flight)
    named_rows = {}
    for policy in NAMED + tuple(f"every:{C}" for C in (2, 3, 4)):
        if policy.startswith("every:") and int(policy[6:]) > cfg.layers:
            continue
        named_rows[policy] = (stored_bytes(memory_parts(setup, policy)), recompute_flops(setup, policy, cfg))
    fitting = [policy for policy, (stored, _) in named_rows.items() if stored <= room]
    named = min(fitting, key=lambda policy: (named_rows[policy][1], named_rows[policy][0])) if fitting else None
    return {"room": room, "least": least, "plan": plan, "named": named, "named_rows": named_rows,
            "model_flops": step_model_flops(setup, cfg)}


def describe_plan(plan):
    """'12 layers stored whole (10 all:selective, 2 all), 68 checkpoints, 0 neither' and the head's mode."""
    forward = plan.schedule.forward
    whole = [mode for mode in forward if mode.startswith("all")]
    kinds = {mode: whole.count(mode) for mode in sorted(set(whole))}
    text = f"{len(whole)} layer{'s' * (len(whole) != 1)} stored whole"
    if kinds:
        text += " (" + ", ".join(f"{count} {mode}" for mode, count in kinds.items()) + ")"
    text += f", {forward.count('input')} checkpoint{'s' * (forward.count('input') != 1)}"
    rest = forward.count("none")
    return text + (f", {rest} neither (recomputed from the checkpoint below)" if rest else "")


def gib(n):
    return f"{n / GIB:,.2f} GiB"


def draw(setup, bars_ax, curve_ax, title=True):
    """The two panels: stacked bars of every part for a few policies against the GPU's capacity, and
    the P(C) curve of every:C with its minimum marked against the room the GPU leaves."""
    fit = cheapest_fit(setup)
    policies = ["none", "selective" if setup.attention == "eager" else "cheap", "full"]
    curve = segment_curve(setup)
    best = min(curve, key=curve.get)
    policies += [f"every:{best}"] if best > 1 else []
    policies += [fit["named"]] if fit["named"] else []  # the cheapest fixed policy that fits
    yours = setup.policy if setup.layer_level != "budget" else "budget"
    rows = {policy: memory_parts(setup, policy) for policy in dict.fromkeys(policies + ["budget", yours])}
    labels = [policy if policy != "budget" else "budget\n(planner)" for policy in rows]
    bottom = [0.0] * len(rows)
    for part in PARTS:
        values = [row[part] / GIB for row in rows.values()]
        if any(values):
            estimate = part in ESTIMATED
            label = f"{part} (estimate{margin_text(setup)})" if estimate else part
            bars_ax.bar(range(len(rows)), values, bottom=bottom, color=COLORS[part], label=label, width=0.65,
                        hatch="///" if estimate else None, edgecolor="white" if estimate else None)
            bottom = [b + v for b, v in zip(bottom, values)]
    bars_ax.axhline(setup.capacity / GIB, color="black", lw=1.2, ls="--", label=f"GPU: {gib(setup.capacity)}")
    for x, total in enumerate(bottom):
        bars_ax.annotate(f"{total:,.1f}", (x, total), ha="center", va="bottom", fontsize=7)
    bars_ax.set_xticks(range(len(rows)), labels, fontsize=8)
    for tick, policy in zip(bars_ax.get_xticklabels(), rows):
        tick.set_fontweight("bold" if policy == yours else "normal")
    bars_ax.set_ylabel("GiB on one GPU")
    bars_ax.set_ylim(0, max(max(bottom), setup.capacity / GIB) * 1.18)
    bars_ax.legend(fontsize=7, loc="upper right")
    bars_ax.grid(alpha=0.3, axis="y")
    Cs = list(curve)
    curve_ax.plot(Cs, [curve[C] / GIB for C in Cs], "-o", ms=3, color="#DD8452",
                  label=f"P(C): stored peak of every:C{'+' + setup.op_level if setup.op_level != 'none' else ''}")
    curve_ax.plot([best], [curve[best] / GIB], "*", ms=15, color="gold", mec="black", zorder=5,
                  label=f"minimum: C = {best}, {gib(curve[best])}")
    if fit["room"] > 0:
        curve_ax.axhline(fit["room"] / GIB, color="black", ls="--", lw=1,
                         label="room left by weights, gradients,\noptimizer state and working memory")
    curve_ax.set_xscale("log")
    curve_ax.set_yscale("log")
    for axis in (curve_ax.xaxis, curve_ax.yaxis):  # plain numbers at 1, 2, 5, 10, ...
        axis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        axis.set_major_formatter(FormatStrFormatter("%g"))
        axis.set_minor_formatter(NullFormatter())
    curve_ax.set_xlabel("C, layers per segment")
    curve_ax.set_ylabel("GiB of stored activations")
    curve_ax.legend(fontsize=7)
    curve_ax.grid(alpha=0.3, which="both")
    if title:
        bars_ax.set_title(headline(setup), fontsize=9)
        curve_ax.set_title("the P(C) curve of every:C", fontsize=9)
    return fit


def margin_text(setup):
    """', errs high by 33% (fp32)' where the T x T scores set the working memory; '' otherwise."""
    cfg = stage_config(setup)
    margin = working_margin(cfg, setup.batch, setup.seq, setup.tp, logits=not first_stage(setup))
    return "" if margin is None else f", {margin:.0%} above the measured T² term in {cfg.dtype}"


def headline(setup):
    name = setup.model if setup.model != "custom" else "custom shape"
    parallel = f", tp={setup.tp}{' + sp' if setup.sp else ''}" if setup.tp > 1 else ""
    parallel += f", {zero_text(setup, short=True)}"
    staged = setup.stages > 1 or setup.in_flight > 1
    pipeline = f", stage 0 of {setup.stages}, {setup.in_flight} in flight" if staged else ""
    chunk = f", loss chunks of {setup.loss_chunk}" if setup.loss_chunk else ""
    return (f"{name}, {setup.dtype}, b={setup.batch} x s={setup.seq}, {setup.attention} attention{chunk}"
            f"{parallel}{pipeline}")

"""predict's data- and context-parallel rows: ZeRO's model state per GPU (its row: predict_zero.py), context
parallelism's activations per rank.

    python -m picockpt predict --model llama3-70b --seq 8192 --zero 3 --dp 8
    python -m picockpt predict --model llama3-405b --seq 8192 --zero 1 --dp 8 --tp 8 --sp --pp 16 --batch 16
    python -m picockpt predict --model mixtral-8x7b --seq 4096 --zero 3 --dp 2 --ep 8 --tp 2 --sp --recompute full
    python -m picockpt predict --model llama3-405b --seq 131072 --attention fused --cp 16 --recompute full

--zero N --dp D: one GPU's parameters, gradients and AdamW state under ZeRO stage N over D data-parallel ranks (beside
--tp, --cp and --pp: the busiest stage's rank, its tp slices sharded over D x C ranks), twice: as the ZeRO paper counts
them (zero_forms.zero_paper_parts: fp16 parameters and gradients, K = 12 bytes of Adam state per parameter) and as
picockpt holds them (model_state_bytes: fp32 parameters and gradients, AdamW's two fp32 moments, flat units padded to a
multiple of D), beside the activations of one rank's micro-batch (--batch sequences per rank: data parallelism does not
split them) and, under stage 3, the gathered parameters in flight; the total against --gpu-gib.

--cp C: one rank's activation store with every activation split over C ranks along the sequence
(cp_forms.cp_peak_bytes: the single process's inventory at n = T/C tokens, plus the other ranks'
K/V under --cp-comm allgather --keep-kv), for the --recompute policy and for every:C' at each C'. With
--tp t (and --sp) beside it, a rank is a tensor-parallel rank on n tokens (tp_forms.rank_peak_bytes at
T/C: the forms the tests hold tp x cp ranks to), its ring passing the K/V of its KV/t heads; with --pp P
(and --microbatches M) every stage's rank under 1F1B (pp_forms.ChunkForms), stage 0 the busiest.

    python -m picockpt predict --model llama3-405b --seq 131072 --attention fused --cp 16 --tp 8 --sp
    python -m picockpt predict --model llama3-405b --seq 131072 --attention fused --cp 16 --tp 8 --sp \
        --pp 16 --batch 16
"""
import math
from dataclasses import replace

from ..planning.cost import DEFAULT_HARDWARE, HARDWARE
from ..planning.published import GIB
from ..parallel.layout import Layout
from ..parallel.context_parallel.cp_forms import cp_peak_bytes, stage_comm_bytes
from ..parallel.context_parallel.cp_check import check_context_parallel
from ..parallel.pipeline_parallel.pp_forms import ChunkForms
from ..parallel.tensor_parallel.tp_forms import rank_peak_bytes
from ..parallel.tensor_parallel.tp_shard import check_tensor_parallel
from .common import spans
from .predict_layouts import cp_fits, cp_refusal, layouts_for
from .predict_pipeline import add_pipeline_arguments, check_schedule_flags, pipeline_row, print_pipeline
from .predict_zero import gib, print_zero, zero_row


WALK_LIMIT = 2**16  # pp x microbatches x virtual stages that predict walks in a few seconds (pp 8, M 8192: ~5 s)


def add_parallel_arguments(parser):
    parser.add_argument("--zero", type=int, choices=(1, 2, 3),
                        help="ZeRO stage: 1 shards the optimizer state over the --dp ranks, 2 the gradients too, "
                             "3 the parameters too (needs --dp D >= 2)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks D that --zero shards over (default 1)")
    parser.add_argument("--ep", type=int, default=1,
                        help="with --zero and --experts E: expert-parallel ranks, E/ep experts each (carved out of the "
                             "data-parallel ranks: the experts' shards over dp, every other weight's over dp x ep); "
                             "the activations for balanced routing, each expert N k / E rows (default 1)")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel ranks: every activation split over them along the sequence "
                             "(needs --attention tiled or fused; default 1)")
    parser.add_argument("--cp-comm", default="ring", choices=("ring", "ring_overlap", "allgather"),
                        help="how --cp ranks get the earlier K/V: a ring of cp - 1 steps (default; ring_overlap "
                             "moves the same bytes, each hop while the block before computes) or one all-gather")
    parser.add_argument("--keep-kv", "--cp-keep-kv", action="store_true",  # parallel's spelling too
                        help="--cp-comm allgather: keep the gathered K/V for the recomputation and the backward")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline stages: alone (beside --tp/--sp) every stage's store under --schedule and "
                             "the schedules side by side; beside --cp or --zero under 1F1B (stage s holds min(P - s, "
                             "M) micro-batches) (default 1)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="with --pp: micro-batches per step, splitting --batch (default: --pp, one sequence each "
                             "when --batch equals it)")
    add_pipeline_arguments(parser)  # --schedule, --virtual-stages (predict_pipeline.py)
    parser.add_argument("--gpu-gib", type=float, default=None,
                        help="GiB (2**30 bytes) of one GPU for the totals and --search's fit: a positive finite "
                             "number; default what the driver of the --hardware's GPU reports, all a program can "
                             "allocate: 79.65 on an h100 (the default), 140.40 on an h200, 80.00 on an a100. --search "
                             "accepts up to the datasheet's 80, 141 or 80 GB, which count binary gigabytes (GiB)")


def check_parallel(args, cfg, policy):
    """One-line ValueErrors for what predict cannot compute, before any work: each names the flag that is wrong."""
    gpu_bytes(gpu_gib(args))
    if args.zero is not None and args.dp < 2:
        raise ValueError(f"--zero {args.zero} with --dp {args.dp}: ZeRO shards over data-parallel ranks; "
                         f"give --dp D >= 2, e.g. --zero {args.zero} --dp 8")
    if args.zero is None and args.dp != 1:
        raise ValueError(f"--dp {args.dp} without --zero: plain data parallelism keeps the whole model state on "
                         f"every rank and does not split the activations; add --zero 1, 2 or 3 to shard it")
    if args.ep != 1:
        check_expert_flag(args, cfg)
    if args.cp < 1:
        raise ValueError(f"--cp={args.cp}: give a whole number of context-parallel ranks, 1 or more")
    check_pipeline(args, cfg)
    if args.cp == 1 and (args.cp_comm != "ring" or args.keep_kv):
        raise ValueError("--cp-comm or --keep-kv without --cp: they choose how context-parallel ranks share "
                         "K/V; add --cp C >= 2, or leave them out")
    if args.cp > 1:
        check_context(args, cfg, policy)
    elif (args.zero is not None or args.pp > 1) and args.tp > 1:
        check_tensor_parallel(cfg, args.tp, args.sp, args.seq, args.distribute_saved, experts=args.ep > 1)


def gpu_gib(args):
    """--gpu-gib, or when left out what the driver of the --hardware's GPU reports (an h100's without --search)."""
    if args.gpu_gib is not None:
        return args.gpu_gib
    return HARDWARE[hardware_name(args)].reported / GIB


def hardware_name(args):
    """--hardware, or the default GPU when it is left out (None tells the checks it was not given)."""
    return args.hardware or DEFAULT_HARDWARE


def gpu_bytes(gib):
    """--gpu-gib in bytes, a whole number; a ValueError naming the flag unless it is positive and finite in bytes too
    (1e308 GiB is a finite float, and infinite once counted in bytes)."""
    if not 0 < gib * GIB < float("inf"):
        raise ValueError(f"--gpu-gib={gib:g}: give one GPU's memory as a positive finite number of GiB (finite in "
                         f"bytes too), e.g. --gpu-gib 80")
    return int(gib * GIB)


def check_expert_flag(args, cfg):
    """--ep: beside --zero, on a mixture of experts it divides, not beside --cp."""
    ep, E = args.ep, cfg.experts
    if ep < 1:
        raise ValueError(f"--ep={ep}: give a whole number of expert-parallel ranks, 1 or more")
    if args.zero is None:
        raise ValueError(f"--ep {ep} without --zero: predict computes expert parallelism beside ZeRO only; add "
                         f"--zero 1, 2 or 3 (and --dp D), or run `python -m picockpt parallel --ep {ep}` to measure it")
    if not E or E % ep:
        raise ValueError(f"--ep {ep} with --experts {E}: each rank holds E/ep whole experts; give --experts a "
                         f"multiple of {ep}")
    if args.cp > 1:
        raise ValueError(f"--ep {ep} with --cp {args.cp}: expert parallelism beside context parallelism is not built; "
                         f"leave out one of them")
    if args.keep_kv or args.distribute_saved:
        raise ValueError(f"--ep {ep} with {'--keep-kv' if args.keep_kv else '--distribute-saved'}: not closed-formed "
                         f"beside expert parallelism; leave it out")


def check_pipeline(args, cfg):
    """--pp and --microbatches: stages beside --cp, micro-batches that split --batch."""
    pp, M, batch = args.pp, args.microbatches, args.batch
    if not 1 <= pp <= cfg.layers:
        raise ValueError(f"--pp={pp}: give 1 to {cfg.layers} stages (the model's layers)")
    if M is not None and M < 1:
        raise ValueError(f"--microbatches={M}: give a whole number of micro-batches, 1 or more (they split --batch)")
    if M is not None and pp == 1:
        raise ValueError(f"--microbatches {M} without --pp: micro-batches are what pipeline stages pass along, and "
                         f"predict computes them beside --pp P >= 2 only; {_pipeline_example(args, cfg)}, or leave "
                         f"--microbatches out")
    check_schedule_flags(args, cfg)  # predict_pipeline.py
    if pp == 1:
        return
    M = M or pp
    if pp * M * args.virtual_stages > WALK_LIMIT:
        most = WALK_LIMIT // (pp * args.virtual_stages)
        raise ValueError(f"--microbatches {M} with --pp {pp}" + (f" and --virtual-stages {args.virtual_stages}" if
                         args.virtual_stages > 1 else "") + f": predict walks every stage's order of forwards and "
                         f"backwards, for each schedule it compares, and past {WALK_LIMIT:,} micro-batch-stages that "
                         f"takes minutes; use --microbatches {most:,} or fewer (its bubble is already "
                         f"{(pp - 1) / (most + pp - 1):.2%} of the step)")
    divisors = ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)
    if batch % M and args.microbatches is None:
        raise ValueError(f"--batch {batch} with --pp {pp}: --pp's {pp} micro-batches (--microbatches defaults to "
                         f"--pp) split --batch, so it must be a multiple of {pp}; use --batch {pp} (or "
                         f"{2 * pp}, ...), or --microbatches M dividing {batch} ({divisors})")
    if batch % M:
        raise ValueError(f"--microbatches {M} does not divide --batch {batch}: each micro-batch takes --batch / M "
                         f"sequences; use --microbatches {divisors}, or --batch a multiple of {M} (e.g. --batch {M})")
    if args.keep_kv:
        raise ValueError("--keep-kv with --pp: the kept K/V are not closed-formed beside pipeline stages yet; "
                         "leave out --keep-kv (or --pp)")


def _pipeline_example(args, cfg):
    """Flags that make predict compute stages for this model, or why none can."""
    cp = args.cp if args.cp > 1 else next((c for c in range(2, 65) if cp_fits(cfg, args.seq, c)), None)
    if cp is None or cfg.layers < 2:
        why = cp_refusal(cfg, args.seq, 2) if cfg.layers >= 2 else f"the model has {cfg.layers} layer"
        return f"predict cannot split this model into stages ({why})"
    pp = args.pp if args.pp > 1 else 2
    M = args.microbatches or pp
    batch = args.batch if args.batch % M == 0 else M
    attention = " --attention fused" if cfg.attention == "eager" else ""
    return f"e.g. --cp {cp} --pp {pp} --microbatches {M} --batch {batch}{attention}"


def check_context(args, cfg, policy):
    """--cp C > 1: what context parallelism takes, each refusal naming its own flag; then the library's checks."""
    cp, seq = args.cp, args.seq
    if cfg.attention == "eager":
        raise ValueError(f"--cp {cp} with --attention eager: eager attention keeps the probabilities and has no "
                         f"log-sum-exp to merge the ranks' blocks with; add --attention fused (or tiled)")
    refusal = cp_refusal(cfg, seq, cp)
    if refusal is not None and seq % (2 * cp) == 0:  # the model's, not the sequence's: other layouts of cp ranks
        raise ValueError(f"{refusal}; {layouts_for(cfg, seq, cp)}")
    if refusal is not None:
        fits = ", ".join(str(c) for c in range(2, 65) if cp_fits(cfg, seq, c))
        raise ValueError(f"--seq {seq} with --cp {cp}: zigzag cuts each sequence into 2 x cp = {2 * cp} equal chunks "
                         f"(a front and a back one per rank); use --seq {seq + 2 * cp - seq % (2 * cp)} (a multiple "
                         f"of {2 * cp})" + (f", or --cp {fits}, which --seq {seq} allows" if fits else ""))
    if args.keep_kv and args.cp_comm != "allgather":
        raise ValueError("--keep-kv with --cp-comm ring: it keeps the all-gathered K/V of the other ranks; add "
                         "--cp-comm allgather, or leave --keep-kv out (the ring passes the blocks round again)")
    if args.tp > 1 and args.keep_kv:
        raise ValueError(f"--keep-kv with --tp {args.tp}: the kept K/V are not closed-formed beside tensor "
                         f"parallelism yet; leave out --keep-kv (or --tp)")
    tp, n = args.tp, seq // cp
    if tp > 1 and args.sp and n % tp:
        need = math.lcm(2 * cp, cp * tp)  # 2 x cp zigzag chunks; cp x tp ranks of equal tokens
        raise ValueError(f"--seq {seq} with --cp {cp} --tp {tp} --sp: sequence parallelism splits each context-"
                         f"parallel rank's {n:,} tokens over the {tp} tensor-parallel ranks, so --seq must be a "
                         f"multiple of {need} (of 2 x cp for the zigzag chunks and of cp x tp); use --seq "
                         f"{need * -(-seq // need)}, or leave out --sp")
    if tp > 1:
        try:
            check_tensor_parallel(cfg, tp, args.sp, n, args.distribute_saved)
        except ValueError as error:
            raise ValueError(f"--tp {tp} beside --cp {cp}: {error}; {layouts_for(cfg, seq, tp * cp, args.sp)}") \
                from None
    check_context_parallel(cfg, cp, seq, "zigzag", args.cp_comm, args.keep_kv, policy)


def cp_row(cfg, batch, seq, policy, layout):
    """One of layout.cp context-parallel ranks (of tp ranks each, beside tensor parallelism): its store's peak under
    `policy` and under every:C for C = 1..L, and its communication per phase (K/V, and the tp collectives).
    Beside pp, the peak and the communication are stage 0's (1F1B's busiest: it holds the most micro-batches);
    stage_peak_bytes lists every stage's peak."""
    cp, tp, sp, pp, M = layout.cp, layout.tp, layout.sp, layout.pp, layout.microbatches
    cp_comm, keep_kv, n = layout.cp_comm, layout.cp_keep_kv, seq // cp

    def stages(p):  # every stage's rank on its n tokens (pipeline_parallel/pp_forms.py), 1F1B
        return [ChunkForms(cfg, batch, n, p, layout, s).peak_bytes for s in range(pp)]

    def peak(p):  # beside tp: the tensor-parallel rank's store on its n tokens; beside pp: the busiest stage's
        if pp > 1:
            return max(stages(p))
        return cp_peak_bytes(cfg, batch, seq, p, cp, cp_comm, keep_kv) if tp == 1 else \
            rank_peak_bytes(cfg, batch, n, p, tp, sp, layout.distribute_saved)
    largest_C = -(-cfg.layers // pp)  # every:C within the largest stage
    comm = stage_comm_bytes(ChunkForms(cfg, batch, n, policy, layout, 0), seq, cp, cp_comm, keep_kv)  # stage 0's rank
    return {"cp": cp, "tp": tp, "sp": sp, "pp": pp, "microbatches": M, "cp_comm": cp_comm, "keep_kv": keep_kv,
            "rank_tokens": n, "policy": policy, "peak_bytes": peak(policy),
            "stage_peak_bytes": stages(policy) if pp > 1 else None,
            "every_peak_bytes": {C: peak(f"every:{C}") for C in range(1, largest_C + 1)}, "comm_bytes": comm}


def add_parallel_rows(row, args, cfg, policy):
    layout = Layout(dp=args.dp, pp=args.pp, tp=args.tp, ep=args.ep, cp=args.cp, zero=args.zero or 0,
                    microbatches=args.microbatches or args.pp, schedule=args.schedule,
                    virtual_stages=args.virtual_stages, sp=args.sp, distribute_saved=args.distribute_saved,
                    cp_comm=args.cp_comm, cp_keep_kv=args.keep_kv)  # one rank of each stage: dp splits no batch
    one_f_one_b = replace(layout, schedule="1f1b", virtual_stages=1)  # ZeRO's and cp's rows price 1F1B
    if args.zero is not None:
        row["zero"] = zero_row(cfg, args.batch, args.seq, policy, one_f_one_b)
    if args.cp > 1:
        row["cp"] = cp_row(cfg, args.batch, args.seq, policy, replace(one_f_one_b, dp=1))
    if args.pp > 1 and args.cp == 1 and args.zero is None:
        row["pipeline"] = pipeline_row(cfg, args.batch, args.seq, policy, replace(layout, dp=1))
    row["gpu_bytes"] = gpu_bytes(gpu_gib(args))


def print_parallel(row):
    capacity = row["gpu_bytes"]
    if "zero" in row:
        print_zero(row, capacity)
    if "pipeline" in row:
        print_pipeline(row)
    if "cp" in row:
        c = row["cp"]
        every = c["every_peak_bytes"]
        best = min(every, key=every.get)
        fitting = [C for C, n in every.items() if n <= capacity]
        comm = c["comm_bytes"]
        beside = f", each of tp = {c['tp']}{' with sp' if c['sp'] else ''}" if c["tp"] > 1 else ""
        beside += f", pp = {c['pp']} stages of 1F1B over {c['microbatches']} micro-batches" if c["pp"] > 1 else ""
        print(f"context parallel over {c['cp']} ranks ({c['cp_comm']}{', K/V kept' if c['keep_kv'] else ''}, "
              f"zigzag{beside}), per rank: {c['rank_tokens']:,} tokens (parallel/context_parallel/cp_forms.py: "
              f"the activation store only, no weights, working memory or K/V blocks in flight):")
        print(f"  {c['policy']}: {gib(c['peak_bytes'])} stored{' on stage 0, the busiest' if c['pp'] > 1 else ''}; "
              f"communication forward {gib(comm['forward'])}, recompute {gib(comm['recompute'])}, backward "
              f"{gib(comm['backward'])}")
        if c["pp"] > 1:
            print("  per stage: " + ", ".join(f"{s} {gib(n)}" for s, n in enumerate(c["stage_peak_bytes"])))
        print(f"  every:C: least at C = {best}, {gib(every[best])}; C = 1 (full) {gib(every[1])}; "
              f"C = {len(every)} {gib(every[len(every)])}")
        print(f"  activations alone in {gib(capacity)}: " + (
            f"every:C fits for C = {spans(dict.fromkeys(fitting, ''))}" if fitting else "no every:C fits"))

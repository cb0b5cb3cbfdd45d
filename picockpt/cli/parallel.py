"""python -m picockpt parallel: one step of a parallel layout (tensor parallel alone by default), measured per rank.

Spawns dp x pp x ep x cp x tp ranks on 127.0.0.1 (gloo on the CPU, NCCL with one GPU per rank), or runs as one
of torchrun's processes, and prints a section for every dimension that ran (tensor, pipeline and data, expert,
context parallelism: REPORT), each a table per rank: the activation store's peak and its closed form, the peak of
live bytes, the bytes its collectives moved in each phase (with their closed form), its FLOPs by phase and what
that dimension adds; then the loss, and how far the gradients are from the single-process engine's.
--zero S stacks on any of them: the same step with the model state sharded over the dp x ep x cp ranks
and one AdamW step on the shards, ZeRO's own table below the layout's (parallel_zero.py).

    python -m picockpt parallel --tp 2 --sp --policy selective
    python -m picockpt parallel --tp 2 --policy full --distribute-saved --json
    torchrun --nproc-per-node 2 -m picockpt parallel --tp 2
    python -m picockpt parallel --ep 2 --experts 4 --policy full --keep-dispatched   # expert parallel
    python -m picockpt parallel --dp 2 --zero 3 --policy full --keep-gathered        # ZeRO-3
    python -m picockpt parallel --dp 2 --zero 2 --tp 2 --pp 2 --microbatches 2       # ZeRO-2 on 8 ranks
    python -m picockpt parallel --pp 2 --microbatches 4 --schedule zb-h1            # B and W apart
    python -m picockpt parallel --pp 2 --microbatches 4 --schedule interleaved --virtual-stages 2
    python -m picockpt parallel --cp 2 --attention tiled --policy full                # context parallel
"""
from ..parallel.pipeline_parallel.pp_schedules import SCHEDULES
from .common import add_run_args, add_shape_args, fmt_bytes, fmt_flops, rank_columns, table
from ..parallel.launch import check_timeout
from .parallel_cp import print_context
from .parallel_ep import expert_row, print_expert
from .parallel_run import add_timeout, layout_words, measured_step, one_line_errors, prepared, printed

def add_arguments(parser):
    add_shape_args(parser, batch_help="sequences in the whole batch, split over the dp x ep ranks and --microbatches "
                   "(a rank computes batch / (dp x ep x M) of them at a time)")
    add_run_args(parser)
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks t (default 2 alone, 1 with --pp, "
                        "--dp or --microbatches); t must divide the heads, the kv heads, the ffn and the vocabulary")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism: norms, residual adds and dropout "
                        "on T/t tokens per rank (--seq must be a multiple of --tp)")
    parser.add_argument("--policy", default="full", help="recomputation policy, as everywhere (default full); "
                        "budget:SIZE is per rank")
    parser.add_argument("--distribute-saved", action="store_true", help="without --sp: each rank keeps 1/t of "
                        "every checkpoint (Megatron's --distribute-saved-activations), all-gathered to recompute")
    add_timeout(parser)
    parser.add_argument("--port", type=int, help="spawned ranks: the 127.0.0.1 port to meet on (default: a free one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--trace", action="store_true", help="print every rank's engine events, prefixed by rank")
    parser.add_argument("--verbose", action="store_true", help="a rank's failure with every failed rank's traceback "
                        "below it (without: one line, naming the rank and its last frame)")
    pipeline = parser.add_argument_group("pipeline and data parallelism (dp x pp x tp ranks)")
    pipeline.add_argument("--pp", type=int, default=1, help="pipeline stages P (default 1); layers split over them")
    pipeline.add_argument("--microbatches", type=int, default=1, help="micro-batches M per step (default 1); "
                          "--batch must be a multiple of dp x M")
    pipeline.add_argument("--schedule", default=None, choices=SCHEDULES, help="afab: all forwards then all "
                          "backwards; 1f1b: one forward one backward (the default); interleaved: 1F1B over "
                          "--virtual-stages chunks of layers per rank (M a multiple of P); zb-h1: 1F1B with each "
                          "backward split into B (input gradient) and W (weight gradients), the W's filling the "
                          "bubble (needs --pp)")
    pipeline.add_argument("--virtual-stages", type=int, default=1, help="--schedule interleaved: chunks of layers V "
                          "per rank, chunk c of rank s being virtual stage c P + s (default 1; P x V <= --layers)")
    pipeline.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    pipeline.add_argument("--recompute-early", action="store_true", help="a stage waiting for a gradient "
                          "recomputes that micro-batch's top segment meanwhile")
    pipeline.add_argument("--no-overlap", action="store_true", help="data parallel: all-reduce the gradients after "
                          "the backward instead of each layer's as soon as it is final")
    pipeline.add_argument("--zero", type=int, default=0, choices=(1, 2, 3), help="ZeRO over the data-parallel ranks "
                          "(dp x ep x cp of them; beside --tp, --pp, --microbatches too): 1 shards the AdamW state, "
                          "2 also the gradients, 3 also the parameters (gathered around each use); one AdamW step")
    pipeline.add_argument("--keep-gathered", nargs="?", const=True, default=False, choices=("step",),
                          help="--zero 3: a recomputed layer's gathered parameters are kept from its recompute "
                          "through its backward (one gather fewer); --keep-gathered step: every unit kept from its "
                          "first use of the step to its last, so no micro-batch gathers it again (torchtitan's "
                          "default beside --pp)")
    pipeline.add_argument("--no-prefetch", action="store_true", help="--zero 3: gather each use's parameters only "
                          "when it starts, not while the one before computes")
    experts = parser.add_argument_group("expert parallelism (picockpt/parallel/expert_parallel/; needs --experts; "
                                        "beside --dp and --pp too)")
    experts.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (default 1: none); each holds "
                         "experts/ep experts and 1/ep of each micro-batch's sequences; dp x pp x ep ranks in all")
    context = parser.add_argument_group("context parallelism (picockpt/parallel/context_parallel/; tiled or fused "
                                        "attention; beside --tp, --dp and --pp too)")
    context.add_argument("--cp", type=int, default=1, help="context-parallel ranks (default 1: none); each holds "
                         "1/cp of every sequence's tokens and of every activation; dp x pp x cp x tp ranks in all")
    context.add_argument("--cp-layout", default="zigzag", choices=("zigzag", "contiguous"), help="zigzag: rank r "
                         "holds chunks r and 2cp-1-r of 2cp (causal work balanced); contiguous: chunk r of cp")
    context.add_argument("--cp-comm", default="ring", choices=("ring", "ring_overlap", "allgather"), help="K/V "
                         "passed round a ring (cp - 1 steps; ring_overlap: each step sent while a block is computed), "
                         "or all-gathered once per layer (the Llama 3 paper's choice)")
    context.add_argument("--cp-keep-kv", "--keep-kv", action="store_true",  # predict's spelling too
                         help="--cp-comm allgather: keep the gathered K/V for the recomputation and the backward "
                              "instead of gathering them again")
    experts.add_argument("--keep-dispatched", action="store_true", help="keep the rows each rank's experts "
                         "received: recomputing a layer reads them instead of dispatching them again")


def check_flags(args):
    """A flag that belongs to a layout not asked for is an error, never silently ignored (what is left, a layout
    that does not compose with another, the job refuses: every layout flag reaches it, parallel_run.layout_of)."""
    check_timeout(args.timeout)  # timeout_s, said as --timeout (parallel_run.as_flags)
    if args.keep_dispatched and args.ep == 1:
        raise ValueError("--keep-dispatched without --ep: it keeps the rows an expert-parallel layer dispatched to "
                         "other ranks' experts; add --ep N (N > 1, dividing --experts), or leave it out")
    for flag, given, needs, wanted, what in (
            ("--schedule", args.schedule is not None, args.pp > 1 or args.microbatches > 1,
             "--pp P or --microbatches M (> 1)", "the order of micro-batches' forwards and backwards"),
            ("--virtual-stages", args.virtual_stages != 1, args.schedule == "interleaved",
             "--schedule interleaved", "how many chunks of layers an interleaved pipeline's rank holds"),
            ("--recompute-early", args.recompute_early, args.pp > 1, "--pp P (P > 1)", "a pipeline stage's waits"),
            ("--no-overlap", args.no_overlap, args.dp * args.ep * args.cp > 1, "--dp D (D > 1) or --ep/--cp N (N > 1)",
             "a data-parallel all-reduce"),  # under --zero the job refuses it
            ("--zero", args.zero, args.dp * args.ep * args.cp > 1, "--dp D, --ep N or --cp N (more than one rank "
             "in dp x ep x cp)", "how the model state is sharded over the data-parallel ranks (ZeRO shards over "
             "dp x ep x cp of them)"),
            ("--keep-gathered", args.keep_gathered, args.zero == 3, "--zero 3", "when ZeRO-3 gathers parameters"),
            ("--no-prefetch", args.no_prefetch, args.zero == 3, "--zero 3", "when ZeRO-3 gathers parameters")):
        if given and not needs:
            raise ValueError(f"{flag} without {wanted}: it changes {what}, and there is none here; add {wanted}, "
                             f"or leave {flag} out")
    alone = (args.pp, args.microbatches, args.dp, args.ep, args.cp, args.zero) == (1, 1, 1, 1, 1, 0)
    tp = args.tp if args.tp is not None else 2 if alone else 1
    for flag, given in (("--sp", args.sp), ("--distribute-saved", args.distribute_saved)):
        if given and tp == 1 and args.ep == 1:
            default = ", the default beside --pp/--dp/--microbatches" if args.tp is None else ""
            raise ValueError(f"{flag} with a tensor-parallel size of 1 (--tp 1{default}): it splits a tensor-parallel "
                             f"rank's tokens or checkpoints, and there is none here; add --tp N (N > 1), or leave "
                             f"{flag} out")
    if args.ep > 1 and args.sp and tp == 1:  # --sp needs tensor-parallel ranks beside the experts'
        raise ValueError(f"--sp with --ep {args.ep} and no --tp: sequence parallelism splits a tensor-parallel rank's "
                         f"tokens, and there are none here; add --tp 2 (each expert split over tp too), or leave --sp "
                         f"out")
    args.schedule, args.tp = args.schedule or "1f1b", tp  # what runs, in the job and in the JSON row


def run(args):
    return one_line_errors("parallel", run_layout, args)  # every error in flags; SIGTERM said in one line


def run_layout(args):
    """One step of the flags' layout, and its report: a section for every dimension that ran (REPORT), then the loss
    and the gradients against the single process's; under --zero ZeRO's table below (parallel_run.printed)."""
    check_flags(args)
    cfg, policy, device = prepared(args)  # a step that cannot fit is refused here
    measured = measured_step(args, cfg, policy, device)
    if measured is None:
        return
    row = expert_row(args, cfg, policy, measured) if args.ep != 1 or args.keep_dispatched else {}
    ranks = measured[1]
    if args.cp == 1 and not row and (args.pp, args.microbatches, args.dp) != (1, 1, 1):  # the timeline's raw marks
        ranks = [{key: value for key, value in r.items() if key not in ("timeline", "dp_buckets", "timeline_start")}
                 for r in ranks]
    printed(args, cfg, policy, device, row, measured, print_report, ranks)


def print_report(row):
    experts = f" E={row['experts']} k={row['experts_per_token']}" if row["experts"] else ""
    print(f"parallel step {layout_words(row)}, policy {row['policy']} on {row['device']}, {row['dtype']}, "
          f"{row['attention']} attention: L={row['layers']} h={row['hidden']} H={row['heads']} KV={row['kv_heads']} "
          f"f={row['ffn']} V={row['vocab']}{experts}, global batch {row['batch']} x {row['seq']} tokens")
    shown = [section for applies, section in REPORT if applies(row)]
    for section in shown or [print_tensor]:  # one rank alone (--tp 1): the plain table
        section(row)
    print(f"loss {row['loss']:.6f} (single process {row['single_process_loss']:.6f}); gradients against the "
          f"single-process engine: max relative difference {row['grad_max_rel_diff_vs_single']:.3g}")


def print_tensor(row):
    """The tensor-parallel section: per rank its stored peak, communication and FLOPs against their closed forms."""
    print(f"tensor parallel, t={row['tp']}" + (", sequence parallel" if row["sp"] else "") + ":")
    print(table(row["ranks"], rank_columns()))
    exact = all(r["peak_activation_bytes"] == r["predicted_activation_bytes"] and
                r["comm_bytes"] == r["predicted_comm_bytes"] for r in row["ranks"])
    print(f"stored peaks and communication bytes equal their closed forms "
          f"(picockpt/parallel/tensor_parallel/tp_forms.py): {'yes' if exact else 'NO'}")
    first = row["ranks"][0]
    added = first["comm_bytes"]["recompute"]
    print(f"recomputation moves {fmt_bytes(added)} per rank again "
          f"({added / first['comm_bytes']['forward']:.0%} of the forward's communication)" if added else
          "recomputation moves nothing between ranks under this policy")


BUBBLE_FORMS = {"afab": "(P - 1) / (M + P - 1)", "1f1b": "(P - 1) / (M + P - 1)",
                "interleaved": "(P - 1) / (V M + P - 1)", "zb-h1": "(P - 1) / (3 M + P - 1) (F = B = W)"}


def print_pipeline(row):
    """The pipeline and data-parallel section: per rank its stage, micro-batches in flight, stored peak against its
    closed form and where its time went; the bubble; the data-parallel reduction left exposed."""
    print(f"pipeline and data parallelism, P={row['pp']} stage{'s' if row['pp'] > 1 else ''}, "
          f"M={row['microbatches']}, dp={row['dp']}, {row['schedule']}:")
    columns = rank_columns(("stage", lambda r: str(r["stage"])),
                           ("layers", lambda r: ", ".join(f"{a}..{b}" for a, b in r["chunk_layers"])),
                           ("in flight", lambda r: str(r["microbatches_in_flight"])), phases=False)
    columns += [("recompute", lambda r: fmt_flops(r["flops"]["recompute"]))]
    columns += [(kind, lambda r, kind=kind: f"{r['timeline_seconds'][kind] * 1e3:.1f} ms")
                for kind in ("forward", "recompute", "backward", "wait", "idle")]
    columns += [("bubble", lambda r: f"{r['bubble']:.0%}")]
    print(table(row["ranks"], columns))
    exact = all(r["peak_activation_bytes"] == r["predicted_activation_bytes"] for r in row["ranks"])
    form = {"zb-h1": "the order walked: each forward adds what a micro-batch stores, each B its peak over the "
                     "others' and leaves what its W reads (W frees it)",
            "interleaved": "the order walked, micro-batch-chunk by micro-batch-chunk"}.get(
        row["schedule"], "(in flight - 1) x stored per micro-batch + one micro-batch's peak")
    print(f"stored peaks equal their closed forms, {form} (picockpt/parallel/pipeline_parallel/pp_forms.py): "
          f"{'yes' if exact else 'NO'}")
    bubbles = [r["bubble"] for r in row["ranks"]]
    print(f"bubble (1 - computing / step time) per rank: {', '.join(f'{b:.0%}' for b in bubbles)}; "
          f"{BUBBLE_FORMS[row['schedule']]} = {row['ranks'][0]['predicted_bubble']:.0%} with equal stage times")
    if row["dp"] > 1 and not row["zero"]:  # ZeRO reduces each unit as it is final, blocking: its table follows
        exposed = max(r["timeline_seconds"]["reduce"] for r in row["ranks"])
        print(f"data-parallel all-reduce left exposed at the end of the step: {exposed * 1e3:.1f} ms "
              f"({'overlapped with the backward' if row['overlap'] else 'after the backward, not overlapped'})")


# Every dimension that ran has its section, in this order (one table each; the ranks' coordinates in each).
REPORT = ((lambda row: row["tp"] > 1, print_tensor),
          (lambda row: (row["pp"], row["microbatches"], row["dp"]) != (1, 1, 1), print_pipeline),
          (lambda row: row["ep"] > 1 or row["keep_dispatched"], print_expert),
          (lambda row: row["cp"] > 1, print_context))

"""predict's ZeRO row: one GPU's model state under ZeRO stage S over its data-parallel ranks, beside tp, cp, pp and
ep (the busiest pipeline stage's rank, from parallel/report_forms.py's zero_stage_forms: the forms the ranks are held
to), twice: as the ZeRO paper counts it and as picockpt holds it; its activations, gathers per phase and total."""
import math
from dataclasses import replace

from ..planning.published import GIB
from ..parallel.data_parallel.zero_forms import zero_paper_parts
from ..parallel.expert_parallel.ep_forms import ep_peak_bytes, ep_stored_bytes
from ..parallel.pipeline_parallel.pp_forms import ChunkForms
from ..parallel.report_forms import rank_param_shapes, zero_stage_forms

STATE = ("param_bytes", "grad_bytes", "optimizer_bytes")


def expert_activation_bytes(cfg, stage_forms, ep, tp, sp):
    """A stage's store peak on ep rank 0 for balanced routing (in every layer each expert an equal share of the N k
    pairs; the rest, when E does not divide them, one more each on the first experts): ep_forms.py's forms per
    micro-batch of b x ep sequences (the rank computes b of them), (in flight - 1) micro-batches stored beside one at
    its peak."""
    stage_cfg, b, seq = cfg.replace(layers=len(stage_forms.layers)), stage_forms.b * ep, stage_forms.seq
    pairs, E = b * seq * cfg.experts_per_token, cfg.experts
    routing = [[pairs // E + (e < pairs % E) for e in range(E)] for _ in range(stage_cfg.layers)]
    args = (stage_cfg, b, seq, stage_forms.policy, ep, 0, routing)
    stored = ep_stored_bytes(*args, head=stage_forms.last, t=tp, sp=sp)
    return (stage_forms.in_flight - 1) * stored + ep_peak_bytes(*args, head=stage_forms.last, t=tp, sp=sp)


def zero_row(cfg, batch, seq, policy, layout):
    """One GPU under ZeRO layout.zero over dp x cp ranks (beside tp, cp and pp: a rank of each stage, its tp slices
    of the stage's weights on its seq/cp tokens), `batch` sequences per rank: the paper's and picockpt's model state
    by part, picockpt's activations and (stage 3) gathered parameters and their gathers per phase (recomputation's
    included: parallel/report_forms.py's zero_stage_forms), their totals; the busiest stage's, and under pp every
    one's. layout: a Layout (1F1B)."""
    stage, dp, tp, sp, cp, pp, ep = layout.zero, layout.dp, layout.tp, layout.sp, layout.cp, layout.pp, layout.ep
    n = seq // cp
    rows = []
    for s in range(pp):
        stage_forms = ChunkForms(cfg, batch, n, policy, replace(layout, dp=1), s)  # `batch` sequences a rank
        own = zero_stage_forms(cfg, stage_forms, layout)
        state = {key: own[key] for key in STATE}
        psi = sum(math.prod(shape) for shape in rank_param_shapes(cfg, stage_forms, tp, ep).values())  # this rank's
        paper = zero_paper_parts(psi, stage, K=12, N_d=dp * cp)
        gathered = max(own["gathered_peak_bytes"].values())
        by_stage = {z: sum(zero_stage_forms(cfg, stage_forms, replace(layout, zero=max(z, 1), dp=dp if z else 1,
                                                                      cp=cp if z else 1))[key] for key in STATE)
                    for z in (0, 1, 2, 3)}  # 0: whole
        activations = expert_activation_bytes(cfg, stage_forms, ep, tp, sp) if ep > 1 else stage_forms.peak_bytes
        rows.append({"pipeline_stage": s, "parameters": psi, "paper": paper,
                     "paper_model_state_bytes": sum(paper.values()), "picockpt": state,
                     "picockpt_model_state_bytes": sum(state.values()), "picockpt_gathered_bytes": gathered,
                     "picockpt_gathered_by_phase": {phase: kinds.get("all_gather", 0) for phase, kinds in
                                                    own["zero_bytes_by_kind"].items() if phase != "optimizer"},
                     "picockpt_activation_bytes": activations,
                     "picockpt_total_bytes": sum(state.values()) + gathered + activations,
                     "picockpt_model_state_by_stage": by_stage})
    busiest = max(rows, key=lambda row: row["picockpt_total_bytes"])
    return {"stage": stage, "dp": dp, "tp": tp, "sp": sp, "cp": cp, "pp": pp, "ep": ep,
            "microbatches": layout.microbatches,
            "policy": policy, **busiest, "stages": rows if pp > 1 else None}


def gib(n):
    return f"{n / GIB:,.2f} GiB"


def verdict(total, capacity):
    return f"fits, {gib(capacity - total)} to spare" if total <= capacity else \
        f"does not fit, {gib(total - capacity)} over"


def print_zero(row, capacity):
    """The ZeRO row as predict prints it (row["activation_bytes"]: Korthikanti's, for the comparison)."""
    z, stage, dp = row["zero"], row["zero"]["stage"], row["zero"]["dp"]
    over = f"{dp} x cp {z['cp']} = {dp * z['cp']}" if z["cp"] > 1 else \
        f"{dp} x ep {z['ep']} = {dp * z['ep']} (the experts' over {dp})" if z["ep"] > 1 else f"{dp}"
    beside = "".join(f", {name} {z[name]}" for name in ("tp", "pp") if z[name] > 1)
    busiest = f" (stage {z['pipeline_stage']} of {z['pp']}, the busiest)" if z["pp"] > 1 else ""
    print(f"ZeRO stage {stage} over {over} data-parallel ranks{beside}, model state per GPU{busiest} of "
          f"Psi = {z['parameters']:,} parameters held (parallel/report_forms.py: zero_stage_forms):")
    print(f"  {'':<26}{'ZeRO paper: fp16 + K=12 Adam':>30}{'picockpt: fp32, AdamW':>26}")
    for key, name in zip(STATE, ("parameters", "gradients", "optimizer state")):
        print(f"  {name:<26}{gib(z['paper'][key]):>30}{gib(z['picockpt'][key]):>26}")
    paper, own = gib(z['paper_model_state_bytes']), gib(z['picockpt_model_state_bytes'])
    print(f"  {'model state':<26}{paper:>30}{own:>26}")
    print(f"  by stage (picockpt, over {dp * z['cp']}): " + ", ".join(
        f"{s} {gib(n)}" for s, n in z["picockpt_model_state_by_stage"].items()))
    if stage == 3:
        moved = ", ".join(f"{phase} {gib(n)}" for phase, n in z["picockpt_gathered_by_phase"].items())
        print(f"  gathered parameters in flight (stage 3, with prefetch): {gib(z['picockpt_gathered_bytes'])}; "
              f"all-gathered per step: {moved}")
    for other in z["stages"] or ():
        print(f"  pipeline stage {other['pipeline_stage']}: model state {gib(other['picockpt_model_state_bytes'])}"
              f", activations {gib(other['picockpt_activation_bytes'])}, total "
              f"{gib(other['picockpt_total_bytes'])}")
    if z["pp"] > 1 or z["cp"] > 1 or z["ep"] > 1:  # micro-batches in flight, its tokens, its experts' rows
        balanced = ", its experts' rows for balanced routing" if z["ep"] > 1 else ""
        print(f"  activations of one rank (picockpt's store, {z['policy']}{balanced}): "
              f"{gib(z['picockpt_activation_bytes'])}")
    else:
        print(f"  activations of one rank's micro-batch (picockpt's store, {z['policy']}): "
              f"{gib(z['picockpt_activation_bytes'])}; Korthikanti's: {gib(row['activation_bytes'])}")
    total = z["picockpt_total_bytes"]
    theirs = z["paper_model_state_bytes"] + row["activation_bytes"]
    published = "" if z["pp"] > 1 or z["cp"] > 1 or z["ep"] > 1 else \
        f"; the paper's state + Korthikanti's activations {gib(theirs)} ({verdict(theirs, capacity)})"
    print(f"  total per GPU: picockpt {gib(total)} ({verdict(total, capacity)} in {gib(capacity)}){published}; "
          f"working memory not counted")

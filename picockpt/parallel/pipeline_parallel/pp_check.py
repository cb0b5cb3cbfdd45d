"""What pipeline parallelism refuses, before any rank starts (job.py's checked_job calls `refuses`)."""
from ..refusals import given, not_yet
from .pp_schedules import check_interleaving, check_segment


def refuses(job, policy, device):
    """The pipeline fields of a picockpt.parallel job, with its parsed policy: its schedule against the layout beside
    it, interleaving's grouping, a segment longer than a stage, recompute-early without stages."""
    layout = job.layout
    if layout.virtual_stages > 1 and (layout.zero or layout.ep > 1 or layout.cp > 1):
        not_yet(f"schedule='interleaved' with {given(job, 'zero', 'ep', 'cp')}",
                "ZeRO's, ep's and cp's closed forms are per stage, not per chunk", "interleave with dp and tp (sp)")
    if layout.schedule == "zb-h1" and job.cfg.experts > 0:
        not_yet("schedule='zb-h1' with experts",
                "a mixture of experts' weight gradients are not deferred apart from its input gradient",
                "use zb-h1 with a dense model, or 1f1b")
    if layout.zero and (job.steps > 1 or len(job.batches or ()) > 1) and layout.pp > 1 and job.cfg.draws_random:
        not_yet(f"{job.steps or len(job.batches)} steps with pp={layout.pp} and dropout",
                "the next step's first stage would need the generator state the last stage ends with",
                "train with pp=1, or dropout=0")
    if layout.schedule == "interleaved":
        check_interleaving(layout.pp, layout.microbatches, layout.virtual_stages, job.cfg.layers)
    check_segment(policy.segment, policy.text, job.cfg.layers, layout.pp, layout.virtual_stages)
    if layout.recompute_early and layout.pp == 1:
        raise ValueError("recompute_early=True without pp: it recomputes a stage's top segment while the stage "
                         "waits for its gradient; use it with pp >= 2, or leave it out")

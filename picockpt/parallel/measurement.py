"""What one rank's step measures, and the report it makes of it: the rank's Tracker (stored and live bytes, FLOPs
per phase), its Timeline, the stage's stores summed (timeline.py: StageMemory), the bytes its collectives moved
(comm.py: CommLog), the layers' (tp, ep, cp) apart from the reductions' (dp, ZeRO). rank.py runs the step:

    measured = Measurement(job, groups, stage_forms)
    with measured.step() as (tracker, timeline, memory):   # after a barrier: the same zero on every rank
        ...                                               # the step; measured.forward_done after each forward
    report = measured.report(pipe, buckets, sequence_split, shards, state)
"""
import contextlib
from dataclasses import fields

import torch.distributed as dist

from ..measurement.tracker import Tracker
from .comm import PHASES, CommLog
from .timeline import StageMemory, Timeline


class Measurement:
    """The step's instruments and what it saw beside them (micro-batch 0's stored bytes, the rows its experts got)."""

    def __init__(self, job, groups, stage_forms):
        self.job, self.groups, self.forms = job, groups, stage_forms
        self.layer_comms = [group for group in (groups.tp_comm, groups.ep_comm, groups.cp_comm) if group is not None]
        self.reducing = [group for group in (groups.dp_comm, groups.expert_dp_comm) if group is not None]
        self.layer_log = CommLog()  # the layers' own collectives (tp, ep, cp), this step's bytes only
        self.reduce_log = CommLog()  # the data-parallel groups' collectives (the buckets', or ZeRO's), this step's
        self.first_stored, self.received = {}, dict.fromkeys(stage_forms.layers, 0)

    @contextlib.contextmanager
    def step(self):
        """(tracker, timeline, memory) for the step, the Timeline's zero right after a barrier (timeline.py);
        every group's collectives booked to the Tracker by phase while it runs, and let go after."""
        dist.barrier()
        self.timeline = Timeline(self.groups.device)
        with Tracker(self.groups.device, physical=self.job.measure, flops=self.job.measure) as self.tracker:
            self.memory = StageMemory(self.tracker, self.timeline)
            for groups, log in ((self.layer_comms, self.layer_log), (self.reducing, self.reduce_log)):
                for group in groups:
                    group.tracker, group.log = self.tracker, log
            yield self.tracker, self.timeline, self.memory
        for group in self.layer_comms + self.reducing:
            group.tracker = None

    def forward_done(self, m, c, step, model):
        """After micro-batch m's forward (of chunk c): what its store holds, and what the report says of it."""
        self.memory.end_of_forward[m, c] = self.memory.held.get((m, c), 0)
        if m == 0:  # what the rank's first layer and the head hold after a forward
            self.first_stored.setdefault("layer_stored_bytes", step.store.layer_bytes(self.forms.layers[0]))
            self.first_stored["head_stored_bytes"] = step.store.layer_bytes(None)
        for k, rows_in in getattr(model.rank_model, "received_rows", {}).items():
            self.received[k] += rows_in  # the rows this rank's experts got, over its micro-batches

    def report(self, pipe, buckets, sequence_split, shards, state):
        """The rank's report: where it sits, what it stored, computed and moved, and when (sequence_split: its
        SequenceLayout under cp; shards and state: ZeRO's, with the model state the step ends with)."""
        job, groups, forms, layout = self.job, self.groups, self.forms, self.job.layout
        tracker, timeline, memory, seconds = self.tracker, self.timeline, self.memory, self.timeline.totals()
        local = job.cfg.experts // layout.ep if layout.ep > 1 else 0
        switches = {field.name: getattr(layout, field.name) for field in fields(layout)
                    if field.name not in ("zero", "keep_gathered", "prefetch")}
        report = {
            "rank": groups.rank, "stage": groups.stage, "dp_rank": groups.dp_rank, "ep_rank": groups.ep_rank,
            "cp_rank": groups.cp_rank, "tp_rank": groups.tp_rank, **switches, "sp": layout.sp and layout.tp > 1,
            "policy": forms.policy.text, "stage_schedule": forms.source, "layers": [forms.layers[0], forms.layers[-1]],
            "chunk_layers": [[chunk.layers[0], chunk.layers[-1]] for chunk in forms.chunks],
            "microbatches_in_flight": forms.in_flight,
            "experts": list(range(groups.ep_rank * local, (groups.ep_rank + 1) * local)),
            "peak_activation_bytes": tracker.peak_logical,
            "microbatch_stored_bytes": memory.end_of_forward.get((0, 0), 0),  # micro-batch 0's, after its forward
            "mean_activation_bytes": memory.mean_bytes(),
            "peak_live_bytes": tracker.peak_physical if job.measure else None,
            "flops": {phase: tracker.flops[phase] for phase in PHASES} if job.measure else None,
            "p2p_bytes": {phase: dict(pipe.log.bytes.get(phase, {})) for phase in ("forward", "backward")},
            "p2p_posted": pipe.posted,  # every group of sends and receives, in the order posted
            **self.layer_log.report(PHASES),  # the layers' collectives (tp, ep or cp): bytes and calls per phase
            "dp_bytes": self.reduce_log.total(),
            "timeline_start": timeline.start, "timeline": timeline.relative(), "timeline_seconds": seconds,
            "computing_seconds": seconds["forward"] + seconds["recompute"] + seconds["backward"],
            "dp_buckets": [(str(bucket), nbytes, start - timeline.start, end - timeline.start)
                           for bucket, nbytes, start, end in buckets.events],
            **self.first_stored,
            "received_rows": [self.received[k] for k in forms.layers] if layout.ep > 1 else None,
            "chunks": sequence_split.chunks(groups.cp_rank) if sequence_split else None,
            "chunk_tokens": sequence_split.chunk if sequence_split else None}
        if shards is not None:
            report.update(state, zero=layout.zero, keep_gathered=layout.keep_gathered, prefetch=layout.prefetch,
                          gathered_peak_bytes=dict(shards.gathered_peak))
            for what, by in (("bytes", self.reduce_log.bytes), ("calls", self.reduce_log.calls)):  # by phase and kind
                report[f"zero_{what}_by_kind"] = {phase: dict(by.get(phase, {})) for phase in PHASES + ("optimizer",)}
        return report

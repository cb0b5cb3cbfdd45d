"""What a framework lets the layout search choose: `predict --search --framework megatron` ranks only the layouts
Megatron-LM can run, `--framework torchtitan` only torchtitan's; "any" is every layout the search has. Each choice
with the file of the framework's repository that has it (or lacks it).

    choice        megatron (NVIDIA/Megatron-LM)                  torchtitan (pytorch/torchtitan)
    schedule      1f1b, interleaved (virtual stages); no         1f1b (Schedule1F1B), interleaved (Interleaved1F1B);
                  zero-bubble schedule                           its zero-bubble schedules need 2+ stages a rank,
                                                                 so not ZB-H1's one
    zero          0 (DDP), 1 (--use-distributed-optimizer),      3 and 3+keep (FSDP2, fsdp_reshard_after_forward:
                  2 and 3 (Megatron-FSDP's optim_grads,          "default" keeps the gather under pipelining); its
                  optim_grads_params)                            DDP only on a 1-D mesh (no tp, cp or pp), not here
    policy        none, full (--recompute-granularity full;      none, full (activation_checkpoint.mode); its
                  selective recomputes core attention, which     selective op mode also reruns every second matmul,
                  a flash kernel does not store: none here)      and layer mode every n-th layer: neither is "cheap"
    sp            with and without (--sequence-parallel)         with (its tensor plan puts the norms in
                                                                 SequenceParallel); async TP not priced
    tp overlap    the async backward collectives, and with        none: every tensor-parallel collective exposed
                  --sequence-parallel the chunked ones of
                  --tp-comm-overlap (TransformerEngine's
                  userbuffers; layout_time)
    cp            yes (--cp-comm-type allgather)                 yes (context_parallel_rotate_method allgather)
"""
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Framework:
    """The search's choices a framework allows; None: every one the search has. tp_overlap False prices every
    tensor-parallel collective exposed (layout_time.Model.overlap and chunked_tp off; sequence parallelism stays on)."""
    name: str
    schedules: tuple = None
    zero_stages: tuple = None
    policies: tuple = None
    sp: tuple = None
    tp_overlap: bool = True
    sources: dict = field(default_factory=dict)

    def allows(self, schedule=None, zero=None, policy=None, sp=None):
        """Whether every choice given is one this framework has."""
        return all(value is None or allowed is None or value in allowed for value, allowed in (
            (schedule, self.schedules), (zero, self.zero_stages), (policy, self.policies), (sp, self.sp)))

    def allows_row(self, row):
        """Whether a layout_search row is one this framework can run."""
        return self.allows(row["schedule"], row["zero"], row["policy"], row["sp"] if row["tp"] > 1 else None)

    def model(self, model):
        """The layout_time.Model this framework runs under."""
        return model if self.tp_overlap else replace(model, overlap=False, chunked_tp=False)


MEGATRON_ARGS = "NVIDIA/Megatron-LM megatron/training/arguments.py"
TITAN_CONFIG = "pytorch/torchtitan torchtitan/config/job_config.py"
FRAMEWORKS = {
    "any": Framework("any"),
    "megatron": Framework(
        "megatron", schedules=("1f1b", "interleaved"), zero_stages=("0", "1", "2", "3"), policies=("none", "full"),
        sp=(True, False), sources={
            "schedule": "NVIDIA/Megatron-LM megatron/core/pipeline_parallel/schedules.py: get_forward_backward_func "
                        "returns forward_backward_no_pipelining, _pipelining_without_interleaving (1F1B) or "
                        "_pipelining_with_interleaving (vp_size); no zero-bubble schedule",
            "zero": MEGATRON_ARGS + ": --use-distributed-optimizer (6 + 12/d, docs/source/api-guide/"
                    "dist_optimizer.md); --data-parallel-sharding-strategy optim_grads / optim_grads_params "
                    "(Megatron-FSDP); --use-torch-fsdp2 (not with pipelining, its help says)",
            "policy": MEGATRON_ARGS + ": --recompute-granularity full|selective",
            "sp": MEGATRON_ARGS + ": --sequence-parallel; megatron/core/tensor_parallel/layers.py: "
                  "LinearWithGradAccumulationAndAsyncCommunication; --tp-comm-overlap (asserts --sequence-parallel; "
                  "TransformerEngine's userbuffers, transformer_engine/pytorch/module/base.py initialize_ub)",
            "cp": MEGATRON_ARGS + ": --context-parallel-size, --cp-comm-type p2p|a2a|allgather|a2a+p2p"}),
    "torchtitan": Framework(
        "torchtitan", schedules=("1f1b", "interleaved"), zero_stages=("3", "3+keep"),
        policies=("none", "full"), sp=(True,), tp_overlap=False, sources={
            "schedule": TITAN_CONFIG + ": pipeline_parallel_schedule (torch's get_schedule_class, torch/distributed/"
                        "pipelining/schedules.py: 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, ...); "
                        "pytorch/torchtitan torchtitan/distributed/pipeline_parallel.py: stages a rank must be >= 2 "
                        "for multi-stage schedules",
            "zero": TITAN_CONFIG + ": data_parallel_shard_degree, fsdp_reshard_after_forward "
                    "default|always|never; pytorch/torchtitan torchtitan/models/llama3/infra/parallelize.py: "
                    "\"default\" is reshard_after_forward = not pp_enabled; apply_ddp raises \"DDP has not "
                    "supported > 1D parallelism\"",
            "policy": TITAN_CONFIG + ": ActivationCheckpoint.mode selective|full|none, selective_ac_option "
                      "'op' or an int (every n-th layer); pytorch/torchtitan torchtitan/distributed/"
                      "activation_checkpoint.py: op mode recomputes every second mm",
            "sp": "pytorch/torchtitan torchtitan/models/llama3/infra/parallelize.py: apply_tp's plan, "
                  "attention_norm SequenceParallel(); " + TITAN_CONFIG + ": enable_async_tensor_parallel (only "
                  "effective with compile; its micro-pipelined GEMMs are not priced here)",
            "cp": TITAN_CONFIG + ": context_parallel_degree, context_parallel_rotate_method allgather|alltoall"}),
}

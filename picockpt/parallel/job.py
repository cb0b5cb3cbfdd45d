"""The caller's side shared by every layout: the checks before any rank starts, what the ranks are sent
(every tensor on the CPU; each rank moves it to its own device), the generator they start from, and the
pieces of a rank's report that every layout writes.

    job = checked_batch(job)                  # policy parsed, params and batch checked: a ValueError first
    sent = on_cpu(job)                        # what run_ranks pickles to the ranks
    state = ranks_generator(device).get_state()   # every rank starts from the caller's generator state
    held_bytes(step.store, 0)                 # what layer 0 holds (None: the head), as the store counts it

A layout's job is a dataclass with params, cfg, input_ids, targets, policy and rng_state fields
(tensor_parallel/tp_step.py's Job, pipeline_parallel/pp_job.py's PipelineJob, expert_parallel/ep_job.py's
ExpertJob); these functions take any of them.
"""
import sys
from dataclasses import replace

import torch

from ..batch import check_batch
from ..engine import device_generator
from ..params import check_params
from ..policy import parse_policy

PHASES = ("forward", "recompute", "backward")  # the phases communication and FLOPs are reported by


def checked_batch(job, device):
    """The job with its policy parsed (canonical text), params and batch checked, and the generator state
    its ranks start from (the caller's now, unless the job names one). ValueError before any rank starts."""
    policy = parse_policy(job.policy, job.cfg)
    check_params(job.params, job.cfg)
    input_ids, targets = check_batch(job.cfg, job.input_ids, job.targets, job.params)
    state = job.rng_state if job.rng_state is not None else ranks_generator(device).get_state()
    return replace(job, input_ids=input_ids, targets=targets, policy=policy.text, rng_state=state)


def ranks_generator(device):
    """The caller's generator of the kind the ranks draw from: its CPU one, or its current GPU's."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return device_generator(torch.device("cuda", torch.cuda.current_device()))
    return device_generator(torch.device("cpu"))


def on_cpu(job):
    """The job as the ranks receive it: parameters, batch and generator state on the CPU."""
    params = {name: tensor.detach().cpu() for name, tensor in job.params.items()}
    return replace(job, params=params, input_ids=job.input_ids.cpu(), targets=job.targets.cpu(),
                   rng_state=job.rng_state.cpu())


def trace_lines(rank_label, trace):
    """The engine's `say` on a rank: each trace line prefixed with the rank, to stderr; False: no trace."""
    if not trace:
        return False
    return lambda line: write_line(f"[{rank_label}] {line}\n")


def write_line(text):
    sys.stderr.write(text)  # a whole line at once: the ranks' lines interleave, never their halves
    sys.stderr.flush()


def held_bytes(store, layer):
    """Bytes of the unique storages the store holds for one layer (None: the head), as it counts them."""
    storages = {}
    for (held_layer, _), tensor in store.tensors.items():
        if held_layer == layer:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())

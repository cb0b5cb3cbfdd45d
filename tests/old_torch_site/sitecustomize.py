"""Run at every start-up of an interpreter with this folder on PYTHONPATH: a torch older than picockpt's floor,
simulated as torch 2.4 (its version, and without the names picockpt imports at module level that 2.5 added)."""
import torch
import torch.utils.checkpoint

torch.__version__ = "2.4.1"
for name in ("CheckpointPolicy", "create_selective_checkpoint_contexts"):  # torch 2.5's selective checkpointing
    delattr(torch.utils.checkpoint, name)

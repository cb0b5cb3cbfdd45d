"""The collectives of expert parallelism: rows (tokens) to their expert's rank and back (bytes counted by comm.py)."""
import torch

from ..comm import all_to_all


def exchange_splits(send_splits, comm):
    """How many rows each rank will send here, from how many this one sends to each: an all-to-all of W int64."""
    sizes = torch.tensor(list(send_splits), dtype=torch.int64, device=comm.device)  # (W,)
    return all_to_all(sizes, comm, [1] * comm.world_size, [1] * comm.world_size).tolist()


all_to_all_forward = all_to_all  # comm.py's: (N_send, ...) by destination -> (N_recv, ...) by source


def all_to_all_backward(dy, comm, send_splits, receive_splits):
    """The forward only moves rows: each row's gradient goes back where the row came from (the split lists swapped)."""
    return all_to_all(dy, comm, receive_splits, send_splits)  # (N_send, ...)

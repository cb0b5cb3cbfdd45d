"""The collectives of expert parallelism: rows (tokens) to the rank that holds their expert and back.

    exchange_splits       how many rows each rank sends to this one (an all-to-all of W int64)
    all_to_all            forward: all-to-all, given split sizes | backward: the inverse all-to-all

Bytes are counted by picockpt/parallel/comm.py: the whole send buffer (this rank's own chunk included),
and separately the bytes that leave the rank (the buffer less the rows it sends itself).
"""
import torch

from ..comm import all_to_all


def exchange_splits(send_splits, comm):
    """How many rows each rank will send to this one, from how many this one sends to each: an
    all-to-all of one int64 per rank (counted: 8 x world_size bytes)."""
    sizes = torch.tensor(list(send_splits), dtype=torch.int64, device=comm.device)  # (W,)
    return all_to_all(sizes, comm, [1] * comm.world_size, [1] * comm.world_size).tolist()


def all_to_all_forward(x, comm, send_splits, receive_splits):
    # x (N_send, ...) rows grouped by destination: the first send_splits[0] go to rank 0, ...
    return all_to_all(x, comm, send_splits, receive_splits)  # (N_receive, ...) grouped by source rank


def all_to_all_backward(dy, comm, send_splits, receive_splits):
    """Forward was an all-to-all: block s of this rank's rows went to rank s, and block s of y came
    from rank s (sizes send_splits and receive_splits).

    It only moves rows, so each row's gradient goes back where the row came from: the inverse
    all-to-all, with the two split lists swapped.
    """
    return all_to_all(dy, comm, receive_splits, send_splits)  # (N_send, ...)

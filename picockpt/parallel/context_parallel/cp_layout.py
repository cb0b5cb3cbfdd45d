"""Which tokens of every sequence a context-parallel rank holds, and where they sit in the sequence.

    zigzag       2cp chunks (c = T/(2cp)): rank r holds chunks r and 2cp-1-r, one from the front, one from the
                 back, as Megatron-LM's get_batch_on_this_cp_rank and PyTorch's context_parallel shard them
    contiguous   cp chunks (c = T/cp): rank r holds chunk r

Under causal attention rank cp-1's contiguous tokens see the whole sequence and rank 0's only the first chunk; the
zigzag pairs a cheap chunk with an expensive one, so every rank does the same work (cp_forms.py). A rank's
tokens are its chunks one after another; their global positions feed RoPE and decide, chunk against chunk, which
block of attention is causal (the same chunk), whole (an earlier one) or skipped.
"""
from dataclasses import dataclass

import torch

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class SequenceLayout:
    kind: str  # "zigzag" | "contiguous"
    cp: int    # ranks
    seq: int   # T, the whole sequence

    def __post_init__(self):
        check_layout(self.kind, self.cp, self.seq)

    @property
    def chunk(self):  # c, tokens per chunk
        return self.seq // (2 * self.cp if self.kind == "zigzag" else self.cp)

    def chunks(self, rank):
        """The chunks rank holds, in its local order."""
        return [rank, 2 * self.cp - 1 - rank] if self.kind == "zigzag" else [rank]

    def positions(self, rank, device="cpu"):
        """(n,) the global position of each of rank's local rows."""
        return torch.cat([torch.arange(j * self.chunk, (j + 1) * self.chunk, device=device) for j in self.chunks(rank)])

    def rows(self, x, rank, dim=1):
        """x (..., T, ...) along dim -> rank's tokens (..., n, ...), in its local order (a copy)."""
        return x.index_select(dim, self.positions(rank, x.device))

    def gathered(self):
        """The chunks of an all-gather of every rank's rows, in its order: rank 0's, rank 1's, ..."""
        return [j for rank in range(self.cp) for j in self.chunks(rank)]


def check_layout(kind, cp, seq):
    """ValueError naming the parameter, the value and what would work."""
    if kind not in LAYOUTS:
        raise ValueError(f"layout={kind!r}: use one of {', '.join(LAYOUTS)} (zigzag balances causal attention)")
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r}: give a whole number of ranks, 1 or more")
    parts = 2 * cp if kind == "zigzag" else cp
    if seq % parts:
        raise ValueError(f"seq={seq} with cp={cp} and layout={kind!r}: the sequence is cut into {parts} equal chunks"
                         f"{' (2 x cp: a front and a back chunk per rank)' if kind == 'zigzag' else ''}; use a "
                         f"length that is a multiple of {parts} (e.g. {(seq // parts + 1) * parts})")

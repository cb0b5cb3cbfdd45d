"""A block's tail: what it computes after the last tensor its backward needs, for its output alone:
the down projection(s), an expert-parallel combine, the branch's dropout and the residual add.

A block hands each piece of its tail to tail(piece, *args), right where the piece belongs (a mixture
of experts: each expert's down projection just after its own activation, so that one expert's
product at a time is alive), and the order of every op, random draw and collective is the block's
own. The engine gives each layer its tail (picockpt/recompute/engine.py, Step.run_layers):

    RUN_TAIL    its output is needed: each piece runs at once, piece(*args)
    SKIP_TAIL   a recompute sweep's last layer (Schedule.stop_early): nobody reads its output, so each
                piece gives None and computes nothing; the layer stops at the last tensor its backward
                needs, the dropout mask of its MLP branch still drawn (the RNG as in the first forward)

    m = tail(linear_forward, act, w.down)   # (B, T, h), or None under SKIP_TAIL
"""


class Tail:
    def __init__(self, runs):
        self.runs = runs  # whether the layer's output is computed

    def __call__(self, piece, *args):
        return piece(*args) if self.runs else None

    def __repr__(self):
        return "RUN_TAIL" if self.runs else "SKIP_TAIL"


RUN_TAIL, SKIP_TAIL = Tail(True), Tail(False)

"""What every dimension's refusals share, said alike by each `refuses` (the *_check.py of each folder, called in
turn by job.py's checked_job): a ValueError naming the user's parameters and what would work."""


def given(job, *names):
    """'ep=2, cp=2': those of the layout's names whose value is not the default (0 or 1), as the caller gave them."""
    return ", ".join(f"{name}={getattr(job.layout, name)}" for name in names if getattr(job.layout, name) not in (0, 1))


def not_yet(what, why, works):
    """Two dimensions (or a dimension and a flag) that do not stack yet: what was asked, why not, what works."""
    raise ValueError(f"{what} is not supported yet: {why}; {works}")


def refuse_tiled_dropout(cfg, split, shape, relation, instead, part="rank", eager=""):
    """Refuses tiled attention with dropout under a split of the batch, heads or shards (the message says why).
    split: 'tp=2'; shape: at what shape a tile's seed is drawn; relation: what the masks fail to be."""
    if cfg.attention == "tiled" and cfg.dropout > 0:
        raise ValueError(f"attention='tiled' with dropout={cfg.dropout} and {split}: each tile's mask comes from a "
                         f"generator seeded by the tile's index at {shape}, so no {part}'s masks {relation} single "
                         f"process's; use attention='eager'{eager}, dropout=0, or {instead}")

"""What expert parallelism changes in a rank's model (picockpt/parallel/rank_model.py), as the engine's loop sees it:
rank r of W computes its own sequences (rank.py gives it its rows) with ep_layer.py's hooks, holding ep_shard.py's
weights (E/W experts of each layer, every other weight whole). The loss is the stage's (pp_stage.py): each rank's head
mean over its counted targets, scaled by its share of the whole batch's."""
from .ep_forms import ep_layer_inventory
from .ep_layer import ExpertParallelHooks, ep_drop


def apply_expert_parallel(model, comm, keep_dispatched=False):
    """Make a RankModel an expert-parallel rank's. Every layer keeps its routing in the step's store (model.store),
    whatever its mode; model.received_rows: layer -> the rows its experts received (the routing, as measured)."""
    cfg, W = model.cfg, comm.world_size
    # what a layer could keep (for --trace): its inventory with rows for every expert
    model.layer_names = list(ep_layer_inventory(cfg, W, 1, W, comm.rank, [1] * cfg.experts))
    model.received_rows, model.unstored = {}, ep_drop
    first_expert = comm.rank * (cfg.experts // W)  # the global id of its first expert
    model.hooks = ExpertParallelHooks(comm, cfg, first_expert, keep_dispatched, model.received_rows, model.hooks)
    return model

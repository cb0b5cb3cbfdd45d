"""Expert parallelism (DeepSpeed-MoE, Megatron-LM): a mixture's experts split over ep ranks, tokens sent to their
experts' ranks and back by all-to-all, every other weight replicated. The ep ranks are carved out of the data-parallel
ones (layout.py), beside dp and pp; parallel/rank.py runs each. Read ep_moe.py first, then ep_layer.py, ep_model.py.

    ep_comm.py       the all-to-all pair and the exchange of split sizes
    ep_shard.py      which experts a rank holds; gradients put back together
    ep_check.py      what ep refuses, before any rank starts (the split's checks, what it does not stack with)
    ep_moe.py        the expert block over ranks: route, dispatch, experts, combine; and its backward
    ep_layer.py      the crossings of the one decoder layer on an expert-parallel rank; whole-batch draws
    ep_model.py      one rank's model for the engine's loop
    ep_inventory.py  per-rank closed forms: stored bytes, all-to-all bytes per phase, FLOPs
"""

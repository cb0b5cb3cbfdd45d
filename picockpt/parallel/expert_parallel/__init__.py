"""Expert parallelism (DeepSpeed-MoE, Megatron-LM): a mixture's experts split over ep ranks, tokens sent to their
experts' ranks and back by all-to-all, every other weight replicated. The ep ranks are carved out of the data-parallel
ones (layout.py), beside dp and pp; parallel/rank.py runs each. Read ep_moe.py first, then ep_layer.py, ep_model.py."""

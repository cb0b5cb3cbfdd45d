"""Tensor and sequence parallelism (Megatron-LM; Korthikanti et al. 2022): the layer's heads and MLP columns split over
t ranks, with sequence parallelism its norms and dropouts over the tokens. Read tp_layer.py first (where
picockpt/model/layer.py's layer crosses ranks), then tp_comm.py (the collectives as forward/backward pairs) and
tp_model.py (one rank's model, whose step parallel/rank.py runs)."""

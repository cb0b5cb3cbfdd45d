"""Tensor and sequence parallelism (Megatron-LM; Korthikanti et al. 2022): the layer's heads and MLP columns split
over t ranks, the norms and dropouts over the tokens with sequence parallelism. Read tp_layer.py first (where
picockpt/layer.py's one layer crosses ranks), then tp_comm.py and tp_model.py (whose step parallel/rank.py runs).

    tp_comm.py       copy/reduce/gather/scatter/split pairs: entering and leaving a parallel region
    tp_shard.py      which slice of each weight a rank holds; the checks; gradients put back together
    tp_layer.py      the crossings of the one decoder layer on a tensor-parallel rank
    vocab.py         the vocabulary-parallel embedding, LM head and cross-entropy
    tp_model.py      one rank's model for the engine's loop; distributed saved activations
    tp_inventory.py  per-rank closed forms: stored bytes, communication bytes per phase, FLOPs
"""

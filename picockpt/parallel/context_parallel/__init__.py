"""Context parallelism: every activation of the layer split over cp ranks along the sequence, attention
reading the other ranks' keys and values as they travel round a ring (ring attention) or after one
all-gather (the Llama 3 paper's choice), the partial outputs merged by their log-sum-exp.

Read first: cp_attention.py (ring and all-gather attention, the log-sum-exp merge), then cp_model.py (where
picockpt/model/layer.py's one layer crosses ranks: its attention core alone).

    cp_layout.py     which tokens a rank holds: zigzag (chunks r and 2cp-1-r) or contiguous; their positions
    cp_comm.py       the ring step pair and the all-gather / reduce-scatter pair of K/V, counted per phase
    cp_attention.py  attention over blocks of keys, merged by log-sum-exp, forward and backward
    cp_model.py      one rank's model for the engine's loop: its tokens, RoPE at their positions (and beside
                     tp, the tensor-parallel model on those tokens)
    cp_inventory.py  per-rank closed forms: stored bytes, communication bytes per phase, FLOPs
    cp_check.py      what cp refuses, before any rank starts (check_context_parallel; refuses, for a job)

parallel.loss_and_grads(..., Layout(cp=N, cp_layout=, cp_comm=, cp_keep_kv=)) and `python -m picockpt parallel --cp N`
run it through the composed rank step (picockpt/parallel/rank.py), beside tp, dp and pp (not yet ep or ZeRO).
"""

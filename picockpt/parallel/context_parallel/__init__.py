"""Context parallelism: every activation of the layer split over cp ranks along the sequence, attention reading the
other ranks' keys and values as they travel round a ring (ring attention) or after one all-gather (the Llama 3 paper's
choice), the partial outputs merged by their log-sum-exp. Read cp_attention.py first, then cp_model.py (where
picockpt/model/layer.py's layer crosses ranks: its attention core alone) and cp_layout.py (which tokens a rank holds).
"""

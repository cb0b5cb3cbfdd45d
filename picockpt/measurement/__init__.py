"""What a step is measured by, and what it is compared with.

    tracker.py     logical (the store) and physical (every live tensor) memory, FLOPs and time per phase
    allocator.py   the CUDA caching allocator's rules, replayed (alloc_trace.py its trace; snapshot.py memory_viz)
    reference.py   the same model in plain autograd: the oracle; peers.py, peers_hf.py torch's and Hugging Face's
    measure.py, compare.py, train.py   what the commands run; cpu_caches.py this machine's caches
"""

"""The recomputation engine: what a step keeps, and how it gets back what it dropped.

    store.py     the activation store (bytes by unique storage, every put and pop an event)
    policy.py    policy strings parsed once; schedule.py each layer's mode and the sweeps
    engine.py    the step: forward keeping what the policy says, backward "nearest checkpoint, recompute, use, drop"
    offload.py   the store's host tier (host_pool.py its buffers); bridge.py the same loop around any nn.Modules
"""

"""The model: a Llama-like decoder (and Mixtral-style experts) whose layers store their activations by name.

    config.py    Config and the presets; hf.py reads a Hugging Face config
    params.py    the parameters under Hugging Face names
    layer.py     one decoder layer, forward and backward; block_tail.py a block's tail; attention.py the attention kinds
    head.py      final norm, LM head, loss; moe.py and routing.py the experts; batch.py every step's input checks

Read config.py, params.py, then ../ops/ (every op a forward/backward pair), then layer.py.
"""

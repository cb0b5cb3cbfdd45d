"""The published formulas for activation memory and FLOPs, each with where it comes from.

picockpt's own model has exact closed forms in step_forms.py (they equal the tracker to the byte). The formulas here are
the general ones the literature uses: they describe a GPT-style layer (multi-head attention, GeLU MLP with f = 4h,
LayerNorm, dropout), in the published convention of 16-bit activations and 1-byte dropout masks. They are what
`python -m picockpt predict` prints, and what lessons 03 and 05 compare picockpt against.

    korthikanti_layer_bytes(s, b, h, a, t, sp, recompute)   Korthikanti et al. 2022, Table 2
    playbook_activation_bytes(L, s, b, h, a, ...)           the Ultra-Scale Playbook's charts
    playbook_widget_bytes(a, b, h, h_ff, L, s, v, ...)      the Playbook's interactive memory widget
    korthikanti_flops(L, s, b, h, V, recompute)             forward / backward / recompute FLOPs
    chen_memory(L, C, x, A), chen_optimum(L, x, A)          Chen et al. 2016, O(L/C + C)
    exact_segment_curve(cfg, batch, seq)                    picockpt's exact peak for every:C, C = 1..L

Symbols: s sequence length, b micro-batch, h hidden size, a attention heads, L layers,
t tensor-parallel size, V vocabulary, f (h_ff) MLP width, C layers per checkpointed segment.
"""
import math

from .step_forms import predicted_peak_bytes

GIB = 2**30
RECOMPUTE = ("none", "selective", "full")

# The Ultra-Scale Playbook (Hugging Face, nanotron, 2025), chart "Memory Usage with Recomputation"
# (and "memusage_activations"): activation memory in GiB (the axis says GB; the values are bytes / 2**30)
# of Meta-Llama-3.1 at b = 1, read from the charts' plotted data.
PLAYBOOK_PUBLISHED_GIB = {
    ("llama3-8b", "none"): {1024: 9.25390625, 2048: 28.5078125, 4096: 97.015625, 8192: 354.03125, 16384: 1348.0625},
    ("llama3-8b", "selective"): {1024: 4.25390625, 2048: 8.5078125, 4096: 17.015625, 8192: 34.03125},
    ("llama3-8b", "full"): {1024: 0.25390625, 2048: 0.5078125, 4096: 1.015625, 8192: 2.03125},
    ("llama3-70b", "none"): {1024: 46.2578125, 2048: 142.515625, 4096: 485.03125, 8192: 1770.0625, 16384: 6740.125},
    ("llama3-70b", "selective"): {1024: 21.2578125, 2048: 42.515625, 4096: 85.03125, 8192: 170.0625},
    ("llama3-70b", "full"): {1024: 1.2578125, 2048: 2.515625, 4096: 5.03125, 8192: 10.0625},
    ("llama3-405b", "none"): {1024: 145.703125, 2048: 448.90625, 4096: 1527.8125, 8192: 5575.625, 16384: 21231.25},
    ("llama3-405b", "selective"): {1024: 66.953125, 2048: 133.90625, 4096: 267.8125, 8192: 535.625},
    ("llama3-405b", "full"): {1024: 3.953125, 2048: 7.90625, 4096: 15.8125, 8192: 31.625},
}

# The widget's "Llama 3 8B" preset (its defaults, not Llama 3 8B's true shape: FFN 16384 instead of
# 14336, BERT's vocabulary 30522 instead of 128256, no grouped-query attention), which shows 61.09 GB.
PLAYBOOK_WIDGET_PRESET = dict(a=32, b=32, h=4096, h_ff=16384, L=32, s=256, v=30522, tp=1, mixed=True,
                              recomputation="none", ff_activation="swiglu", seq_parallel=False)


def korthikanti_layer_bytes(s, b, h, a, t=1, sp=False, recompute="none"):
    """Bytes one transformer layer keeps for its backward: Table 2 of Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198).

    Section 4.1 counts a GPT layer with 16-bit activations and 1-byte dropout masks:

        attention block   2sbh   input of the Q, K, V projections (the LayerNorm output)
                          4sbh   Q and K, for Q K^T
                          2as^2b softmax output        as^2b  its dropout mask
                          2as^2b dropout output        2sbh   V
                          2sbh   input of the output projection
                          sbh    dropout mask after it                  = 11sbh + 5as^2b
        MLP block         2sbh   input of the first linear
                          8sbh   GeLU input (4h wide)   8sbh  GeLU output (the second linear's input)
                          sbh    dropout mask                           = 19sbh
        two LayerNorms    4sbh   their inputs
        total             sbh(34 + 5as/h)

    With tensor parallelism over t devices (section 4.2.1) the projections' outputs, the attention core and the MLP's
    4h-wide tensors are split: 24sbh/t + 5as^2b/t. The other 10sbh (LayerNorm inputs 4, dropout masks 2, inputs of the
    attention and the MLP 4) are replicated. Sequence parallelism (4.2.2) splits those along s too. Selective
    recomputation (5) drops the attention core, 5as^2b; full recomputation keeps only the layer input. Table 2:

        no parallelism                      sbh(34 + 5as/h)
        tensor parallel                     sbh(10 + 24/t + 5as/(ht))
        tensor + sequence parallel          sbh(34/t + 5as/(ht))
        tensor parallel + selective         sbh(10 + 24/t)
        tensor + sequence par. + selective  sbh(34/t)
        full recomputation                  2sbh

    Table 2's full-recomputation row has no t; with sequence parallelism the residual stream
    between layers is itself split along s, so the stored input here is 2sbh/t when sp is True.
    """
    _check_recompute(recompute)
    _check_positive(s=s, b=b, h=h, a=a, t=t)
    sbh, core = s * b * h, 5 * a * s * s * b  # core: the attention's s x s tensors, 5 bytes per element
    if recompute == "full":
        numerator = 2 * sbh                               # the layer input, over t with sp
        return _exact(numerator, t if sp else 1)
    replicated = 10 * sbh if not sp else 0                # LayerNorm inputs, masks, block inputs
    split = 24 * sbh + (10 * sbh if sp else 0)            # everything tensor (and sequence) parallel splits
    if recompute == "none":
        split += core
    return _exact(replicated * t + split, t)


def playbook_activation_bytes(L, s, b, h, a, recompute="none", t=1, sp=False):
    """Activation bytes of a whole model as the Ultra-Scale Playbook charts them: L layers of korthikanti_layer_bytes
    plus the embedding dropout mask, s*b*h bytes (sbh/t with sequence parallelism; Korthikanti et al. 4.3). The output
    layer (final norm, logits) is left out, as in the paper's totals. Llama 3.1 8B at s = 4096, b = 1: 97.02 GiB (none),
    17.02 GiB (selective), 1.02 GiB (full)."""
    embedding_dropout = _exact(s * b * h, t if sp else 1)
    return L * korthikanti_layer_bytes(s, b, h, a, t, sp, recompute) + embedding_dropout


def playbook_widget_bytes(a, b, h, h_ff, L, s, v, tp=1, mixed=True, recomputation="none",
                          ff_activation="swiglu", seq_parallel=False):
    """The Ultra-Scale Playbook's interactive memory widget, term by term: the `activationMemory`
    function of its src/memory.js, rewritten in Python. Returns {part: bytes} and "total".

    Per layer it counts Korthikanti's attention block (11sbh + 5as^2b, with its tensor-parallel
    split), both LayerNorm inputs (2 x 2sbh), and an MLP of
        2sbh + 2sbf                (inputs of the first and second linear)
        + 2sbf x 3 for swiglu      ("inputs of the activation function"; x 1 for gelu, 0 for relu)
        + sbh                      (dropout mask)
    so a SwiGLU MLP counts four f-wide 16-bit tensors (gate, up, product need only three).
    Around the layers: the embedding dropout mask sbh, the final norm's and the projection's
    inputs (2sbh each) and the logits in fp32 for the cross-entropy, 4sbv. Full recomputation
    keeps 2sbhL plus those. The widget labels bytes / 1024**3 as "GB" (so 61.09 "GB" is GiB).
    """
    _check_recompute(recomputation)
    if ff_activation not in ("relu", "gelu", "swiglu"):
        raise ValueError(f"ff_activation={ff_activation!r}: use relu, gelu or swiglu")
    _check_positive(a=a, b=b, h=h, h_ff=h_ff, L=L, s=s, v=v, tp=tp)
    e = 2 if mixed else 4                                    # bytes per activation value
    sbh, sbf, sp = s * b * h, s * b * h_ff, seq_parallel
    core = (2 * e + 1) * a * s * s * b                       # softmax output, mask, dropout output
    if sp:
        attention = sbh / tp * (5 * e + 1) + core            # the widget does not split the core under sp
    else:
        attention = sbh * (4 * e / tp + e + 1) + core / tp
    if recomputation == "selective":
        attention -= core if sp else core / tp
    extra_f_wide = {"relu": 0, "gelu": 1, "swiglu": 3}[ff_activation]
    replicated = 1 / tp if sp else 1
    feedforward = sbh * e * replicated + sbf * e / tp + extra_f_wide * sbf * e / tp + sbh * replicated
    layer_norms = 2 * sbh * e * replicated
    parts = {"attention": attention, "feedforward": feedforward, "layer_norms": layer_norms}
    if recomputation == "full":
        parts = {"layer_inputs": sbh * e}
    per_layer = sum(parts.values())
    around = {"embedding_dropout": sbh * replicated, "final_norm": sbh * e * replicated,
              "projection": sbh * e * replicated, "cross_entropy_fp32_logits": 4 * s * b * v * replicated}
    return {**{f"per_layer_{k}": value for k, value in parts.items()}, "per_layer": per_layer,
            "layers": L * per_layer, **around, "total": L * per_layer + sum(around.values())}


def korthikanti_flops(L, s, b, h, V, recompute="none"):
    """Matmul FLOPs of one training step of a GPT model (2 FLOPs per multiply-add), as in
    Korthikanti et al. 2022 section 6 (after Narayanan et al. 2021):

        one layer's forward  24bsh^2 + 4bs^2h    Q, K, V, output projections 8bsh^2, MLP (4h) 16bsh^2,
                                                 Q K^T and attention over V 2bs^2h each
        logits               2bshV
        backward             2 x forward         (each y = a b needs da = dy b^T and db = a^T dy)
        recompute            none 0; selective: the attention core again, 4bs^2h per layer;
                             full: every layer's forward again, L(24bsh^2 + 4bs^2h)

    forward + backward = 72bLsh^2 (1 + s/(6h) + V/(12hL)), the paper's model FLOPs; with full
    recomputation 96bLsh^2 (1 + s/(6h) + V/(16hL)): one extra forward, about +33%.
    """
    _check_recompute(recompute)
    _check_positive(L=L, s=s, b=b, h=h, V=V)
    layer = 24 * b * s * h * h + 4 * b * s * s * h
    forward = L * layer + 2 * b * s * h * V
    recomputed = {"none": 0, "selective": L * 4 * b * s * s * h, "full": L * layer}[recompute]
    return {"forward": forward, "backward": 2 * forward, "recompute": recomputed}


def chen_memory(L, C, x, A):
    """Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": with a checkpoint (x bytes)
    kept every C of L layers, the forward leaves L/C checkpoints, and the backward of one segment
    brings back its C layers' activations (A bytes each): memory = (L/C) x + C A."""
    _check_positive(L=L, C=C, x=x, A=A)
    return L / C * x + C * A


def chen_optimum(L, x, A):
    """The C that minimises chen_memory: d/dC [(L/C) x + C A] = -L x / C^2 + A = 0, so
    C* = sqrt(L x / A), where memory = 2 sqrt(L x A). With equal sizes (x = A): C* = sqrt(L),
    memory 2 sqrt(L) A: O(sqrt(L)) instead of O(L), for one extra forward."""
    _check_positive(L=L, x=x, A=A)
    return math.sqrt(L * x / A)


def exact_segment_curve(cfg, batch, seq, op_level=None):
    """{C: picockpt's exact peak store bytes under every:C} for C = 1 .. L (inventory's closed form);
    its minimum is the discrete counterpart of chen_optimum."""
    suffix = f"+{op_level}" if op_level else ""
    return {C: predicted_peak_bytes(cfg, batch, seq, f"every:{C}{suffix}") for C in range(1, cfg.layers + 1)}


def _exact(numerator, denominator):
    """numerator / denominator: an int when it divides exactly (bytes), else a float."""
    return numerator // denominator if numerator % denominator == 0 else numerator / denominator


def _check_recompute(recompute):
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: use one of {', '.join(RECOMPUTE)}")


def _check_positive(**values):
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}={value!r}: must be a positive number")

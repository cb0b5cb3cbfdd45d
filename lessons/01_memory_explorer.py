# %% [markdown]
# # The memory explorer: what fits on one GPU, and at what price
#
# Pick a model, a sequence, a micro-batch and a recomputation policy, and see where the memory of one
# training step goes on one GPU: the weights, their gradients, the optimizer state, the stored
# activations (checkpoints, the segment being recomputed, the head's logits) and the working memory,
# against the GPU's capacity. Beside it, the $P(C)$ curve of `every:C` (lessons 03 and 04) with its minimum, and
# the cheapest way to fit: the fixed policy of least recompute that fits, and the budget planner's
# optimum for the room the GPU leaves (`picockpt/planning/planner.py`, lesson 12).
#
# Everything is a closed form, so it runs on a CPU in milliseconds and nothing is allocated: the stored
# activations are `inventory.predicted_peak_bytes` on one GPU and `parallel/inventory.rank_peak_bytes`
# on one tensor-parallel rank, the same formulas the tests hold the engine's measurements to, to the
# byte. The rest is counted as `lessons/_explorer.py` says at its top:
#
# * **weights, gradients, optimizer state**: picockpt's mixed precision, fp32 master weights (4 bytes a
#   parameter, plus a 2-byte copy for bf16 compute), fp32 gradients (4) and AdamW's two fp32 moments (8).
#   Tensor parallelism gives each rank $1/t$ of every matrix; ZeRO over $d$ data-parallel ranks divides
#   the optimizer state by $d$ (stage 1), the gradients too (stage 2) and the weights too (stage 3, as
#   FSDP); stage 0 shards nothing. The stage and $d$ are controls ("ZeRO stage", "data par."), starting at
#   ZeRO-3 over 8; every headline and printed line below names them. Data parallelism does not divide the
#   activations.
# * **working memory**: `picockpt.device.step_bytes`'s estimate, four fp32 copies of the step's largest
#   transient tensor (the logits or a chunk of them, the $T \times T$ scores, the MLP's product): the one
#   part that is not exact, drawn hatched. Its margin depends on the dtype: where the $T \times T$ scores
#   are the largest, it counts 16 bytes per $B \cdot H \cdot T^2$ element, and the engine's working memory
#   measures 12 in fp32 and 10.5 in bf16 on a CPU (lesson 02 and `tests/test_explorer.py` measure it):
#   a third too high in fp32, half in bf16. The legend says the margin of the setup drawn.
# * **pipeline stages**: with $p > 1$ the explorer shows the first stage of 1F1B, the one that must fit:
#   $\lceil L/p \rceil$ layers and the embedding (the head is on the last stage), holding $w$
#   micro-batches at once ("in flight"; 1F1B: $w = p$, Korthikanti et al. 2022, sec. 4.2.3). As lesson 16
#   measures, each backward runs while the $w - 1$ others hold what their forwards stored, $E$ each:
#   stored $= (w - 1)\,E + $ one micro-batch's own peak, to the byte of
#   `parallel/pipeline_parallel/pp_forms.py`'s `ChunkForms`.
#
# **Run it** in Jupyter (the controls need a live kernel), or as a script,
# `python lessons/01_memory_explorer.py`, which draws the static figures below.

# %%
import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display

from _check import check
from _explorer import (CAPACITIES, ESTIMATED, GIB, MODELS, PARTS, Setup, cheapest_fit, describe_plan, draw, gib,
                       headline, memory_parts, model_state_by_stage, segment_curve, shape_of, stored_bytes, zero_text)
from _lesson import in_notebook, lesson_args, wrote
from picockpt.teaching.plotting import save_figure

args = lesson_args()  # nothing here depends on the run mode but where the figure goes

# %% [markdown]
# ## The explorer
#
# Every control redraws the panels and the table under them. A shape that cannot be (heads that do not
# divide the hidden size, a tensor-parallel size that does not divide the heads, a mixture of experts
# under tensor parallelism) says why, in red, instead of drawing.

# %%
SEQS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
STYLE = {"description_width": "110px"}
controls = {
    "model": widgets.Dropdown(options=MODELS, value="llama3-8b", description="model"),
    **{name: widgets.BoundedIntText(value=value, min=1, max=10**6, description=name, disabled=True)
       for name, value in shape_of("llama3-8b").items()},
    "seq": widgets.Dropdown(options=SEQS, value=8192, description="sequence"),
    "batch": widgets.IntSlider(value=1, min=1, max=64, description="micro-batch"),
    "dtype": widgets.ToggleButtons(options=["bf16", "fp32"], value="bf16", description="dtype"),
    "attention": widgets.ToggleButtons(options=["eager", "tiled", "fused"], value="eager", description="attention"),
    "loss_chunk": widgets.Dropdown(options=[("whole logits", 0), ("chunks of 1024", 1024), ("chunks of 4096", 4096)],
                                   value=0, description="loss"),
    "layer_level": widgets.ToggleButtons(options=["none", "full", "every", "budget"], value="none",
                                         description="layers"),
    "segment": widgets.IntSlider(value=2, min=1, max=32, description="C of every:C"),
    "op_level": widgets.ToggleButtons(options=["none", "selective", "cheap"], value="none", description="ops"),
    "tp": widgets.Dropdown(options=[1, 2, 4, 8], value=1, description="tensor par."),
    "sp": widgets.Checkbox(value=False, description="sequence parallel"),
    "dp": widgets.Dropdown(options=[1, 2, 4, 8, 16, 32, 64, 128], value=8, description="data par."),
    "zero": widgets.Dropdown(options=[0, 1, 2, 3], value=3, description="ZeRO stage"),
    "stages": widgets.IntSlider(value=1, min=1, max=32, description="pipeline stages"),
    "in_flight": widgets.IntSlider(value=1, min=1, max=32, description="in flight"),
    "gpu": widgets.Dropdown(options=list(CAPACITIES) + ["custom"], value="80 GiB (A100, H100)", description="GPU"),
    "custom_gib": widgets.FloatText(value=48.0, description="custom GiB", disabled=True),
}
for control in controls.values():
    control.style = STYLE
readout = widgets.HTML()
panels = widgets.Output()
busy = False  # True while a preset fills the shape: one redraw at the end, not one per field


def current_setup():
    """The Setup the controls say."""
    values = {name: control.value for name, control in controls.items() if name not in ("gpu", "custom_gib")}
    gpu = controls["gpu"].value
    values["capacity"] = int(controls["custom_gib"].value * GIB) if gpu == "custom" else CAPACITIES[gpu]
    return Setup(**values)


def table(setup):
    """The numbers behind the panels, as an HTML table."""
    parts, fit = memory_parts(setup), cheapest_fit(setup)
    total = sum(parts.values())
    rows = "".join(f"<tr><td>{part}{' (estimate)' if part in ESTIMATED else ''}</td>"
                   f"<td style='text-align:right'>{gib(parts[part])}</td></tr>" for part in PARTS)
    verdict = "fits" if total <= setup.capacity else "does not fit"
    curve = segment_curve(setup)
    best = min(curve, key=curve.get)
    named = fit["named"]
    named_text = (f"<b>{named}</b>: {gib(fit['named_rows'][named][0])} stored, recompute "
                  f"{fit['named_rows'][named][1] / fit['model_flops']:.1%} of a step's FLOPs") if named else \
        "none of the fixed policies fits"
    plan = fit["plan"]
    plan_text = (f"<b>budget:{plan.peak_bytes}</b> ({gib(plan.peak_bytes)} stored): recompute "
                 f"{plan.recompute_flops / fit['model_flops']:.1%} of a step's FLOPs; {describe_plan(plan)}") if plan \
        else (f"nothing fits: even the least feasible schedule stores {gib(fit['least'])}; "
              f"lower the micro-batch or the sequence, or split the model further")
    return (f"<table><tr><th style='text-align:left'>{headline(setup)}, policy {setup.policy if setup.layer_level != 'budget' else 'budget'}"
            f"</th><th></th></tr>{rows}<tr><td><b>total</b></td><td style='text-align:right'><b>{gib(total)}</b></td></tr>"
            f"<tr><td>GPU</td><td style='text-align:right'>{gib(setup.capacity)}: {verdict}</td></tr></table>"
            f"<p>Model state: {zero_text(setup)}; weights + gradients + optimizer state on one GPU by ZeRO stage "
            f"over {setup.dp}: {by_stage_text(setup)}.<br>"
            f"P(C) of every:C is least at <b>C = {best}</b>: {gib(curve[best])} stored.<br>"
            f"Room for stored activations on this GPU: {gib(max(fit['room'], 0))}.<br>"
            f"The cheapest fixed policy that fits: {named_text}.<br>"
            f"The planner's optimum for that room: {plan_text}.</p>")


def by_stage_text(setup):
    return ", ".join(f"{stage} {gib(n)}" for stage, n in model_state_by_stage(setup).items())


def update(change=None):
    """Redraw the panels and the table for the controls' values."""
    if busy:
        return
    try:
        setup = current_setup()
        text = table(setup)
    except ValueError as error:  # a shape or a split that cannot be: say why
        readout.value = f"<p style='color:#C44E52'>{error}</p>"
        panels.clear_output()
        return
    readout.value = text
    if not in_notebook():  # run as a script: no one sees the panels (the static figures below are drawn)
        return
    with panels:
        panels.clear_output(wait=True)
        fig, (bars_ax, curve_ax) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [1.3, 1]})
        draw(setup, bars_ax, curve_ax)
        fig.tight_layout()
        plt.show()  # into the Output widget, in a notebook
        plt.close(fig)


def on_model(change):
    """A preset fills the shape fields (read-only); "custom" makes them editable."""
    global busy
    busy = True
    custom = change["new"] == "custom"
    if not custom:
        for name, value in shape_of(change["new"]).items():
            controls[name].value = value
    for name in shape_of("llama3-8b"):
        controls[name].disabled = not custom
    controls["segment"].max = max(1, controls["layers"].value)
    controls["stages"].max = max(1, controls["layers"].value)
    busy = False
    update()


controls["model"].observe(on_model, names="value")
controls["gpu"].observe(lambda change: setattr(controls["custom_gib"], "disabled", change["new"] != "custom"),
                        names="value")
for name, control in controls.items():
    if name != "model":
        control.observe(update, names="value")

columns = [["model", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab"],
           ["seq", "batch", "dtype", "attention", "loss_chunk", "gpu", "custom_gib"],
           ["layer_level", "segment", "op_level", "tp", "sp", "dp", "zero", "stages", "in_flight"]]
explorer = widgets.VBox([widgets.HBox([widgets.VBox([controls[name] for name in column]) for column in columns]),
                         panels, readout])
update()
if in_notebook():
    display(explorer)
else:
    print("the explorer's controls need a notebook kernel: open lessons/01_memory_explorer.ipynb in Jupyter")

# %% [markdown]
# ## Static figures, for reading without a kernel
#
# Two setups drawn by the same functions as the explorer, each against an 80 GiB GPU. Top: Llama 3 8B at
# one sequence of 8192 tokens in bf16, eager attention, ZeRO-3 over 8 data-parallel GPUs. Storing
# everything needs 213 GiB, most of it the $T \times T$ probabilities; `selective` drops them and still
# misses by 5 GiB, `cheap` fits for the same few percent of recompute (its extra rebuilds are
# elementwise), and the planner fills the room the GPU leaves, recomputing a little less than `cheap`.
# Bottom: Llama 3 70B at 8192 tokens, tensor parallel over 8 GPUs with sequence parallelism and ZeRO-3
# over 8 data-parallel ranks: each GPU holds an eighth of every layer, and `selective` already fits. Under
# each setup's line, its model state per GPU at every ZeRO stage over the same 8 ranks.

# %%
STATIC = {
    "llama3-8b": Setup(model="llama3-8b", seq=8192, dp=8, zero=3, capacity=CAPACITIES["80 GiB (A100, H100)"]),
    "llama3-70b": Setup(model="llama3-70b", **shape_of("llama3-70b"), seq=8192, tp=8, sp=True, dp=8, zero=3,
                        capacity=CAPACITIES["80 GiB (A100, H100)"]),
}
fig, axes = plt.subplots(2, 2, figsize=(14, 9.5), gridspec_kw={"width_ratios": [1.3, 1]})
fits = {name: draw(setup, bars_ax, curve_ax) for (name, setup), (bars_ax, curve_ax) in zip(STATIC.items(), axes)}
fig.suptitle("One training step on one GPU, by part, from picockpt's closed forms (lessons/01_memory_explorer)")
fig.tight_layout()
path = save_figure(fig, "01_memory_explorer")
wrote(path)
for name, setup in STATIC.items():
    fit = fits[name]
    print(f"{headline(setup)}: room {gib(fit['room'])}; cheapest fixed policy that fits: {fit['named']}; planner: "
          + (f"{fit['plan'].recompute_flops / fit['model_flops']:.1%} recompute, {describe_plan(fit['plan'])}"
             if fit["plan"] else "nothing fits"))
    print(f"  model state: {zero_text(setup)}; weights + gradients + optimizer state per GPU by ZeRO stage over "
          f"{setup.dp}: {by_stage_text(setup)}")

# %% [markdown]
# ## Exercises
#
# Use the explorer (or the functions of `lessons/_explorer.py`) to answer these.
#
# **1.** Llama 3 8B, one sequence of 8192 tokens, bf16, eager attention, ZeRO-3 over 8 GPUs of 80 GiB:
# which fixed policy (`none`, `selective`, `cheap`, `full`, `full+selective`, `full+cheap`, `every:2..4`)
# fits with the least recompute?

# %%
answer = "cheap"

# %%
eight = STATIC["llama3-8b"]
fit = cheapest_fit(eight)
check("the cheapest fixed policy that fits (Llama 3 8B, s = 8192, ZeRO-3 over 8, 80 GiB)", answer, fit["named"],
      why=f"room {gib(fit['room'])} for stored activations; "
          + ", ".join(f"{policy} {gib(stored)}" for policy, (stored, _) in fit["named_rows"].items()
                      if policy in ("none", "selective", "cheap", "full"))
          + ": selective does not fit, cheap does, for the same recompute (its rebuilds are elementwise)")

# %% [markdown]
# **2.** The same setup: what share of a step's FLOPs does the planner's optimum recompute, in percent?

# %%
answer = 3.6  # percent

# %%
check("the planner's recompute, % of a step (Llama 3 8B, s = 8192, ZeRO-3 over 8, 80 GiB)", answer,
      100 * fit["plan"].recompute_flops / fit["model_flops"], rel=0.02,
      why=f"budget:{fit['plan'].peak_bytes}: {describe_plan(fit['plan'])}; a q·k^T per layer stored without "
          f"its probabilities, where full recomputation would cost "
          f"{fit['named_rows']['full'][1] / fit['model_flops']:.1%}")

# %% [markdown]
# **3.** Llama 3 70B at 8192 tokens, tensor parallel over 8 with sequence parallelism, ZeRO-3 over 8, on
# an 80 GiB GPU, policy `full+selective`, 1F1B over $p = 8$ pipeline stages of 10 layers: stage 0 holds
# $w = 8$ micro-batches at once. How many GiB of activations does it store at its peak (lesson 16's
# $(w - 1)\,E$ + one micro-batch's own peak)?

# %%
answer = 1.50  # GiB

# %%
seventy = Setup(model="llama3-70b", **shape_of("llama3-70b"), seq=8192, tp=8, sp=True, dp=8, zero=3,
                layer_level="full", op_level="selective", stages=8, in_flight=8,
                capacity=CAPACITIES["80 GiB (A100, H100)"])
staged = memory_parts(seventy)
own = staged["stored checkpoints"] + staged["segment being recomputed"]
across = {p: stored_bytes(memory_parts(seventy.replace(stages=p, in_flight=p))) for p in (2, 4, 16)}
check("GiB stage 0 stores at its peak (Llama 3 70B, tp 8 + sp, full+selective, 1F1B, p = 8)", answer,
      stored_bytes(staged) / GIB,
      why=f"(w - 1)·E = 7 micro-batches x 10 checkpoints = {gib(staged['other micro-batches in flight'])}, plus one "
          f"micro-batch's own peak while it recomputes its top layer, 9 checkpoints and one selective layer = "
          f"{gib(own)}; at p = 2, 4, 16 (w = p, L/p layers) "
          + ", ".join(gib(v) for v in across.values()) + ": 1F1B's first stage holds about L layers' worth "
          "whatever p is")

# %%
RESULT = {"figures": [str(path)],
          "summary": {f"{name}: cheapest fixed policy that fits": fits[name]["named"] for name in STATIC} |
                     {f"{name}: planner's recompute / step": f"{fits[name]['plan'].recompute_flops / fits[name]['model_flops']:.2%}"
                      for name in STATIC if fits[name]["plan"]}}

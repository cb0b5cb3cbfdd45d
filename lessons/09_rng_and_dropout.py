# %% [markdown]
# # Lesson 09: RNG and dropout, or why recomputation must replay the same masks
#
# With dropout, a layer's forward draws random masks. Recomputing the layer in the backward draws them
# again, and unless the random generator is put back to the state it had the first time, the
# recomputed masks are different ones: with $p = 0.1$, two independent masks disagree on
# $2p(1-p) = 18\%$ of the elements. The backward then differentiates a different network from the one
# that produced the loss, and the gradients are wrong, silently (the loss itself is unchanged).
#
# picockpt stores the generator's state beside every checkpoint and replays it around each
# recomputation (`engine.replay_rng`; `torch.utils.checkpoint` does the same with
# `preserve_rng_state=True`, its default). This lesson measures the gradients of `full`, `every:2` and
# `selective` against those of `none` (the same seed, weights and batch), once as the engine is, once
# with `replay_rng` replaced by a do-nothing context.
#
# **Run it** as a script, `python lessons/09_rng_and_dropout.py` (the CPU run, well under a minute;
# `--fast` for seconds, `--large --device cuda` for a bigger shape on a GPU), or step through this
# notebook, where the same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset: the
# CPU run).

# %%
import contextlib
from unittest import mock

import matplotlib.pyplot as plt
import torch

from _check import check
from _lesson import choose, large, lesson_args, shape_line, small, wrote
from picockpt import init_params, loss_and_grads
from picockpt.recompute import engine
from picockpt.planning.step_forms import layer_inventory
from picockpt.measurement.measure import make_batch
from picockpt.ops import dropout_mask
from picockpt.teaching.plotting import policy_color, save_figure

POLICIES = ("full", "every:2", "selective")
DROPOUT = 0.1

# %% [markdown]
# ## With and without the replay
#
# `without_replay()` patches the engine so that a recomputed layer draws fresh masks from wherever the
# generator happens to be; `gradients` runs one step either way; `errors` compares the gradients with
# those of `none`, overall and layer by layer.

# %%
def shape(mode):
    """(Config, batch, seq) of each run mode; dropout on."""
    return choose(mode, fast=(small(layers=2, dropout=DROPOUT), 2, 32), cpu=(small(dropout=DROPOUT), 4, 128),
                  large=(large(layers=8, dropout=DROPOUT), 2, 1024))


def without_replay():
    """A context in which recomputation does not restore the generator: each recomputed layer
    draws fresh masks from wherever the generator happens to be."""
    return mock.patch.object(engine, "replay_rng", lambda generator, state: contextlib.nullcontext())


def gradients(cfg, params, input_ids, targets, policy, seed, replay=True):
    torch.manual_seed(seed)  # the same first-forward masks for every run
    with contextlib.nullcontext() if replay else without_replay():
        return loss_and_grads(params, cfg, input_ids, targets, policy)


def errors(grads, reference, layers):
    """(max |g - g_none| over all parameters, [relative error of each layer's gradients])."""
    worst = max((grads[k].double() - reference[k].double()).abs().max().item() for k in reference)
    per_layer = []
    for i in range(layers):
        names = [k for k in reference if k.startswith(f"model.layers.{i}.")]
        diff = sum((grads[k].double() - reference[k].double()).pow(2).sum() for k in names).sqrt()
        norm = sum(reference[k].double().pow(2).sum() for k in names).sqrt()
        per_layer.append((diff / norm).item())
    return worst, per_layer


# %%
args = lesson_args()
cfg, batch, seq = shape(args.mode)
print(f"lesson 09, dropout p={cfg.dropout}: {shape_line(cfg, batch, seq, args.device)}")
params = init_params(cfg, seed=args.seed, device=args.device)
input_ids, targets = make_batch(cfg, batch, seq, args.device, args.seed)
loss_none, reference = gradients(cfg, params, input_ids, targets, "none", args.seed)

results = {}  # (policy, replay) -> (loss, max error, per-layer relative errors)
for policy in POLICIES:
    for replay in (True, False):
        loss, grads = gradients(cfg, params, input_ids, targets, policy, args.seed, replay)
        results[policy, replay] = (loss.item(), *errors(grads, reference, cfg.layers))

print(f"\nloss under none: {loss_none.item():.6f}")
print(f"{'policy':<11}{'RNG replay':<12}{'loss':>10}{'max |g - g_none|':>19}{'worst layer rel. error':>25}")
for (policy, replay), (loss, worst, per_layer) in results.items():
    print(f"{policy:<11}{'yes' if replay else 'no':<12}{loss:>10.6f}{worst:>19.3g}{max(per_layer):>25.3g}")
print(f"\nwith the replay every gradient is bitwise equal to none's: "
      f"{all(results[p, True][1] == 0.0 for p in POLICIES)}")
print(f"without it, full's gradients are off by up to {max(results['full', False][2]):.1%} of a layer's gradient "
      f"norm, and the loss is the same ({results['full', False][0]:.6f}): nothing in the loss shows the error.")
print(f"two independent masks with p={cfg.dropout} disagree on 2p(1-p) = {2 * cfg.dropout * (1 - cfg.dropout):.0%} "
      f"of the elements; selective keeps its masks, so it needs no replay "
      f"(error without replay: {results['selective', False][1]:.3g}).")

# %% [markdown]
# With the replay the gradients are bitwise equal to those of `none` (error 0). Without it `full` and
# `every:2` are wrong in every layer, by tens of percent of the layer's gradient norm, while the loss is
# the same to the last digit: nothing in the loss shows the error. `selective` is still exact, because
# it keeps the dropout masks (1 byte per element) and rebuilds only the probabilities, with no new draw.
#
# ## The figure
#
# Left, the largest gradient error against `none`, with and without the replay (an exact 0 is drawn at
# the bottom of the log axis and labelled). Right, without the replay, which layers are wrong and by
# how much.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 4.8))
floor = 1e-12  # zero has no place on a log axis: an exact 0 is drawn at this floor and labelled
xs, width = range(len(POLICIES)), 0.38
for offset, replay, alpha in ((-width / 2, True, 1.0), (width / 2, False, 0.45)):
    values = [results[p, replay][1] for p in POLICIES]
    bars = left.bar([x + offset for x in xs], [max(v, floor) for v in values], width, alpha=alpha,
                    color=[policy_color(p) for p in POLICIES], log=True)
    for bar, value in zip(bars, values):
        left.annotate("0 (bitwise)" if value == 0 else f"{value:.2g}", (bar.get_x() + width / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=8)
left.set_xticks(list(xs), [f"{p}\nreplay | no replay" for p in POLICIES], fontsize=8)
left.set_ylim(floor / 3, 10)
left.set_ylabel("max |gradient - gradient under none|")
left.set_title("gradient error against storing everything")
for policy in POLICIES:
    per_layer = results[policy, False][2]
    right.plot(range(cfg.layers), per_layer, "o-", color=policy_color(policy), label=f"{policy}, no replay")
right.set_xlabel("layer")
right.set_ylabel("‖g - g_none‖ / ‖g_none‖ of the layer's weights")
right.set_title("without replay: which layers are wrong")
right.set_ylim(bottom=0)
right.legend(fontsize=8)
right.grid(alpha=0.3)
fig.suptitle(f"Dropout p={cfg.dropout} and recomputation: L={cfg.layers}, h={cfg.hidden}, batch {batch} x {seq}, "
             f"{cfg.dtype}")
fig.tight_layout()
path = save_figure(fig, "09_rng_and_dropout")
wrote(path)

# %% [markdown]
# ## Exercises
#
# **1.** Two masks drawn independently with $p = 0.1$: on what fraction of the elements do they
# disagree (one keeps the element, the other drops it)?

# %%
answer = 0.18

# %%
generator_state = torch.get_rng_state()
torch.manual_seed(args.seed)
first, second = dropout_mask((2_000_000,), DROPOUT, "cpu"), dropout_mask((2_000_000,), DROPOUT, "cpu")
torch.set_rng_state(generator_state)
disagree = (first != second).float().mean().item()
check("the fraction of elements where two independent dropout masks disagree", answer, disagree,
      why=f"P(kept, dropped) + P(dropped, kept) = 2p(1-p) = {2 * DROPOUT * (1 - DROPOUT):.2f}; two masks of "
          f"2,000,000 elements drawn by picockpt.ops.dropout_mask disagree on {disagree:.4f} of them")

# %% [markdown]
# **2.** Which of the three policies gave exact gradients *without* the replay, in the measurement
# above?

# %%
answer = "selective"

# %%
exact_without = [p for p in POLICIES if results[p, False][1] == 0.0]
check("the policy exact without RNG replay", answer, ", ".join(exact_without),
      why="selective keeps each layer's dropout masks and recomputes only the probabilities from q and k: "
          "no new draw. full and every:2 rerun whole layers, which draw their masks again: max errors "
          + ", ".join(f"{p} {results[p, False][1]:.3g}" for p in POLICIES))

# %% [markdown]
# **3.** What `selective` keeps instead of the replay: for the `small` model ($H = 4$ heads) at batch
# 4 × 128 tokens with dropout, how many bytes is one layer's mask of the attention probabilities
# (`attn.probs_mask`, one byte per element of $(B, H, T, T)$)?

# %%
answer = 262_144  # bytes

# %%
exercise = small(dropout=DROPOUT)
mask_bytes = layer_inventory(exercise, 4, 128)["attn.probs_mask"][2]
check("bytes of one layer's attention-probability dropout mask (small, 4 x 128)", answer, mask_bytes, rel=0,
      why=f"B·H·T² = 4·{exercise.heads}·128² elements of 1 byte (layer_inventory: {mask_bytes:,})")

# %%
RESULT = {"figures": [str(path)],
          "summary": {"max error with replay": max(results[p, True][1] for p in POLICIES),
                      "full max error without replay": float(f"{results['full', False][1]:.3g}"),
                      "selective error without replay": results["selective", False][1]}}

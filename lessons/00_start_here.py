# %% [markdown]
# # Start here: how to read picockpt, its words, and its policies in other frameworks
#
# picockpt is activation recomputation (gradient checkpointing) written out by hand for a Llama-like
# model: the forward pass puts every tensor its backward will need into an activation store by name,
# the backward pass is hand-written and recomputes what the store no longer holds from the nearest
# stored checkpoint, and a tracker measures, to the byte, what that saves and what it costs. In
# picockpt a **checkpoint** is always a stored activation, never a saved model file.
#
# This notebook is the map: the lessons and how to run them, a reading order for the code, a glossary,
# and a table of picockpt's policies beside the flags that do the same in Megatron-LM, torchtitan,
# DeepSpeed, Hugging Face `transformers`, `torch.utils.checkpoint` and `torch.compile`.
#
# ## The lessons
#
# Every lesson is one file, `lessons/NN_name.py`, written as cells (`# %%`), and its notebook
# `lessons/NN_name.ipynb` is made from it, committed with its outputs. Three ways to run one:
#
# * **as a notebook**: open the `.ipynb` in Jupyter and run the cells; the flags come from the
#   environment variable `PICOCKPT_LESSON_ARGS` (unset: the CPU run; `PICOCKPT_LESSON_ARGS="--fast"` for
#   seconds);
# * **as a script**: `python lessons/08_the_price.py` (add `--fast`, or `--large --device cuda` on a GPU);
# * **all of them**: `python -m picockpt reproduce` runs every lesson and prints a table of results;
#   `python -m picockpt notebooks` remakes every notebook from its source and executes it.
#
# Each lesson ends with exercises: a question, an `answer = ...` cell to fill in, and a `check(...)`
# that says whether the answer is right and why, from picockpt's own code. The list, from the files:

# %%
from _check import check
from _lesson import lesson_args
from picockpt import Config, parse_policy
from picockpt.planning.step_forms import chain_sizes
from picockpt.teaching.reproduce import LESSONS, discover, title

args = lesson_args()  # nothing here depends on the flags
lessons = discover()
for path in lessons:
    print(f"{path.name:<42} {title(path)}")

# %% [markdown]
# A suggested path: lesson 02 (one step, tensor by tensor), 03 and 04 (where to put checkpoints: the
# derivation, then every segment length measured), 05 and 06 (what a layer stores, and the $s^2$ term), 07
# (cheap ops), 08 (the price), 09 (random numbers), 10 (the same through `torch.utils.checkpoint`), 11 and 12
# (beyond $\sqrt L$, and the planner), 13 (FlashAttention and chunked loss as recomputation), 14 (tensor and
# sequence parallelism), 15 (mixture of experts), 16 (pipeline parallelism: micro-batches in flight per stage, a
# budget per stage, the bubble, and data parallelism's overlapped all-reduces), 17 (expert parallelism: what
# recomputing an expert layer costs in all-to-all bytes), 18 (context parallelism: the sequence split over
# ranks, K/V round a ring or all-gathered, what recomputing a layer sends again, zigzag's balance), 19 (ZeRO:
# sharded model state, and the gathers a recomputed layer needs), 20 (offloading: device against host bytes,
# bytes per FLOP, the three-action frontier), 21 (activations stored in bf16 and fp8), 22 (reading a training
# run's MFU, HFU and recompute share), 23 (step time from FLOPs and bytes on real links), 24 (tensor-parallel
# dropout masks and shared experts), 25 (the CUDA caching allocator under recomputation), 26 (the memory
# hierarchy: why some recomputation is nearly free), 27 (layouts a recomputed matmul runs fast on), 28
# (profiling the backward to place checkpoints: the planner priced in seconds), 29 (choosing a parallel
# layout by its modelled step time, against the Llama 3 paper's) and 30 (interleaved and zero-bubble pipelines
# on ranks: what deferring the weight gradients stores). The
# memory explorer (`01_memory_explorer`) answers "what fits on my GPU?" for the real model sizes at any
# point.
#
# ## Reading the code
#
# The package's folders group it by concern, and the table reads them in this order: `model/` (the config,
# the parameters, the layer, attention, the head, experts; `ops/` beside it, every op a forward/backward pair),
# `recompute/` (the store, the policy and its schedule, the engine's loop, offloading), `measurement/` (the
# tracker, the autograd reference and the peers, the commands' measured step), `planning/` (the closed forms,
# the published formulas, the planners, cost and layout models), `parallel/` (a folder per dimension), and
# `teaching/` with `cli/` (what the lessons and commands run). One file at a time; each adds one idea to the
# ones before it. Every tensor line has a shape comment, and every backward function restates its forward and
# derives each term.
#
# | # | file | what it adds |
# |---|---|---|
# | 1 | `picockpt/model/config.py` | `Config`: every number that decides how many bytes an activation takes (sizes, dtype, dropout, attention kind, loss chunking, experts), the presets (`tiny`, `small`, Llama 3 8B/70B/405B, Mixtral 8x7B), and the checks that name the bad field |
# | 2 | `picockpt/model/params.py` | the parameters under Hugging Face `LlamaForCausalLM` names, so real weights load as they are |
# | 3 | `picockpt/ops/` | every op as a forward/backward pair of plain functions: linear, embedding, RMSNorm, RoPE, attention, SwiGLU, dropout, cross-entropy; the forward returns what its backward needs |
# | 4 | `picockpt/model/layer.py` | one decoder layer: its forward `keep`s tensors in the store by name (`attn.probs`, `mlp.gate`, ...); its backward `take`s them back, or rebuilds a dropped one with a one-line recipe; the named points (`LayerHooks`) where a parallel rank crosses to the others, the identity here; `block_tail.py`: a block's tail (down projection, dropout, residual), run or skipped as the engine says |
# | 5 | `picockpt/model/attention.py`, `picockpt/ops/attention_tiled.py`, `picockpt/ops/attention_fused.py` | the attention kinds: eager (stores the probabilities), tiled (FlashAttention-2 written out), fused (torch's kernels); what each stores |
# | 6 | `picockpt/model/head.py` | the final norm, the LM head and the loss; chunked, the logits are recomputed in the backward |
# | 7 | `picockpt/model/moe.py`, `picockpt/ops/router.py`, `picockpt/model/routing.py` | Mixtral-style experts: routing, per-expert stored tensors, what MoE recomputation keeps |
# | 8 | `picockpt/recompute/store.py` | the activation store: bytes counted by unique storage (a view is not counted twice), every put and pop an event |
# | 9 | `picockpt/recompute/policy.py`, `picockpt/recompute/schedule.py` | policy strings (`none`, `full`, `every:C`, `selective`, `cheap`, `budget:SIZE`, and the MoE ones) turned into a `Schedule`: each layer's mode (`all`, `input`, `none`), parsed once, and the walk of recompute sweeps it implies |
# | 10 | `picockpt/recompute/engine.py` | the step: forward keeping what the policy says, then for each layer from the last, "nearest checkpoint, recompute, use, drop", with the random generator replayed; no autograd |
# | 11 | `picockpt/recompute/offload.py`, `picockpt/recompute/host_pool.py`, `picockpt/planning/host_walk.py`, `picockpt/planning/planner_offload.py` | offloading, a third action beside keeping and recomputing: the store's host tier (pinned buffers reused by size from a pool, copies on a side stream ordered by events, the next layer's tensors prefetched during a backward), a step walked with it (exact bytes, a modelled time for copies and compute on two streams) and the planner that chooses among keep, recompute and offload at a modelled time, from a link's bandwidth and a compute rate |
# | 12 | `picockpt/measurement/tracker.py` | the two views of memory (logical: the store; physical: every live tensor) at every event, peaks and FLOPs per phase |
# | 13 | `picockpt/measurement/reference.py`, `picockpt/measurement/peers.py`, `picockpt/measurement/peers_hf.py`, `picockpt/recompute/bridge.py` | the same model in autograd (the oracle for gradients), `torch.utils.checkpoint` and Hugging Face peers, and picockpt's segment loop driving autograd |
# | 14 | `picockpt/planning/layer_forms.py`, `picockpt/planning/step_forms.py` | the closed forms the tests hold the tracker to, to the byte: a layer's inventory, $X$, $A$, $F$, the one every:C peak formula; then the step's `predicted_peak_bytes`, `step_flops` |
# | 15 | `picockpt/planning/published.py` | the published formulas (Korthikanti et al.'s Table 2, the Ultra-Scale Playbook's charts and widget, Chen's optimum) for comparison |
# | 16 | `picockpt/planning/planner_uniform.py`, `picockpt/planning/planner_chain.py`, `picockpt/planning/planner.py` | binomial checkpointing (revolve) on equal steps; then picockpt's layers as a chain of stages and the exact walk of a schedule over it; then rotor's dynamic programme on that chain: the least recompute under a byte budget |
# | 17 | `picockpt/parallel/step.py`, `rank.py`, `layout.py`, `comm.py`, `job.py`, `refusals.py`, `report_forms.py`, `rank_model.py`, `training.py`, `rng.py`, `measurement.py`, `launch.py`, `watch.py`, `timeline.py` | what every parallelism shares: how dp, pp, ep and tp wrap the one engine (`step.py` on the caller's side, `rank.py` on each rank, read top to bottom), the `Layout` (the dp x pp x ep x cp x tp grid and each dimension's options: the one object a job, the ranks and the closed forms read) and its groups, the counted collectives, one job for every layout, checked by each dimension's own `refuses` (`*_check.py` in its folder; what they share in `refusals.py`), what a rank's step measures and reports (`measurement.py`), the closed forms beside each rank's report, random draws equal to the single process's, where the processes come from and how a failing one ends the run, each rank's timeline |
# | 18 | `picockpt/parallel/tensor_parallel/` | tensor and sequence parallelism: the layer's hooks (`tp_layer.py`), the collectives as forward/backward pairs (`tp_comm.py`), each rank's slice of the weights (`tp_shard.py`), the vocabulary-parallel head (`vocab.py`), one rank's model (`tp_model.py`), per-rank closed forms split from the single process's (`tp_forms.py`) |
# | 19 | `picockpt/parallel/pipeline_parallel/`, `data_parallel/`, `expert_parallel/` | pipeline stages (AFAB, 1F1B, interleaved and ZB-H1 as data in `pp_schedules.py`, sends and receives paired as NCCL needs them in `pp_comm.py`, a stage's micro-batch and ZB-H1's W in `pp_stage.py`, the schedule's actions run in `pp_runner.py`, per-stage closed forms and budgets walked along the order); gradient buckets all-reduced as soon as they are final, for every layout (`dp_comm.py`), and ZeRO 1/2/3 with the gathers a recomputed layer needs (`zero_shards.py` first); experts over ranks, carved out of the data-parallel ones (the all-to-alls in `ep_moe.py`, the layer's hooks in `ep_layer.py`, per-rank closed forms) |
# | 20 | `picockpt/parallel/context_parallel/` | context parallelism: ring and all-gather attention merged by log-sum-exp (`cp_attention.py`), the layer's one hook (`cp_model.py`), zigzag and contiguous layouts, the ring and gather pairs (`cp_comm.py`), per-rank closed forms (`cp_forms.py`) |
# | 21 | `picockpt/measurement/measure.py`, `picockpt/measurement/compare.py`, `picockpt/measurement/train.py`, `picockpt/cli/` | what the commands run: one measured step, the side-by-side comparison, a training loop |
# | 22 | `picockpt/device.py`, `picockpt/planning/fit.py`, `picockpt/model/batch.py`, `picockpt/model/hf.py`, `picockpt/measurement/snapshot.py`, `picockpt/teaching/plotting.py`, `picockpt/teaching/reproduce.py`, `picockpt/teaching/notebooks.py` | the rest: choosing a device and refusing a step that cannot fit, reading a Hugging Face config, a CUDA allocator snapshot, the figures' helpers, and the tooling that runs the lessons and makes their notebooks |
#
# The cell below checks that every file of the table exists, and lists the modules the table does not
# name yet (the code grows faster than a table).

# %%
READING_ORDER = [
    "model/config.py", "model/params.py", "ops/", "model/layer.py", "model/block_tail.py", "model/attention.py",
    "ops/attention_tiled.py", "ops/attention_fused.py", "model/head.py", "model/moe.py", "ops/router.py",
    "model/routing.py", "recompute/store.py", "recompute/schedule.py", "recompute/policy.py", "recompute/engine.py",
    "recompute/offload.py", "recompute/host_pool.py", "planning/host_walk.py", "planning/planner_offload.py",
    "planning/planner_copies.py", "measurement/tracker.py", "measurement/reference.py", "measurement/peers.py",
    "measurement/peers_hf.py", "recompute/bridge.py", "planning/layer_forms.py", "planning/step_forms.py",
    "planning/published.py", "planning/planner_uniform.py", "planning/planner_chain.py", "planning/planner.py",
    "parallel/step.py", "parallel/rank.py", "parallel/layout.py", "parallel/comm.py", "parallel/job.py",
    "parallel/refusals.py", "parallel/report_forms.py", "parallel/rng.py", "parallel/measurement.py",
    "parallel/launch.py", "parallel/watch.py", "parallel/rank_model.py", "parallel/training.py",
    "parallel/timeline.py", "parallel/tensor_parallel/", "parallel/pipeline_parallel/", "parallel/data_parallel/",
    "parallel/expert_parallel/", "parallel/context_parallel/", "measurement/measure.py", "measurement/compare.py",
    "measurement/train.py", "cli/", "device.py", "planning/fit.py", "model/batch.py", "model/hf.py",
    "measurement/snapshot.py", "teaching/plotting.py", "teaching/reproduce.py", "teaching/notebooks.py",
]
package = LESSONS.parent / "picockpt"
missing = [name for name in READING_ORDER if not (package / name).exists()]
named = {path for name in READING_ORDER for path in ((package / name).glob("*.py") if name.endswith("/")
                                                      else [package / name])}
lines = sum(len(path.read_text(encoding="utf-8").splitlines()) for path in named if path.exists())
others = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                if path not in named and path.name not in ("__init__.py", "__main__.py") and "__pycache__" not in path.parts)
print(f"{len(READING_ORDER)} entries, {len(named)} files, {lines:,} lines; missing: {missing or 'none'}")
print(f"modules not in the table: {', '.join(others) or 'none'}")

# %% [markdown]
# ## Glossary
#
# | word | meaning here |
# |---|---|
# | **activation** | a tensor the forward computes that the backward needs: a layer input, a norm output, $q$, the attention probabilities, a SwiGLU product |
# | **stored** (logical) | the bytes held by the activation store: what the backward will need, the same on every device; `Tracker.peak_logical`, equal to `predicted_peak_bytes` |
# | **live** (physical) | the bytes of every tensor alive during the step: the store plus working memory; `Tracker.peak_physical` (on CUDA also `torch.cuda.memory_allocated`) |
# | **working memory** | live minus stored: gradients of activations, each op's transient outputs, a recomputed layer's tensors while its backward runs |
# | **checkpoint** | a stored layer input that recomputation can start from; never a saved model file |
# | **segment** | the layers between two checkpoints; under `every:C`, $C$ layers, recomputed together just before their backward |
# | **layer level / op level** | which layers keep their activations (`none`, `full`, `every:C`, `budget:SIZE`) / which tensors inside a kept layer are dropped and rebuilt (`selective`, `cheap`, `moe_act`, ...); combined with `+` |
# | **selective** | drop the $T \times T$ attention probabilities and rebuild them from $q$ and $k$ (Korthikanti et al.'s selective recomputation) |
# | **$X$, $A$, $F$** | one layer input (a checkpoint), one layer stored whole (input included), the head (final norm and logits): `inventory.chain_sizes` |
# | **$P(C)$** | the store's peak under `every:C`, $\max(nX + F,\ \max_k kX + n_kA)$; Chen's $(L/C)X + CA$ less one checkpoint |
# | **slot, advance** | in revolve's accounting (`planner_uniform.py`): a slot holds one state of the chain; an advance is one forward step taken again |
# | **frontier** | every plan that no other beats in both bytes and recompute (Pareto-optimal), as `planner.frontier` lists them |
# | **model FLOPs / hardware FLOPs** | what a step needs without recomputation (forward + backward) / what was executed (plus recompute) |
# | **MFU / HFU** | model / hardware FLOPs per second over the GPU's peak: model FLOPs utilization counts only useful work, hardware FLOPs utilization counts recomputation too |
# | **lse** | log-sum-exp of a row: the one number FlashAttention and a chunked loss keep so that the probabilities or logits can be rebuilt |
# | **RNG replay** | restoring the random generator's state before a recomputation, so that dropout masks (or router noise) come out the same; picockpt's engine does it for every checkpoint (lesson 09) |
# | **routing replay** | Megatron-LM's `moe_enable_routing_replay` (`megatron/core/transformer/moe/router_replay.py`): each router's `RouterReplay` does what the caller sets. `RECORD` only stores the top-k it computed (`recorded_topk_idx`); `set_target_indices` (indices from another run, or a file) sets those `REPLAY_FORWARD` routes by and queues them; `REPLAY_BACKWARD`, for a recomputation, takes the queued ones. Replaying, the router still computes its scores and the token dispatcher still exchanges the token counts; only the experts are fixed, the same whatever the kernels compute (bf16 near-ties included); 8·N·k bytes a layer (int64). Not RNG replay: picockpt's single-process `full` reruns its router with the generator replayed, its expert-parallel `full` keeps the indices and neither routes nor exchanges counts again (lessons 15, 17) |
# | **micro-batch** | the batch one forward and backward processes; activations grow linearly with it |
# | **in-flight micro-batches** | with pipeline parallelism, micro-batches whose forward has run on a stage and whose backward has not: each holds its stored activations (1F1B: up to $p$ on the first stage) |
# | **AFAB / 1F1B** | pipeline schedules: all forwards, then all backwards (GPipe), every stage holding all $M$ micro-batches / one forward, one backward (PipeDream-Flush), stage $s$ holding $\min(P - s, M)$ |
# | **bubble** | a pipeline stage's time not computing, in two conventions (lesson 16): Narayanan et al. 2021 (sec. 2.2.1) and the Ultra-Scale Playbook divide the bubble time by the ideal compute time, $(p - 1)/m$, and $(p - 1)/(v\,m)$ with $v$ interleaved model chunks per stage; as a share of the whole step it is $(p - 1)/(m + p - 1)$, which `bubble_fraction` returns and lesson 16 measures. One converts to the other: share $= b/(1 + b)$ for $b = (p - 1)/m$ |
# | **dispatch, combine** | expert parallelism's two all-to-alls: each (token, expert) pair's row to the rank that holds the expert, and the expert's weighted output back |
# | **rank, $t$, sp** | one process of a parallel group; the tensor-parallel size; sequence parallelism (the tensors tensor parallelism leaves whole are split along the sequence) |
#
# ## picockpt's policies in other frameworks
#
# The same choices under other names. "~" marks an equivalent that differs in a detail said beside it;
# an empty cell means the framework has no such setting.
#
# | picockpt | Megatron-LM | torchtitan | DeepSpeed | Hugging Face | `torch.utils.checkpoint` | `torch.compile` |
# |---|---|---|---|---|---|---|
# | `none` | no `--recompute-granularity` | `[activation_checkpoint] mode = "none"` | no `deepspeed.checkpointing.checkpoint` calls | the default | plain autograd | `activation_memory_budget = 1.0` (the default; the partitioner may still recompute cheap fused ops) |
# | `full` (every layer's input) | `--recompute-granularity full --recompute-method uniform --recompute-num-layers 1` | `mode = "full"` | `deepspeed.checkpointing.checkpoint` around each layer | `model.activation_checkpointing_enable()` (4.x: `gradient_checkpointing_enable()`), `TrainingArguments(activation_checkpointing=True)` | `checkpoint(layer, x, use_reentrant=False)` around each layer | ~ `activation_memory_budget = 0.0` (recompute the whole compiled region) |
# | `every:C` | `--recompute-granularity full --recompute-method uniform --recompute-num-layers C` | | | | `checkpoint_sequential(layers, L/C)` (~: its last segment stays stored) | |
# | some layers whole, others checkpointed: `budget:SIZE` chooses which | `--recompute-method block --recompute-num-layers N` (the first $N$ layers of each pipeline stage recomputed) | `mode = "selective"`, `selective_ac_option = "N"` (every $N$-th layer checkpointed) | | `activation_checkpointing_enable(every_n_layers=N)` | `checkpoint` around the chosen layers | |
# | `selective` | ~ `--recompute-granularity selective` (`--recompute-modules core_attn`, the default): it checkpoints the whole core attention, $q k^\top$, softmax, dropout and $P V$, so it recomputes $4 b s^2 h$ FLOPs a layer where picockpt keeps the context and rebuilds $P$ alone from $q$, $k$: $2 b s^2 h$ | | | ~ `attn_implementation="sdpa"` or flash attention: the probabilities are never stored | `create_selective_checkpoint_contexts` with the $T \times T$ ops `PREFER_RECOMPUTE` (lesson 10) | |
# | `cheap` | ~ `--recompute-granularity selective --recompute-modules core_attn layernorm` (+ `moe_act` for the experts): the norm outputs alike, but no Megatron option rebuilds only the dense MLP's SwiGLU product (`mlp` recomputes the whole MLP, its matmuls included; `moe_act` only the experts' activation), and `core_attn` as in the row above | ~ `selective_ac_option = "op"` (saves matmul and attention outputs, but only every other matmul, and recomputes the rest) | | | `create_selective_checkpoint_contexts` saving the matmul outputs (the policy PyTorch's documentation shows) | |
# | `moe_act` | `--recompute-modules moe_act` (the experts' activation, output-discarding checkpointing) | | | | | |
# | `moe` | ~ `--recompute-modules moe`: Megatron checkpoints the whole MoE layer, its router, the dispatch and combine all-to-alls, the experts and the shared experts; picockpt's `moe` keeps the router output and the routing and projects only the experts' gate and up again (under expert parallelism it dispatches their rows again, lesson 17) | | | | | |
# | `shared_experts` | `--recompute-modules shared_experts` | | | | | |
# | `router` (the router's probabilities, rebuilt by its linear and softmax) | | | | | | |
# | `full` on an MoE layer, routing kept | ~ `full` with `moe_enable_routing_replay`, the caller setting `REPLAY_FORWARD` (indices from `set_target_indices`) and then `REPLAY_BACKWARD` for the recompute: the experts fixed, the router's scores and the dispatcher's count exchange computed again (picockpt's expert-parallel `full` keeps the indices and runs neither again; its single-process `full` reruns the router with the generator replayed) | | | | | |
# | `full` with $t$ ranks, each keeping $1/t$ of every checkpoint | `--distribute-saved-activations` | | `"activation_checkpointing": {"partition_activations": true}` | | | |
# | checkpoints kept off the GPU | | | `"cpu_checkpointing": true` | `activation_checkpointing_enable(offload=True)` | | |
# | `budget:SIZE` (bytes; rotor's dynamic programme over layers) | | ~ the `memory-budget` choice of its activation-checkpoint config, `MemoryBudgetAC.Config(memory_budget=f)` (`torchtitan/distributed/activation_checkpoint.py`: a fraction, handed to torch.compile's partitioner at the right; the model must be compiled) | | | | ~ `torch._functorch.config.activation_memory_budget = f` (a fraction between 0 and 1; a knapsack over the compiled graph's ops) |
#
# DeepSpeed's `number_checkpoints` sizes the buffers of `contiguous_memory_optimization` (one per
# checkpoint); where the checkpoints go is the model's own code, as in Megatron-DeepSpeed. Where a
# framework recomputes with FlashAttention, `selective` has nothing left to drop (lesson 13):
# Megatron's documentation advises comparing `core_attn` against recomputing nothing with fused attention.
#
# Sources, each checked for the names above: Megatron-LM, `megatron/training/arguments.py`
# (`--recompute-granularity`, `--recompute-method`, `--recompute-num-layers`, `--recompute-modules`,
# `--distribute-saved-activations`), `megatron/core/transformer/transformer_config.py` (`recompute_modules`:
# `core_attn`, `moe_act`, `layernorm`, `mla_up_proj`, `mlp`, `moe`, `shared_experts`; no `router`, which
# only some derived forks add), `megatron/core/transformer/attention.py` (`_checkpointed_attention_forward`
# wraps the whole `core_attention` call), `megatron/core/transformer/moe/moe_layer.py` (`moe` checkpoints
# the layer's `custom_forward`: shared experts, router, dispatch, experts, combine),
# `megatron/core/transformer/moe/router_replay.py` (`RouterReplay`: `RECORD` stores `recorded_topk_idx`;
# `REPLAY_FORWARD` and `REPLAY_BACKWARD` use the indices of `set_target_indices`),
# `megatron/core/transformer/moe/moe_utils.py` (`topk_routing_with_score_function`: the scores, then the
# replayed top-k) and `megatron/core/transformer/moe/token_dispatcher.py`
# (`MoEAlltoAllTokenDispatcher.preprocess`: the token counts gathered on every dispatch), and NVIDIA's
# Megatron Bridge guide, "Activation Recomputation"
# (docs.nvidia.com/nemo/megatron-bridge/latest/training/activation-recomputation.html); torchtitan,
# `torchtitan/config/job_config.py`, class `ActivationCheckpoint` (`mode`: `"none"`, `"full"`,
# `"selective"`; `selective_ac_option`: an integer for every $N$-th layer, or `"op"`); DeepSpeed,
# `deepspeed/runtime/activation_checkpointing/config.py` (`partition_activations`, `number_checkpoints`,
# `contiguous_memory_optimization`, `synchronize_checkpoint_boundary`, `profile`, `cpu_checkpointing`)
# and its configuration reference (deepspeed.ai/docs/config-json); Hugging Face `transformers`,
# `PreTrainedModel.activation_checkpointing_enable(activation_checkpointing_kwargs=None, every_n_layers=1,
# offload=False)` and `TrainingArguments.activation_checkpointing` in the 5.x release this repository
# installs (in 4.x, `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)` and
# `TrainingArguments.gradient_checkpointing`); PyTorch, `torch.utils.checkpoint`
# (docs.pytorch.org/docs/stable/checkpoint.html: `checkpoint`, `checkpoint_sequential`,
# `create_selective_checkpoint_contexts`, `CheckpointPolicy`) and `torch/_functorch/config.py`
# (`activation_memory_budget`: 0.0 is activation checkpointing of the whole compiled region, 1.0 the
# default runtime-optimized strategy).
#
# ## Exercises
#
# **1.** Write the picockpt policy that keeps the input of every 4th layer and, inside the layers it
# recomputes, drops the attention probabilities too.

# %%
answer = "every:4+selective"

# %%
check("the policy string", answer, "every:4+selective",
      same=lambda a, b: isinstance(a, str) and parse_policy(a).text == parse_policy(b).text,
      why=f"a layer level and an op level joined by '+', in either order: parse_policy reads a segment of "
          f"C = {parse_policy(answer).segment} layers and the op level {parse_policy(answer).op_level!r}")

# %% [markdown]
# **2.** One checkpoint of Llama 3 8B ($h = 4096$) in bf16, for one sequence of 8192 tokens: how many MiB?

# %%
answer = 64  # MiB

# %%
X8, _, _ = chain_sizes(Config.from_preset("llama3-8b", dtype="bf16"), 1, 8192)
check("MiB of one Llama 3 8B checkpoint at s = 8192, bf16", answer, X8 / 2**20, rel=0,
      why=f"a layer input is s·b·h numbers of 2 bytes: 8192·1·4096·2 = {X8:,} bytes; full recomputation keeps "
          f"32 of them, {32 * X8 / 2**30:.0f} GiB")

# %%
RESULT = {"figures": [],
          "summary": {"lessons": len(lessons), "files in the reading order": len(named),
                      "every file of the reading order exists": not missing}}

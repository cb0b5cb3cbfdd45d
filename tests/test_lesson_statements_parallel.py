"""What lessons 00_start_here, 15 to 19 and 30, the README and the FSDP2 peer say of other frameworks and of their own
numbers, read from their sources: each sentence is looked up as written, and where it carries a number that
number is recomputed by picockpt's code, so that a wrong statement cannot come back unnoticed.

The sources the sentences follow: torch 2.13's torch/distributed/fsdp/_fully_shard/_fsdp_state.py and
_fsdp_param_group.py, torchtitan's torchtitan/models/llama3/parallelize.py, Megatron-LM's
megatron/core/transformer/moe/router_replay.py, moe_utils.py, token_dispatcher.py, attention.py,
transformer_config.py and docs/user-guide/features/context_parallel.md, torch/utils/flop_counter.py, and the
Llama 3 paper (Dubey et al. 2024, sec. 3.3.2).
"""
import inspect
import json
import pathlib
import re

import numpy as np
import pytest

from picockpt import Config
from picockpt.planning.cost import bubble_idle
from picockpt.parallel.context_parallel.cp_forms import cp_peak_bytes, rank_attention_flops
from picockpt.parallel.data_parallel import fsdp_peer
from picockpt.parallel.pipeline_parallel.pp_schedules import SCHEDULES, stage_layers
from picockpt.parallel.tensor_parallel.tp_shard import check_tensor_parallel
from picockpt.teaching.reproduce import load

LESSONS = pathlib.Path(__file__).resolve().parents[1] / "lessons"
SEQ = 131072  # lesson 18's Llama 3 sequence


def prose(text):
    """Text with the comment markers and line breaks folded away: words one space apart."""
    lines = [re.sub(r"^\s*# ?", "", line) for line in text.splitlines()]
    return re.sub(r"\s+", " ", " ".join(lines))


def lesson(name):
    return prose((LESSONS / name).read_text())


def between(text, start, end):
    """The part of `text` from `start` up to `end` (both must be there)."""
    assert start in text, start
    tail = text[text.index(start):]
    assert end in tail, end
    return tail[:tail.index(end)]


def outputs(name):
    """Every printed line of a committed notebook's code cells."""
    cells = json.loads((LESSONS / name).read_text())["cells"]
    return [line for cell in cells if cell["cell_type"] == "code" for out in cell.get("outputs", [])
            for line in "".join(out.get("text", "")).splitlines()]


# --- lesson 19 and the FSDP2 peer: which hook gathers under which nesting ---------------------------------

def test_lesson_19_puts_each_fsdp2_mechanism_under_its_own_nesting():
    text = lesson("19_zero_and_recomputation.py")
    titan = between(text, "**torchtitan's nesting", "**the opposite nesting")
    opposite = between(text, "**the opposite nesting", "`picockpt/parallel/data_parallel/fsdp_peer.py` builds both")
    assert "fully_shard(checkpoint_wrapper(block))" in titan and "torchtitan/models/llama3/parallelize.py" in titan
    assert "FSDP's forward hooks never fire during it" in titan
    assert "pre-backward hook" in titan and "_register_pre_backward_hook" in titan
    assert "is_bw" not in titan  # the guard belongs to the other nesting
    assert "checkpoint(fully_shard(block))" in opposite and "if not is_bw()" in opposite
    assert "so the recompute runs inside the backward's gather" not in text


def test_the_fsdp2_peer_builds_both_nestings_torchtitans_by_default():
    assert fsdp_peer.NESTINGS == ("fsdp(ac(layer))", "ac(fsdp(layer))")
    assert inspect.signature(fsdp_peer.fsdp2_rank_step).parameters["nesting"].default == "fsdp(ac(layer))"
    doc = prose(fsdp_peer.__doc__)
    titan = between(doc, '"fsdp(ac(layer))" torchtitan\'s', '"ac(fsdp(layer))"')
    assert "checkpoint_wrapper" in titan and "do not fire during the recompute" in titan
    assert "_register_pre_backward_hook" in titan and "is_bw" not in titan
    assert "if not is_bw()" in between(doc, '"ac(fsdp(layer))" torch.utils.checkpoint', "Either way")
    assert "The wrapping is torchtitan's" not in doc


def test_lesson_15s_notebook_shows_both_nestings_gathers_beside_picockpts():
    """The committed run (8 layers): FSDP2 gathers every unit once in the forward (the root one unit) and every
    layer once in the backward under both nestings, as picockpt does with keep_gathered; torchtitan's nesting
    runs no unit forward in the backward, the other one per layer; every recompute finds its layer gathered."""
    layers = Config.from_preset("small").layers  # lesson 19's CPU shape
    rows = {}
    for line in outputs("19_zero_and_recomputation.ipynb"):
        match = re.match(r"(picockpt 3 full(?: keep)?|FSDP2 \S+)\s+(\d+)\s+([\d,]+)\s+(\d+)\s+([\d,]+)(.*)", line)
        if match:
            label, *numbers, rest = match.groups()
            rows[label] = [int(n.replace(",", "")) for n in numbers] + rest.split()
    titan, opposite = rows["FSDP2 fully_shard(checkpoint_wrapper(layer))"], rows["FSDP2 checkpoint(fully_shard(layer))"]
    keep, plain = rows["picockpt 3 full keep"], rows["picockpt 3 full"]
    for run in (titan, opposite):
        assert run[0] == layers + 1 and run[1] == keep[1]  # forward: every unit once, the same bytes
        assert run[2] == layers and run[3] == keep[3]  # backward, recompute included: every layer once
        assert run[5:] == [str(layers), "of", str(layers)]  # every recompute found its layer gathered
    assert plain[2] == 2 * layers and keep[2] == layers
    assert (titan[4], opposite[4]) == ("0", str(layers))  # unit forwards (FSDP's hooks) during the backward


# --- routing replay: what Megatron-LM's RouterReplay records and replays ----------------------------------

WRONG_REPLAY = ("records the top-k indices in the forward and reuses", "recorded in the forward and reused",
                "(nor exchanges counts): what Megatron", "recorded and reused")


@pytest.mark.parametrize("name", ["15_mixture_of_experts.py", "17_expert_parallel.py", "00_start_here.py"])
def test_routing_replay_is_said_as_router_replay_py_does_it(name):
    text = lesson(name)
    for wrong in WRONG_REPLAY:
        assert wrong not in text, wrong
    assert "set_target_indices" in text and "REPLAY_BACKWARD" in text and "recorded_topk_idx" in text
    assert "router_replay.py" in text


def test_replay_still_computes_the_scores_and_the_dispatch_still_exchanges_counts():
    eleven, thirteen = lesson("15_mixture_of_experts.py"), lesson("17_expert_parallel.py")
    assert "`RECORD` only stores the top-k the router computed (`recorded_topk_idx`)" in eleven
    assert "the router still computes its logits and scores" in eleven
    assert "under `REPLAY_BACKWARD` the router still computes its logits and scores" in thirteen
    assert "the recomputed dispatch still exchanges the token counts" in thirteen
    assert "MoEAlltoAllTokenDispatcher.preprocess" in thirteen
    start = lesson("00_start_here.py")
    glossary = between(start, "| **routing replay** |", "| **micro-batch** |")
    assert "`RECORD` only stores the top-k it computed (`recorded_topk_idx`)" in glossary
    assert "the router still computes its scores and the token dispatcher still exchanges the token counts" in glossary
    row = between(start, "| `full` on an MoE layer, routing kept |", "| `full` with $t$ ranks")
    assert "REPLAY_FORWARD" in row and "set_target_indices" in row and "count exchange computed again" in row


# --- lesson 18 -------------------------------------------------------------------------------------------

def test_lesson_18_says_which_126_layer_split_it_uses_and_the_papers():
    text = lesson("18_context_parallelism.py")
    assert "8 of the 126 layers" not in text
    ours = re.search(r"`stage_layers` \(`[^`]+`\) gives the first (\d+) stages (\d+) layers and the last two (\d+)",
                     text)
    counts = [len(layers) for layers in stage_layers(126, 16)]
    first, wide, narrow = map(int, ours.groups())
    assert counts == [wide] * first + [narrow] * (16 - first)
    paper = re.search(r"removes one transformer layer from the first stage and one from the last, (\d+) there and "
                      r"(\d+) on the (\d+) between", text)
    end, middle, between_stages = map(int, paper.groups())
    assert 2 * end + between_stages * middle == 126 and end == middle - 1 and between_stages == 14
    assert "stage_plan(\"full\", llama405" in (LESSONS / "18_context_parallelism.py").read_text()  # computed


def test_lesson_18_gives_the_logits_true_share_of_full():
    text = lesson("18_context_parallelism.py")
    assert "most of full's bytes are the head's logits" not in text
    assert "{logits_share:.1%} of it, less than half" in text
    llama = Config.from_preset("llama3-8b", dtype="bfloat16", attention="fused")
    share = SEQ * llama.vocab * 2 / cp_peak_bytes(llama, 1, SEQ, "full", 1)
    assert share < 0.5


def test_lesson_18_separates_the_flop_counters_square_from_the_kernels_causal_skip():
    text = lesson("18_context_parallelism.py")
    assert "The fused kernel counts the causal block's whole square" not in text
    assert "FlopCounterMode counts the fused kernel's whole square, causal or not" in text
    assert "The flash kernel itself skips the key blocks above the causal diagonal" in text
    kernel, counter = map(float, re.search(r"an imbalance of \$\(2cp-1\)/cp\$ as the kernel sees it \(([\d.]+) at "
                                           r"\$cp = 4\$, where the counter says ([\d.]+)\)", text).groups())
    llama = Config.from_preset("llama3-8b", dtype="bfloat16", attention="fused")
    counts = [rank_attention_flops(llama, 1, SEQ, 4, "contiguous", r) for r in range(4)]  # FlopCounterMode's
    assert counter == max(counts) / np.mean(counts)
    skipping = load(LESSONS / "18_context_parallelism.py").kernel_imbalance  # the lesson's own kernel count
    assert kernel == (2 * 4 - 1) / 4 == round(skipping(llama, 4), 2)
    assert all(abs(skipping(llama, cp) - (2 * cp - 1) / cp) < 1e-3 for cp in (2, 8, 16))


def test_lesson_18_calls_the_kv_head_limit_picockpts_choice_and_says_what_megatron_does():
    text = lesson("18_context_parallelism.py")
    assert "Its 8 key/value heads cap it" not in text
    assert "(a choice of this codebase, not a law)" in text
    assert "Megatron-LM goes on past the head count by replicating K/V heads" in text
    assert "megatron/core/transformer/attention.py" in text
    with pytest.raises(ValueError, match="kv_heads=8"):  # picockpt's own limit, as the lesson says
        check_tensor_parallel(Config.from_preset("llama3-405b", dtype="bf16", attention="fused"), 16, True, SEQ)


def test_lesson_18_attaches_megatrons_ring_description_to_the_ring():
    text = lesson("18_context_parallelism.py")
    ring = between(text, "* **ring**", "* **all-gather**")
    gather = between(text, "* **all-gather**", "Causal attention makes")
    assert "`--cp-comm-type p2p`, its default" in ring and "context_parallel.md" in ring
    assert "gathering the rest again in the backward" in ring
    assert "context_parallel.md" not in gather and "gathers KV again" not in gather
    assert "--cp-comm-type allgather" in gather and "cp_comm_type" in gather


# --- lessons 16 and 30: ZB-H1's bubble time against its idle share; lesson 30's verdict; the README -----------

@pytest.mark.parametrize("name", ["16_pipeline_parallel.py", "30_pipeline_schedules.py"])
def test_zb_h1s_bubble_time_is_a_third_of_1f1bs_but_its_idle_share_is_not(name):
    """Qi et al. 2023: bubble (p-1)(T_F+T_B-T_W) against 1F1B's (p-1)(T_F+T_B+T_W); the shares at p=4, m=8 are
    bubble_idle's (p-1)/(3m+p-1) and (p-1)/(m+p-1)."""
    text = lesson(name)
    assert "a third of 1F1B's." not in text and "a third of 1F1B's. " not in text
    said = between(text, "bubble *time* is a third", "picockpt's backward")
    zb, one = bubble_idle(4, 8, "zb-h1"), bubble_idle(4, 8)
    assert f"{zb:.3f} against {one:.3f}, {zb / one:.2f} of it" in said
    assert "T_F+T_B+T_W" in said and "idle *share*" in said


def test_30_names_a_measured_order_only_when_every_repeat_agrees():
    source = (LESSONS / "30_pipeline_schedules.py").read_text()
    text = prose(source)
    assert "is the fairer model" not in text
    assert "the models' order" not in source  # the fallback once printed the equal-times order as if measured
    assert 'print("measured order of the bubbles: inconclusive on this machine (the repeats overlap)")' in source
    assert "Neither model is the verdict: the measured line is" in text


def test_30_exercise_compares_bubble_time_and_share():
    text = lesson("30_pipeline_schedules.py")
    assert "three times as long\")" not in text and "is three times ZB-H1's 3, its share" in text


def test_readme_counts_the_lessons_and_lists_every_schedule():
    readme = (LESSONS.parent / "README.md").read_text()
    lessons = sorted(LESSONS.glob("[0-9][0-9]_*.py"))
    assert f"runs all {len(lessons)} lessons" in readme and len(lessons) == 31
    assert f"`--schedule {'|'.join(SCHEDULES)}`" in readme and "`--virtual-stages`" in readme
    [row] = [line for line in readme.splitlines() if line.startswith("| `16_pipeline_parallel`")]
    assert "interleaved 1F1B and ZB-H1" in row

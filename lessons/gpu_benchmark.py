"""GPU benchmark: picockpt's policies beside torch.utils.checkpoint and Hugging Face, a 1.1B-parameter model in bf16.

    python lessons/gpu_benchmark.py           # a CUDA GPU: T = 1024, 2048, 4096; 158 s on an H200 (torch 2.11)
    python lessons/gpu_benchmark.py --tiny    # the same code on a tiny model, on the CPU, in seconds

Every step holds --tokens tokens (8192: batch 8 x 1024, 4 x 2048, 2 x 4096). At each sequence
length it runs, first, the headline: picockpt with fused attention (the kernel sdpa would pick: cuDNN's or
flash; no T x T tensor stored or whole), none, full, every:4, cheap and budget:SIZE halfway between full's and
none's stored bytes; then the lesson's rows with eager attention (the probabilities materialised):
none, full, every:4, selective, cheap, budget, beside PyTorch's recomputation on the autograd
reference (picockpt/measurement/peers.py, eager too, paired as in `compare`); then Hugging Face's LlamaForCausalLM with
sdpa under autocast (fp32 master weights), without and with its activation checkpointing: the model people
train, the peer of the fused rows. For every run it measures

    step time     median of interleaved untracked steps (each repeat runs every run once, so a slow
                  moment hits all alike). A step is forward + backward: the optimizer is the same
                  for every policy and is left out, which makes the time ratios the stricter.
    tokens/s      B*T / step time
    peak CUDA     max_memory_allocated during a step, minus what was allocated when it began (whole
                  allocator blocks: each request rounded up, by up to 1 MiB for large ones), and beside it
                  torch.cuda.memory_stats()["requested_bytes.all.peak"]: the bytes the step asked for
    tracker peak  the tracker's "total" on one separate tracked step: every tensor the step made,
                  activations, working memory, the 16-bit weight copies and the gradients alike. It sees
                  every op's outputs, not the scratch a kernel allocates and frees inside itself: the flash
                  backward's fp32 dq accumulator (B x T x H x hd x 4 bytes), cross-entropy's log-sum-exp
                  temporaries, cuBLAS workspaces. Those are what the requested peak can hold beyond it.
    MFU, HFU      model FLOPs (forward + backward of none, inventory.step_flops) and executed FLOPs
                  (recomputation included, counted by FlopCounterMode) per second over the GPU's
                  dense bf16 peak (--peak-tflops: 989.5 for an H200 SXM, NVIDIA's datasheet rounds it
                  to 989). Two conventions: MFU and HFU count the T x T matmuls in full (the square
                  eager attention computes, then masks, and what FlopCounterMode counts for the flash
                  kernel too); mfu_causal and, for fused runs, hfu_causal count them as a causal kernel
                  computes them: only the 128 x 128 blocks at or below the diagonal (tiled attention's
                  tile pairs, inventory.step_flops), about half the square.

then prints PASS/FAIL per criterion (lessons/_gpu_criteria.py says why each is judged as it is): the tracker
against the allocator (picockpt's and Hugging Face's runs within 5%; the autograd reference's between the tracker
and the tracker plus CUDA's known softmax-backward scratch); time ratios (fused full <= 1.40x fused none; eager
full <= 1.40x and selective <= 1.10x none; each eager policy <= 1.10x its torch equivalent; fused none <= 0.95x and
fused full <= 1.00x the step time of Hugging Face's sdpa without and with its checkpointing, at no more memory);
exactness (every policy's loss bitwise none's; its gradients bitwise under deterministic algorithms, and with the
default kernels within SPREAD_MULTIPLE x the distance of none from a second none); stored bytes equal to the
closed form; the MFU of both nones. The allocator, time and MFU criteria only mean something on a GPU (a tiny
model on a CPU is timed by Python's overheads): off CUDA they print SKIP. The exactness criteria are PASS/FAIL
everywhere. Writes gpu_benchmark.json (or --out) and gpu_benchmark_{time_memory,timeline}.png to figures/
($PICOCKPT_FIGURES); --tiny writes gpu_benchmark_tiny_* to out/figures/ instead. Hugging Face's rows need
transformers (a test dependency); without it they are left out, with one line saying so.
"""
import argparse
import contextlib
import dataclasses
import gc
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere, no install
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # lessons/: _gpu_criteria
# cuBLAS reads this when it makes its handle: a fixed workspace, so that the deterministic pass (below) may ask
# torch.use_deterministic_algorithms(True) of its matmuls (8 workspaces of 4 MiB; set before torch's first GEMM)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

from picockpt.device import exit_if_torch_too_old, resolve_device

exit_if_torch_too_old()  # before the imports below, which a torch under the floor may lack: one line, no traceback

from picockpt.cli.common import fmt_bytes
from picockpt.measurement.compare import contenders
from picockpt.model.config import Config
from picockpt.planning.fit import check_fits
from picockpt.planning.hardware import H200_SXM_BF16
from picockpt.recompute.engine import loss_and_grads
from picockpt.ops.attention_fused import check_fused
from picockpt.planning.step_forms import predicted_peak_bytes, step_flops
from picockpt.measurement.measure import make_batch
from picockpt.model.params import init_params
from picockpt.measurement import peers_hf
from picockpt.teaching.plotting import figures_dir
from picockpt.measurement.reference import ReferenceLlama
from picockpt.measurement.tracker import Tracker

from _gpu_criteria import criteria, eager_roofline  # noqa: E402  (lessons/, beside this file)
from _gpu_plots import plot  # noqa: E402

# Llama 3.2 1B's depth, width and MLP (L=16, h=2048, f=8192), the attention of the lessons' --large shape
# (16 heads of 128 over 4 key/value heads) and Llama 2's 32000-token vocabulary: 1.10 B parameters. This attention
# materialises the (B, H, T, T) probabilities: 16 heads, not 32, keep every run well inside an H200 at
# T=4096 (the largest step, plain autograd's, tracks at 67 GiB on PyTorch's meta device, which allocates
# nothing), and the smaller vocabulary keeps the (B, T, V) logits modest.
ONE_B = dict(vocab=32000, hidden=2048, layers=16, heads=16, kv_heads=4, ffn=8192, max_seq=4096, dtype="bf16")
TINY = dict(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=80, max_seq=64, dtype="bf16")
CAUSAL_TILE = 128  # the causal convention's block: FlashAttention-2 skips key blocks wholly above the diagonal
PEAK_TFLOPS = H200_SXM_BF16 / 1e12  # 989.5: H200 SXM (as H100 SXM) dense bf16 tensor-core peak (picockpt/planning/hardware.py)


def benchmark(cfg, seqs, tokens, device, repeats=5, segment=4, peak_tflops=PEAK_TFLOPS, seed=0):
    """Every run at every sequence length: the results dict that becomes the JSON."""
    for seq in seqs:  # picockpt none's step is the largest of picockpt's runs at each length
        check_fits(cfg, device, tokens // seq, seq, "none", advice="use fewer --tokens or shorter --seqs",
                   note=f" (the benchmark's step at T={seq})")
        check_fused(device, cfg.torch_dtype, cfg.head_dim)  # the headline runs take the flash kernel
    started = time.perf_counter()
    params = init_params(cfg, seed=seed, device=device)
    with torch.device(device):  # the autograd reference, built where it runs, with the same weights
        model = ReferenceLlama(cfg, params)
        hf = hf_runs(cfg, params, device)  # Hugging Face's peers of fused none and full
    rows = []
    for seq in seqs:
        rows += measure_seq(cfg, params, model, seq, tokens // seq, device, repeats, segment, seed, peak_tflops, hf)
        print(f"  ... {time.perf_counter() - started:.0f} s so far")
    for row in rows:  # the timeline figure shows the longest sequence only
        if row["seq"] != max(seqs):
            row.pop("timeline", None)
    results = dict(device=str(device), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                   torch=torch.__version__, config={**dataclasses.asdict(cfg), "parameters": cfg.num_params()},
                   tokens_per_step=tokens, seqs=list(seqs), repeats=repeats, peak_tflops=peak_tflops, runs=rows)
    results["criteria"] = [dict(status=status, text=text) for status, text in criteria(rows, device.type == "cuda")]
    results["seconds"] = time.perf_counter() - started
    return results


def measure_seq(cfg, params, model, seq, batch, device, repeats, segment, seed, peak_tflops, hf=()):
    """One sequence length, in rounds that each run every run in turn: a warm-up (which also checks
    every policy against none), one tracked step (memory, FLOPs), then `repeats` timed steps."""
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)  # (B, T) each
    runs = plan_runs(cfg, batch, seq, segment) + [dict(run) for run in hf]
    for run in runs:
        run.update(seq=seq, batch=batch, error=None, times=[],
                   step=make_step(run, cfg, params, model, input_ids, targets))
    warm_up(runs)
    deterministic_pass(runs)
    for run in runs:
        attempt(run, lambda: run.update(track(run, cfg, device)))
    for _ in range(repeats):
        for run in runs:
            attempt(run, lambda: run["times"].append(timed_step(run["step"], device)))
    model_flops = sum(step_flops(cfg, batch, seq, "none").values())
    causal = causal_flops(cfg, batch, seq, "none")
    model_flops_causal = causal["forward"] + causal["backward"]  # tiled's inner recompute is not the model's
    return [summary(run, model_flops, model_flops_causal, peak_tflops * 1e12, cfg) for run in runs]


def causal_flops(cfg, batch, seq, policy):
    """step_flops with the attention core counted as a causal kernel computes it: the CAUSAL_TILE blocks at
    or below the diagonal (tiled attention's tile pairs; its backward's q k^T rebuild as the flash one's)."""
    return step_flops(cfg.replace(attention="tiled", attention_tile=CAUSAL_TILE), batch, seq, policy)


def warm_up(runs):
    """One untimed step of every run; each picockpt policy's loss and gradients against none's of the same
    attention kind (the first picockpt run of each kind is its none, run twice: whether its gradients
    repeat bitwise says whether the kernels are deterministic)."""
    nones = {}  # attention kind -> picockpt none's (loss, grads)
    for run in runs:
        result = attempt(run, lambda: run["step"]())
        if result is not None and run["kind"] == "picockpt":
            first = run["attention"] not in nones
            none = nones.setdefault(run["attention"], result)
            if first:  # the spread the default kernels give none against itself (0: it repeats bitwise)
                again = attempt(run, lambda: run["step"]())
                run["deterministic"] = again is not None and all(torch.equal(g, again[1][k]) for k, g in none[1].items())
                if again is not None:
                    run["grads_spread_none"] = max(relative(g, none[1][k]) for k, g in again[1].items())
                del again
            run["loss_bitwise_equal_to_none"] = torch.equal(result[0], none[0])
            run["grads_not_bitwise_equal_to_none"] = [k for k, g in result[1].items() if not torch.equal(g, none[1][k])]
            run["grads_worst_relative_to_none"] = max(relative(g, none[1][k]) for k, g in result[1].items())
        del result
    nones.clear()


def deterministic_pass(runs):
    """Every picockpt run once more under torch.use_deterministic_algorithms(True), warn_only=False (with
    warn_only the flash backward only warns and keeps its atomics): its loss and gradients bitwise against none's
    of the same attention kind, run the same way. An op with no deterministic kernel here raises: noted."""
    nones = {}  # attention kind -> none's (loss, grads) under deterministic algorithms
    torch.use_deterministic_algorithms(True)
    try:
        for run in runs:
            if run["kind"] != "picockpt":
                continue
            try:
                result = attempt(run, lambda: run["step"]())
            except RuntimeError as error:  # e.g. "... does not have a deterministic implementation"
                run["deterministic_error"] = str(error).strip().splitlines()[0][:200]
                continue
            if result is None:
                continue
            loss, grads = nones.setdefault(run["attention"], result)
            run["deterministic_bitwise_equal_to_none"] = (torch.equal(result[0], loss)
                                                          and all(torch.equal(g, grads[k]) for k, g in result[1].items()))
            del result, loss, grads
    finally:
        torch.use_deterministic_algorithms(False)
        nones.clear()


def relative(a, b):
    """max |a - b| / max |b|, in fp64: the max-norm relative difference of two gradients."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def summary(run, model_flops, model_flops_causal, peak_flops, cfg):
    """The JSON row of one run (and its line on the screen)."""
    row = {key: value for key, value in run.items() if key not in ("step", "how", "times", "model")}
    judged_fields(row, cfg, peak_flops)
    if run["error"] is None:
        seconds = statistics.median(t for t, *_ in run["times"])
        causal = None  # fused runs only: the flash kernel skips the blocks above the diagonal
        if run["attention"] == "fused" and not run["how"].startswith("budget:"):  # a budget plans per attention kind
            causal = sum(causal_flops(cfg, run["batch"], run["seq"], run["how"]).values())
        row.update(step_seconds=seconds, tokens_per_second=run["batch"] * run["seq"] / seconds,
                   model_flops=model_flops, model_flops_causal=model_flops_causal,
                   mfu=model_flops / seconds / peak_flops, mfu_causal=model_flops_causal / seconds / peak_flops,
                   hfu=row["executed_flops"] / seconds / peak_flops,
                   hfu_causal=None if causal is None else causal / seconds / peak_flops,
                   peak_cuda_untracked_bytes=run["times"][-1][1], peak_cuda_requested_bytes=run["times"][-1][2])
        if run["times"][-1][2]:
            row["tracker_vs_requested"] = abs(row["tracker_peak_bytes"] - run["times"][-1][2]) / run["times"][-1][2]
    print(f"  T={run['seq']:<5} B={run['batch']:<3} {row['name']:<37}" + (row["error"] or (
          f"{row['step_seconds'] * 1e3:9.1f} ms {row['tokens_per_second']:11,.0f} tokens/s  MFU {row['mfu']:6.1%}  "
          f"peak: tracker {fmt_bytes(row['tracker_peak_bytes'])}, CUDA {fmt_bytes(row['peak_cuda_bytes'])}")))
    return row


def judged_fields(row, cfg, peak_flops):
    """What the criteria judge beside the measured numbers: the roofline's ratio of an eager full or selective row;
    for a torch row on CUDA, the softmax backward's known fp32 (B, H, T, T) scratch and how far the allocator's
    peak lies outside [tracker peak, tracker peak + scratch] (the peak may come while the scratch is held, or not)."""
    if row["kind"] == "picockpt" and row["attention"] == "eager" and row["policy"] in ("full", "selective"):
        row["roofline_ratio"] = eager_roofline(cfg, row["batch"], row["seq"], peak_flops)[row["policy"]]
    if row["kind"] == "torch" and row.get("peak_cuda_bytes"):
        row["known_scratch_bytes"] = scratch = row["batch"] * cfg.heads * row["seq"] ** 2 * 4
        low, cuda = row["tracker_peak_bytes"], row["peak_cuda_bytes"]
        row["tracker_vs_cuda_with_scratch"] = max(low - cuda, cuda - (low + scratch), 0) / cuda


def rejudge(path):
    """A committed run's JSON judged again by today's criteria from its measured numbers: its verdicts as run move to
    "criteria_as_run" (kept from the first rejudging on), today's go to "criteria". Returns them."""
    results = json.loads(pathlib.Path(path).read_text())
    shape = {key: value for key, value in results["config"].items() if key != "parameters"}
    cfg = Config(**shape)
    for row in results["runs"]:
        judged_fields(row, cfg, results["peak_tflops"] * 1e12)
    results.setdefault("criteria_as_run", results["criteria"])
    results["criteria"] = [dict(status=status, text=text)
                           for status, text in criteria(results["runs"], results["device"].startswith("cuda"))]
    pathlib.Path(path).write_text(json.dumps(results, indent=1))
    return results["criteria"]


def plan_runs(cfg, batch, seq, segment):
    """The runs at one shape. First the headline: picockpt with fused attention (the flash kernel, what a
    GPU run should use), none / full / every:C / cheap and the planner's budget ("selective" is none
    there: nothing to drop). Then the lesson's eager rows, each with its torch equivalent as compare.py
    pairs them (the autograd reference materialises the probabilities too), and the torch runs."""
    fused = cfg.replace(attention="fused")
    runs = [dict(name=f"picockpt fused {policy}", kind="picockpt", how=policy, equivalent=None, policy=policy,
                 attention="fused") for policy in ("none", "full", f"every:{segment}", "cheap")
            + (("full+recast",) if cfg.dtype in ("bfloat16", "float16") else ())]  # 16-bit copies cast per layer
    runs += [dict(name=name, kind=kind, how=how, equivalent=equivalent, policy=how if kind == "picockpt" else None,
                  attention=cfg.attention if kind == "picockpt" else "eager")
             for name, kind, how, equivalent in contenders(cfg, seq, segment) if kind not in ("bridge", "hf")
             and "+" not in name]
    for position, (label, shape) in ((4, ("picockpt fused budget", fused)), (10, ("picockpt budget", cfg))):
        low, high = (predicted_peak_bytes(shape, batch, seq, policy) for policy in ("full", "none"))
        budget = f"budget:{(low + high) // 2}"
        try:
            predicted_peak_bytes(shape, batch, seq, budget)  # plans (picockpt/planning/planner.py)
            runs.insert(position, dict(name=label, kind="picockpt", how=budget, equivalent=None, policy=budget,
                                       attention=shape.attention))
        except ValueError as error:
            print(f"  no {label} at T={seq}: {error}")
    return runs


def run_config(run, cfg):
    """The Config a picockpt run computes with: the benchmark's, with the run's attention kind."""
    return cfg.replace(attention=run["attention"])


def hf_runs(cfg, params, device):
    """Hugging Face's LlamaForCausalLM with the same weights, sdpa attention under autocast (fp32 master weights),
    without and with its activation checkpointing: the peers of picockpt's fused none and full. None where
    transformers is missing."""
    if not peers_hf.available():
        print("  (no Hugging Face rows: transformers is not installed)")
        return []
    return [dict(name="hf sdpa" + (" + checkpointing" if checkpointing else ""), kind="hf", how=checkpointing,
                 equivalent=None, policy=None, attention="sdpa",
                 model=peers_hf.hf_llama(cfg, params, "sdpa", checkpointing, device, autocast=True))
            for checkpointing in (False, True)]  # built inside `with torch.device(device)`: its init runs there


def make_step(run, cfg, params, model, input_ids, targets):
    """step(tracker=None) -> (loss, grads): one forward + backward of `run`; nothing else outlives it."""
    if run["kind"] == "picockpt":
        shape = run_config(run, cfg)
        return lambda tracker=None: loss_and_grads(params, shape, input_ids, targets, run["how"], tracker=tracker)
    if run["kind"] == "hf":
        return hf_step(run["model"], input_ids, targets)

    def step(tracker=None):
        phase = tracker.phase if tracker else lambda name: contextlib.nullcontext()
        try:
            with phase("forward"):
                loss = model(input_ids, targets, run_layers=run["how"])  # scalar
                mark(tracker, model.casts.copies.values(), "weights")  # 16-bit copies, as picockpt marks its own
            with phase("backward"):
                loss.backward()
                grads = model.grads()  # name -> fp32 gradient
                mark(tracker, grads.values(), "gradients")
            return loss.detach(), grads
        finally:  # also after running out of memory
            model.release_weights()
            model.zero_grad(set_to_none=True)  # the returned dict is now the gradients' only holder
    return step


def hf_step(model, input_ids, targets):
    def step(tracker=None):
        phase = tracker.phase if tracker else lambda name: contextlib.nullcontext()
        try:
            with phase("forward"):
                loss = peers_hf.hf_loss(model, input_ids, targets)  # scalar; autocast casts each weight at use
            with phase("backward"):
                loss.backward()
                grads = peers_hf.hf_grads(model)  # name -> fp32 gradient
                mark(tracker, grads.values(), "gradients")
            return loss.detach(), grads
        finally:
            model.zero_grad(set_to_none=True)  # the returned dict is now the gradients' only holder
    return step


def mark(tracker, tensors, category):
    for tensor in tensors if tracker else ():
        tracker.mark(tensor, category)


def track(run, cfg, device):
    """Memory and FLOPs of one tracked step; on CUDA, the tracker beside the allocator. The torch
    runs count FLOPs in a second step: FlopCounterMode's module hooks keep checkpointed graphs
    alive until the garbage collector runs (see picockpt/measurement/tracker.py), which would inflate memory."""
    separate = run["kind"] != "picockpt"
    with Tracker(device, flops=not separate, cuda_timeline=True) as tracker:
        loss, grads = run["step"](tracker)
    del grads
    flops = tracker.flops
    if separate:
        with Tracker(device, physical=False) as counter:
            run["step"](counter)  # its loss and gradients are dropped at once
        flops = counter.flops
    row = dict(loss=loss.item(), executed_flops=sum(flops.values()), peak_cuda_bytes=tracker.peak_cuda,
               tracker_peak_bytes=max(peak["total"] for peak in tracker.peaks.values()),
               tracker_peak_activation_bytes=tracker.peak_physical)
    if run["kind"] == "picockpt":
        row.update(stored_peak_bytes=tracker.peak_logical,
                   predicted_stored_peak_bytes=predicted_peak_bytes(run_config(run, cfg), run["batch"], run["seq"],
                                                                    run["how"]),
                   timeline=[[e["total"], e["cuda"]] for e in tracker.timeline if e["kind"] == "event"])
    if tracker.cuda:
        row["tracker_vs_cuda"] = abs(row["tracker_peak_bytes"] - tracker.peak_cuda) / tracker.peak_cuda
        if run["kind"] == "picockpt":  # at every store event, as a fraction of the step's peak
            row["timeline_worst"] = max(abs(total - cuda) for total, cuda in row["timeline"]) / tracker.peak_cuda
    return row


def timed_step(step, device):
    """(seconds, CUDA peak above the start, requested peak above the start; None, None on the CPU) of one
    untracked step. The allocator's peak counts whole blocks; requested_bytes what the step asked for."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device)
        start_requested = torch.cuda.memory_stats(device)["requested_bytes.all.current"]
    start = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if not cuda:
        return seconds, None, None
    requested = torch.cuda.memory_stats(device)["requested_bytes.all.peak"] - start_requested
    return seconds, torch.cuda.max_memory_allocated(device) - start_bytes, requested


def attempt(run, action):
    """action(), unless the run already failed; a run out of memory is marked and left out after."""
    if run["error"] is not None:
        return None
    try:
        return action()
    except torch.cuda.OutOfMemoryError:
        run["error"] = "out of memory"
    gc.collect()  # outside the except block: no traceback holds the step's tensors any more
    torch.cuda.empty_cache()
    return None


def main(argv=None):
    doc_title, _, doc_rest = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=doc_title, epilog=doc_rest,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model on the CPU, in seconds (what CI runs); its files go to out/figures/ "
                             "unless $PICOCKPT_FIGURES is set")
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N (default: auto; cpu with --tiny)")
    parser.add_argument("--seqs", help="sequence lengths, comma-separated (default 1024,2048,4096; --tiny 16,32)")
    parser.add_argument("--tokens", type=int, help="tokens per step, B*T (default 8192; --tiny 64)")
    parser.add_argument("--repeats", type=int, help="timed steps of every run, median reported (default 5; --tiny 1)")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS,
                        help=f"the GPU's dense bf16 peak in TFLOP/s (default {PEAK_TFLOPS}: H200 / H100 SXM)")
    parser.add_argument("--out", help="where the JSON goes (default: beside the figures)")
    parser.add_argument("--rejudge", metavar="JSON", help="run nothing: judge a committed run's JSON again by today's "
                                                          "criteria from its numbers, and rewrite it")
    args = parser.parse_args(argv)
    if args.rejudge:
        for criterion in rejudge(args.rejudge):
            print(f"{criterion['status']:<5} {criterion['text']}")
        return 0
    threads = torch.get_num_threads()
    try:
        device = resolve_device(args.device or ("cpu" if args.tiny else "auto"))
        if device.type != "cuda" and not args.tiny:
            raise ValueError(f"--device={device}: the 1.1B-parameter benchmark needs a CUDA GPU; on the CPU add --tiny")
        text = args.seqs or ("16,32" if args.tiny else "1024,2048,4096")
        if not all(part.strip().isdigit() and int(part) > 0 for part in text.split(",")):
            raise ValueError(f"--seqs={text!r}: write positive whole numbers separated by commas, e.g. 1024,4096")
        seqs = [int(part) for part in text.split(",")]
        shape = TINY if args.tiny else ONE_B
        cfg = Config(**{**shape, "max_seq": max(shape["max_seq"], *seqs)})  # a longer rotary table costs nothing
        tokens = args.tokens if args.tokens is not None else 64 if args.tiny else 8192
        repeats = args.repeats if args.repeats is not None else 1 if args.tiny else 5
        if repeats < 1:
            raise ValueError(f"--repeats={repeats}: time at least one step of every run (e.g. --repeats 3)")
        for seq in seqs:
            cfg.check_seq(seq)
            if tokens < seq or tokens % seq:
                raise ValueError(f"--tokens={tokens} is not a multiple of the sequence length {seq}: "
                                 f"use a multiple of every one of --seqs, e.g. --tokens {2 * max(seqs)}")
        print(f"gpu benchmark on {device}: L={cfg.layers} h={cfg.hidden} H={cfg.heads} KV={cfg.kv_heads} f={cfg.ffn} "
              f"V={cfg.vocab} ({cfg.num_params() / 1e9:.2f} B parameters) in {cfg.dtype}, {tokens} tokens per step")
        if args.tiny and device.type == "cpu":
            torch.set_num_threads(1)  # ops this small run faster on one thread than on several sharing a CPU
        results = benchmark(cfg, seqs, tokens, device, repeats, 2 if args.tiny else 4, args.peak_tflops)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    prefix = "gpu_benchmark_tiny" if args.tiny else "gpu_benchmark"
    for criterion in results["criteria"]:
        print(f"{criterion['status']:<5} {criterion['text']}")
    out = pathlib.Path(args.out) if args.out else figures_dir(fast=args.tiny) / f"{prefix}.json"
    out.write_text(json.dumps(results, indent=1))
    for path in plot(results, prefix) + [out]:
        print(f"wrote {path}")
    print(f"whole run: {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

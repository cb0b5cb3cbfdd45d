"""The GPU benchmark's two figures (lessons/gpu_benchmark.py): every run's step time over picockpt none's and its
peak memory (allocator bars, tracker ticks); the tracker's and the allocator's timelines at the longest T."""
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from picockpt.teaching.plotting import policy_color, save_figure  # noqa: E402

from _gpu_criteria import LIMITS  # noqa: E402


def plot(results, prefix):
    """Two figures: every run's step time over none's and its peak memory (allocator bars, tracker
    ticks); the tracker's and the allocator's timelines of none, full and selective at the longest T."""
    rows, seqs, cuda = results["runs"], results["seqs"], results["device"].startswith("cuda")
    names = list(dict.fromkeys(row["name"] for row in rows))
    by, width = {(row["name"], row["seq"]): row for row in rows}, 0.8 / len(seqs)
    unit, unit_name = (2**30, "GiB") if cuda else (2**20, "MiB")
    title = (f"{results['gpu'] or 'CPU'}, {results['config']['parameters']:,} parameters in bf16, "
             f"{results['tokens_per_step']:,} tokens per step")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 8.5), sharex=True)
    for k, seq in enumerate(seqs):
        x = [i + (k - (len(seqs) - 1) / 2) * width for i in range(len(names))]
        get = lambda name, key: by[(name, seq)].get(key) or float("nan")  # noqa: E731  (nan: not measured)
        bars = dict(width=width, color=f"C{k}", label=f"T={seq}, batch {by[(names[0], seq)]['batch']}")
        top.bar(x, [get(name, "step_seconds") / get("picockpt none", "step_seconds") for name in names], **bars)
        bottom.bar(x, [get(name, "peak_cuda_bytes" if cuda else "tracker_peak_bytes") / unit for name in names], **bars)
        bottom.plot(x, [get(name, "tracker_peak_bytes") / unit for name in names], "k_", ms=9, mew=2,
                    label="tracker peak (total)" if k == 0 else None)
    top.axhline(LIMITS["full"], color="0.4", lw=0.8, ls="--")
    top.set(ylabel="step time / picockpt none's", title=f"{title}\nstep time (dashed: fused full's limit, "
                                                         f"{LIMITS['full']:.2f}; eager rows: their roofline)")
    bottom.set(ylabel=unit_name, title="peak above the step's start: bars " +
               ("max_memory_allocated" if cuda else "the tracker's total (no CUDA here)") + ", ticks the tracker's")
    bottom.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    for ax in (top, bottom):
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fast = prefix.endswith("_tiny")  # the --tiny run: its figures never replace a GPU run's
    paths = [save_figure(fig, f"{prefix}_time_memory", fast=fast)]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for row in rows:
        if row.get("timeline") and row["policy"] in ("none", "full", "selective"):
            color = policy_color(row["policy"])
            ax.plot([total / unit for total, _ in row["timeline"]], color=color, lw=1.2,
                    label=f"{row['name']}: tracker")
            if cuda:
                ax.plot([c / unit for _, c in row["timeline"]], ".", color=color, ms=2.5, label="  memory_allocated")
    ax.set(xlabel=f"store event of the step (T={max(seqs)})", ylabel=f"{unit_name} above the step's start",
           title=title + ": tracker (lines), allocator (dots)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(save_figure(fig, f"{prefix}_timeline", fast=fast))
    plt.close("all")
    return paths

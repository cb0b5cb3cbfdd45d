"""Where figures go, and the few plotting helpers the lessons and notebooks share.

Figures land in figures/ at the top of the repository, or in $PICOCKPT_FIGURES when it is set (the tests point it at a
temporary folder so that the committed PNGs stay untouched). A --fast run makes small, quick figures: they go to
out/figures/ (ignored by git) instead, so they never replace the committed full-size ones; $PICOCKPT_FIGURES still wins.
A figure is written to a temporary file beside its final name and then renamed over it, so an interrupted run leaves the
previous PNG whole, never a truncated one.

    path = save_figure(fig, "02_anatomy_of_a_step")    # figures/02_anatomy_of_a_step.png
    path = save_figure(fig, "02_anatomy_of_a_step", fast=True)   # out/figures/02_anatomy_of_a_step.png
    shade_phases(ax, tracker.timeline)                  # forward / recompute / backward / optimizer
    ax.plot(x, mib(bytes_list), color=policy_color("full"))

One colour per phase and one per policy, so that every figure reads the same way.
"""
import contextlib
import os
import pathlib
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]
FAST_FIGURES = REPO / "out" / "figures"  # where --fast runs write (out/ is in .gitignore)

PHASE_COLORS = {"forward": "#4C72B0", "recompute": "#DD8452", "backward": "#55A868", "optimizer": "#8172B3"}

_POLICY_COLORS = {"none": "#333333", "selective": "#4C72B0", "cheap": "#64B5CD", "full": "#C44E52",
                  "every": "#DD8452", "budget": "#8172B3"}


def figures_dir(fast=False):
    """$PICOCKPT_FIGURES if set, else out/figures/ for a fast run, else figures/ (created if missing)."""
    folder = pathlib.Path(os.environ.get("PICOCKPT_FIGURES") or (FAST_FIGURES if fast else REPO / "figures"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(_unwritable(folder, error)) from None
    return folder


def check_writable(folder):
    """Raise ValueError, naming the folder and the reason, unless a file can be created in it."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(_unwritable(folder, error)) from None
    return folder


def _unwritable(folder, error):
    where = "$PICOCKPT_FIGURES" if os.environ.get("PICOCKPT_FIGURES") else "the figures folder"
    return (f"{where} {str(folder)!r} cannot be written ({error.strerror or error}): "
            f"point $PICOCKPT_FIGURES at a folder you can write to")


def save_figure(fig, name, fast=False):
    """Save a matplotlib figure as <figures>/<name>.png (whole, through write_whole) and return the path. The figure
    stays open (a notebook still shows it); `reproduce` closes every figure after each lesson."""
    return write_whole(figures_dir(fast) / f"{name}.png",
                       lambda temporary: fig.savefig(temporary, format="png", dpi=120, bbox_inches="tight"))


def write_whole(path, write):
    """write(temporary) beside `path`, then the temporary renamed over it (os.replace): returns path."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")  # one per process: runs do not collide
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:  # an error or an interrupt: the old file stays, the partial one goes
        temporary.unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def environ(name, value):
    """os.environ[name] = value inside the block (value None: left as it is), then as it was before."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def mib(n):
    """Bytes -> MiB; works on a number or on a list of numbers."""
    if isinstance(n, (list, tuple)):
        return [value / 2**20 for value in n]
    return n / 2**20


def policy_color(policy):
    """A fixed colour for a policy string: the layer-level part decides ("every:4+cheap" -> every),
    a pure op-level policy gets its own ("selective", "cheap")."""
    layer_level = str(policy).split("+")[0].split(":")[0]
    return _POLICY_COLORS.get(layer_level, "#937860")


def phase_spans(timeline):
    """[(phase, first index, last index)] for each run of consecutive timeline entries in one phase."""
    spans = []
    for index, entry in enumerate(timeline):
        if spans and spans[-1][0] == entry["phase"]:
            spans[-1][2] = index
        else:
            spans.append([entry["phase"], index, index])
    return [tuple(span) for span in spans]


def shade_phases(ax, timeline, alpha=0.13, legend=True):
    """Colour the background of a timeline plot (x = event index) by phase."""
    labelled = set()
    for phase, first, last in phase_spans(timeline):
        if phase not in PHASE_COLORS:
            continue  # "outside": before, between or after the phases
        label = phase if legend and phase not in labelled else None
        labelled.add(phase)
        ax.axvspan(first - 0.5, last + 0.5, color=PHASE_COLORS[phase], alpha=alpha, lw=0, label=label)


def label_bars(ax, bars, texts, fontsize=8):
    """Write one text above each bar of a bar chart."""
    for bar, text in zip(bars, texts):
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=fontsize, xytext=(0, 2), textcoords="offset points")

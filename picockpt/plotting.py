"""Where figures go, and one way of saving them, shared by the lessons and notebooks.

Figures land in figures/ at the top of the repository, or in $PICOCKPT_FIGURES when it is
set (the tests point it at a temporary folder so that the committed PNGs stay untouched).
"""
import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]


def figures_dir():
    folder = pathlib.Path(os.environ.get("PICOCKPT_FIGURES", REPO / "figures"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_figure(fig, name):
    """Save a matplotlib figure as <figures>/<name>.png and return the path."""
    path = figures_dir() / f"{name}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def mib(n):
    return n / 2**20

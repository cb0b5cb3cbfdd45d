"""This machine's CPU cache sizes, read at run time: where a working set stops fitting.

An elementwise op reads and writes every byte once, so its speed is the speed of the memory level its working set fits
in. To measure that, a lesson needs the sizes of this machine's caches, not typical ones. Two places are read, in order:

    /sys/devices/system/cpu/cpu0/cache/index*/{level,type,size}   Linux: one directory per cache of cpu 0
    lscpu -C -B                                                   util-linux: one row per cache, in bytes

    sizes = read_cache_sizes()
    sizes.levels        {"L1d": 32768, "L1i": 65536, "L2": 524288, "L3": 8388608}: bytes of one instance
    sizes.data_levels   [("L1d", 32768), ("L2", 524288), ("L3", 8388608)]: what data passes through
    sizes.source        where they came from; sizes.note is "" or says why typical sizes stand in

Where neither can be read (macOS, Windows, a container without /sys), the sizes are TYPICAL (a recent x86 core's,
labelled "assumed" in `source`) and `note` says so in one line, so nothing is presented as measured that was not.
"""
import pathlib
import re
import subprocess
from dataclasses import dataclass

SYSFS = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")
TYPICAL = {"L1d": 48 * 2**10, "L1i": 32 * 2**10, "L2": 2 * 2**20, "L3": 32 * 2**20}  # bytes: assumed, not read
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30}


@dataclass(frozen=True)
class CacheSizes:
    levels: dict  # name ("L1d", "L1i", "L2", "L3") -> bytes of one instance (the share one core sees first)
    source: str   # the sysfs folder, "lscpu -C -B", or "assumed (typical sizes)"
    note: str = ""  # why the sizes are assumed, when they are

    @property
    def data_levels(self):
        """[(name, bytes)] of the caches data passes through (instruction caches left out), smallest first."""
        return sorted(((name, size) for name, size in self.levels.items() if not name.endswith("i")),
                      key=lambda item: item[1])

    @property
    def last_level(self):
        """(name, bytes) of the largest data cache: a working set beyond it streams from DRAM."""
        return self.data_levels[-1]

    def size(self, name):
        if name not in self.levels:
            raise ValueError(f"cache {name!r} is not among this machine's caches: use one of {', '.join(self.levels)}")
        return self.levels[name]


def parse_size(text):
    """Bytes in a cache size as sysfs or lscpu write it: '32K' -> 32768, '8192K', '1M', '64 KiB', '524288'."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?I?B?)\s*", str(text).upper())
    if not found:
        raise ValueError(f"cache size {text!r} is not a size: write it as 32K, 1M, 64 KiB or a number of bytes")
    return int(float(found.group(1)) * _UNITS[found.group(2)])


def from_sysfs(folder=SYSFS):
    """{name: bytes} from /sys/devices/system/cpu/cpu0/cache/index*/ (empty if the folder is not there)."""
    levels = {}
    for index in sorted(pathlib.Path(folder).glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:  # an index without these files: skip it, the others may still say enough
            continue
        suffix = {"data": "d", "instruction": "i"}.get(kind.strip().lower(), "")  # d or i: a split first level
        levels[f"L{int(level)}{suffix}"] = parse_size(size)  # 'L1d', 'L1i' or 'L2'
    return levels


def from_lscpu(text):
    """{name: bytes} from the output of `lscpu -C -B` (a header row, then NAME ONE-SIZE ... per cache)."""
    rows = [line.split() for line in text.strip().splitlines()]
    if not rows or "NAME" not in rows[0] or "ONE-SIZE" not in rows[0]:
        return {}
    name_at, size_at = rows[0].index("NAME"), rows[0].index("ONE-SIZE")
    return {row[name_at]: parse_size(row[size_at]) for row in rows[1:] if len(row) > max(name_at, size_at)}


def _run_lscpu():
    try:
        return subprocess.run(["lscpu", "-C", "-B"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):  # no lscpu (macOS, Windows) or it hung
        return ""


def read_cache_sizes(folder=SYSFS, lscpu=_run_lscpu):
    """This machine's cache sizes: sysfs first, then `lscpu -C -B`, else TYPICAL, said in `note`."""
    levels = from_sysfs(folder)
    if _usable(levels):
        return CacheSizes(levels, str(folder))
    levels = from_lscpu(lscpu())
    if _usable(levels):
        return CacheSizes(levels, "lscpu -C -B")
    typical = ", ".join(f"{name} {size // 2**10:,} KiB" for name, size in TYPICAL.items())
    return CacheSizes(dict(TYPICAL), "assumed (typical sizes)",
                      note=f"this machine's cache sizes could not be read (no {folder}, no `lscpu -C -B`): "
                           f"typical sizes stand in ({typical}), so the working sets chosen from them may not sit "
                           f"where the lesson says")


def _usable(levels):
    """At least one data cache beyond L1: enough to choose an in-cache and a DRAM working set."""
    return any(size > 0 and not name.startswith("L1") for name, size in levels.items())

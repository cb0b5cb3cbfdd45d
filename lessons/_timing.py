"""How the lessons time things: contenders interleaved round by round, a ratio taken within each round (a drift
that slows every contender alike cancels in it), its spread over the rounds, and a claim drawn only when every
round agrees (else "inconclusive on this machine"). `_lesson` re-exports these: lessons import them from there."""
import statistics
import time
from dataclasses import dataclass

import torch

FAST_TIMING = "timing not meaningful at --fast shapes"  # what lessons print instead of a --fast timing's verdict


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_seconds(steps, device, repeats, before=None, clock=time.perf_counter):
    """{name: Spread of seconds} of each step in {name: step()}, after one warm-up call of
    each. Each repeat runs every step once, in turn, so a slow moment of a shared machine slows
    them all alike; paired_ratios(a, b) divides them repeat by repeat. before: {name: setup()}, run
    untimed just before each call of that step (e.g. to evict its operands from the caches).
    clock: wall time by default; compute_clock(device) for the CPU time of this thread."""
    before = before or {}
    for name, step in steps.items():
        before.get(name, _nothing)()
        step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            before.get(name, _nothing)()
            _sync(device)
            start = clock()
            step()
            _sync(device)
            times[name].append(clock() - start)
    return {name: Spread(tuple(values)) for name, values in times.items()}


def _nothing():
    pass


def compute_clock(device):
    """The clock that leaves out the moments a shared machine gives this core to another program: on the CPU
    with one torch thread (--threads 1, the default), the CPU time of this thread (time.thread_time: torch
    computes in the calling thread); otherwise (a GPU, whose kernels run while the CPU waits, or several
    threads) wall time, time.perf_counter."""
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def clock_words(clock):
    """What a Spread from interleaved_seconds(..., clock=clock) measured, in words for a table's heading."""
    return "this thread's CPU time" if clock is time.thread_time else "wall time"


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one quantity (seconds, or a ratio of two). One timing on a shared
    machine can be off by tens of percent, so every timing is shown as median [min..max]."""
    samples: tuple

    @property
    def low(self):
        return min(self.samples)

    @property
    def median(self):
        return statistics.median(self.samples)

    @property
    def high(self):
        return max(self.samples)

    def text(self, spec="{:.3g}", scale=1.0, shift=0.0):
        """'median [min..max]', each value v written as spec.format(v * scale + shift):
        text("{:.1f}", scale=1e3) for milliseconds, text("{:+.1%}", shift=-1) for a ratio as a change."""
        def show(value):
            return spec.format(value * scale + shift)
        return f"{show(self.median)} [{show(self.low)}..{show(self.high)}]"

    def excludes(self, value):
        """True when every sample lies on one side of `value` (e.g. 1 for a ratio: a difference
        the repeats agree on); False when the spread straddles it."""
        return self.low > value or self.high < value


def paired_ratios(spread, base):
    """Spread of spread.samples[i] / base.samples[i]: the ratio within each interleaved repeat."""
    return Spread(tuple(a / b for a, b in zip(spread.samples, base.samples)))


@dataclass(frozen=True)
class Claim:
    """What a lesson may say about a measured ratio: `text`, one line to print; `conclusive`, whether the prose
    may draw the claim's conclusion from the timing (False: it shows the exact work figure instead); `short`,
    the same verdict in a few words for a results table (the spread, or "inconclusive ..." with the work)."""
    text: str
    conclusive: bool
    short: str = ""


def timed_claim(mode, ratio, what, expect, work=None):
    """Check a measured time ratio against what must hold before a lesson concludes from it.

    ratio    a Spread of paired ratios, contender / baseline (paired_ratios of interleaved_seconds)
    what     what the ratio is, e.g. "full / none, step time"
    expect   ">1" or "<1": the side of 1 the claim puts the ratio on (full recomputation does more work than
             none, so full / none time must be > 1; a step that hides a wait must be < 1)
    work     the same ratio computed from work (FLOPs or bytes: exact, the same on every machine), shown
             when the timing cannot be trusted. It must not sit on the other side of 1 from `expect` (a
             ValueError: the claim contradicts its own count); 1 (equal work, e.g. elementwise rebuilds
             that a FLOP count leaves out) is neutral

    Conclusive only when every repeat lies on the expected side of 1. Otherwise the line says the timing
    was inconclusive on this machine and why (the repeats straddle 1, or every one of them contradicts the
    claim: more work measured as faster), and gives the work ratio instead. At --fast: FAST_TIMING, never
    conclusive (steps of milliseconds, one repeat)."""
    if expect not in (">1", "<1"):
        raise ValueError(f"expect={expect!r}: use '>1' or '<1' (the side of 1 the claim puts the ratio on)")
    above = expect == ">1"
    if work is not None and work != 1 and (work > 1) != above:
        raise ValueError(f"work={work:.3f} puts the ratio on the other side of 1 from expect={expect!r}: "
                         f"the claim contradicts its own exact count")
    if mode == "fast":
        return Claim(f"{what}: {FAST_TIMING}", False, FAST_TIMING)
    side = "above" if above else "below"
    measured = f"{ratio.text('{:.3f}')} over {len(ratio.samples)} interleaved repeat{'s' * (len(ratio.samples) > 1)}"
    by_work = "" if work is None else f"; by work (exact) it is {work:.3f}"
    if (ratio.low > 1) if above else (ratio.high < 1):
        return Claim(f"{what}: {measured} (every repeat {side} 1){by_work}", True, ratio.text("{:.3f}"))
    if not ratio.excludes(1.0):
        why = "the repeats straddle 1"
    else:
        why = (f"every repeat is {'below' if above else 'above'} 1, against the claim"
               + (f", though the exact work puts it {side} 1" if work is not None and work != 1 else ""))
    short = f"inconclusive ({ratio.text('{:.3f}')}" + ("" if work is None else f"; by work {work:.3f}") + ")"
    return Claim(f"{what}: inconclusive on this machine ({measured}: {why}){by_work}", False, short)


def timing_verdict(mode, ratio, what):
    """One line on a measured time ratio: its spread, whether the repeats agree on its sign, or
    that --fast shapes say nothing (milliseconds of Python overhead, one repeat)."""
    if mode == "fast":
        return f"{what}: {FAST_TIMING}"
    agreed = "every repeat agrees on the sign" if ratio.excludes(1.0) else "the repeats straddle 0: within the noise"
    return f"{what}: {ratio.text('{:+.1%}', shift=-1)} over {len(ratio.samples)} repeats ({agreed})"

"""What a step under a schedule costs with a host tier beside the device: exact bytes and a modelled time.

walk(...) follows the engine's loop (picockpt/recompute/engine.py, picockpt/recompute/offload.py) over byte counts, as
planner.replay does for two actions, with a host tier beside the device:
    first forward   a put that Schedule.host names goes to the host (host bytes), any other to the device
    backward        the head's backward runs while the last layer's host tensors come back; layer i's
                    backward runs while layer i-1's come back (its own if it is stored whole, else the
                    checkpoint its recompute starts from); a prefetched tensor is device bytes again
It gives the device's and the host's exact peaks (the store's counts) and the bytes copied each way, and a modelled
time: compute at `rate` FLOP/s on one stream, copies at `bandwidth` bytes/s on one side stream, in order (first in,
first out), each starting when its tensor exists and the side stream is free. The compute stream never waits for an
offload; it waits for a prefetch only when the backward reaches a tensor whose copy has not finished. So a copy costs
time only where it cannot hide behind the compute it overlaps:

    modelled time = (forward + recompute + backward FLOPs) / rate + the waits for copies (exposed)

The store counts an offloaded tensor's device bytes as gone at its put; on a GPU its memory goes back to the allocator
when its copy has read it (record_stream), so copies that queue behind each other keep device memory in flight that the
plan's peak does not show (CUDA's max_memory_allocated does). Backward FLOPs are modelled as 2x the forward's (each
matmul's two gradients). The defaults are a PCIe Gen5 x16 link and an H200's dense BF16 Tensor Core rate, from
picockpt/planning/hardware.py (its sources there): DEFAULT_HOST_BANDWIDTH and DEFAULT_COMPUTE_RATE below.
"""
import functools
from dataclasses import dataclass

from .layer_forms import layer_flops, layer_inventory
from .hardware import H200_SXM_BF16, PCIE_GEN5_X16

DEFAULT_HOST_BANDWIDTH = PCIE_GEN5_X16  # bytes/s: PCIe Gen5 x16, per direction, theoretical (not measured)
DEFAULT_COMPUTE_RATE = H200_SXM_BF16    # FLOP/s: H200 SXM, dense BF16 Tensor Core


def check_rates(bandwidth, rate):
    """bandwidth (bytes/s) and rate (FLOP/s) must be positive, finite numbers."""
    for name, value, example in (("host bandwidth", bandwidth, f"{PCIE_GEN5_X16:.3g} (PCIe Gen5 x16)"),
                                 ("compute rate", rate, f"{H200_SXM_BF16:.4g} (H200 dense BF16)")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name}={value!r}: give a positive number, e.g. {example}")


@dataclass(frozen=True)
class Costs:
    """What the walk needs from a model beyond the chain: FLOPs to time compute, bytes of named tensors."""
    layer_forward: int       # FLOPs of one layer's forward
    layer_backward: int      # FLOPs of one layer's backward (modelled: 2x the forward's)
    head_forward: int
    head_backward: int
    host_bytes: object       # (mode, names) -> bytes of a layer's first forward that go to the host, input apart


def model_costs(cfg, batch, seq, unstored=frozenset()):
    forward = sum(layer_flops(cfg, batch, seq).values())
    head = 2 * batch * seq * cfg.hidden * cfg.vocab

    @functools.lru_cache(maxsize=None)
    def host_bytes(mode, names):  # the bytes of the names a layer stored as `mode` puts on the host, input apart
        stored = layer_inventory(cfg, batch, seq, mode.unstored(unstored))
        return sum(b for name, (_, _, b) in stored.items()
                   if name != "input" and ("*" in names or name.partition("[")[0] in names))
    return Costs(forward, 2 * forward, head, 2 * head, host_bytes)


@dataclass(frozen=True)
class Walk:
    device_peak: int         # the store's device bytes at their highest (the Tracker's peak_logical)
    host_peak: int           # the store's host bytes at their highest (the Tracker's peak_host)
    to_host: int             # bytes copied device -> host (forward)
    to_device: int           # bytes copied host -> device (backward)
    recompute_flops: int
    compute_seconds: float   # every FLOP at the rate
    exposed_seconds: float   # waits for copies the compute could not hide
    layers: tuple            # per layer: dict(host=bytes offloaded, copy=seconds, wait=seconds exposed at its use)
    peak_at: tuple = ()      # where the device peak is first reached: (phase, layer, target), see walk's `now`
    peak_held: tuple = ()    # what the device holds then: ((what, bytes), ...), the parts of device_peak

    @property
    def seconds(self):
        return self.compute_seconds + self.exposed_seconds


def walk(chain, schedule, costs, bandwidth=DEFAULT_HOST_BANDWIDTH, rate=DEFAULT_COMPUTE_RATE):
    """The step under `schedule`, by the engine's loop, on byte counts and a modelled clock (see above)."""
    check_rates(bandwidth, rate)
    L = len(chain) - 1
    host_sets = schedule.host or (frozenset(),) * L
    device = host = device_peak = host_peak = to_host = to_device = recompute = 0
    clock = free = exposed = 0.0  # the compute stream's time, the time the side stream is next free
    inputs = {}       # layer -> where its stored input is: "device" or "host"
    dev, off = {}, {}  # layers stored whole -> their bytes besides the input: on the device, on the host
    modes = {}        # layers stored whole -> the mode they were stored with (for their rebuild FLOPs)
    arrives = {}      # layer -> when its last prefetch lands
    info = [dict(host=0, copy=0.0, wait=0.0) for _ in range(L)]
    now = ("forward", 0, None)  # what the step is doing: (forward | head | recompute | backward, layer, target)
    head = peak_at = peak_held = ()

    def held():  # the device's bytes by what holds them, in words (they sum to `device`): the peak's explanation
        whole = sorted(k for k in dev if dev[k] or inputs.get(k) == "device")
        kept = sorted(k for k, where in inputs.items() if where == "device" and k not in dev)
        parts = ((f"layer {whole[0]}'s tensors" if len(whole) == 1 else f"{len(whole)} layers' tensors",
                  sum(dev[k] + (chain[k].input_bytes if inputs.get(k) == "device" else 0) for k in whole)),
                 (f"layer {kept[0]}'s checkpoint" if len(kept) == 1 else f"the checkpoints of {len(kept)} layers",
                  sum(chain[k].input_bytes for k in kept)), ("the head's logits and loss", sum(head)))
        return tuple(part for part in parts if part[1])

    def peaks():
        nonlocal device_peak, host_peak, peak_at, peak_held
        if device > device_peak:
            peak_at, peak_held = now, held()
        device_peak, host_peak = max(device_peak, device), max(host_peak, host)

    def copy(nbytes, k):  # one copy on the side stream, queued now: when it lands
        nonlocal free
        free = max(free, clock) + nbytes / bandwidth
        info[k]["copy"] += nbytes / bandwidth
        return free

    def run_layers(first, last, mode_of, first_forward):
        nonlocal device, host, to_host, recompute, clock, now
        for k in range(first, last + 1):
            now = ("forward", k, None) if first_forward else ("recompute", k, last)
            mode, stage = mode_of(k), chain[k]
            names = host_sets[k] if first_forward else frozenset()
            moved = 0
            if mode.keeps_input and k not in inputs:
                away = "*" in names or "input" in names
                inputs[k] = "host" if away else "device"
                moved += stage.input_bytes if away else 0
                device += 0 if away else stage.input_bytes
            if mode.stored:
                assert k not in dev, f"layer {k} would be stored whole twice"
                a = next(a for m, a, _ in stage.variants if m == mode)
                off[k] = costs.host_bytes(mode, names) if names else 0
                dev[k], modes[k] = a - stage.input_bytes - off[k], mode
                device += dev[k]
                moved += off[k]
            host += moved
            to_host += moved
            peaks()
            stops = not first_forward and schedule.stop_early and k == last  # a sweep's last layer skips its tail
            flops = stage.forward_flops - (stage.tail_flops if stops else 0)
            recompute += 0 if first_forward else flops
            clock += flops / rate
            if moved:
                info[k]["host"] += moved
                copy(moved, k)  # offloaded while the next layer's forward runs

    def bring(k, nbytes):  # host -> device: device bytes again from now on; lands when the side stream is done
        nonlocal device, host, to_device
        device, host, to_device = device + nbytes, host - nbytes, to_device + nbytes
        peaks()
        arrives[k] = copy(nbytes, k)

    def prefetch(i):  # offload.prefetch_for: what layer i's backward needs next, back from the host
        if i < 0:
            return
        if i in dev:  # stored whole: all its host tensors
            nbytes = off[i] + (chain[i].input_bytes if inputs.get(i) == "host" else 0)
            dev[i], off[i] = dev[i] + off[i], 0
            if i in inputs:
                inputs[i] = "device"
            if nbytes:
                bring(i, nbytes)
            return
        j = next((k for k in range(i, -1, -1) if k in inputs), None)  # the checkpoint its recompute starts from
        if j is not None and inputs[j] == "host":
            inputs[j] = "device"
            bring(j, chain[j].input_bytes)

    def wait_for(k):  # the compute stream reads layer k's prefetched tensors
        nonlocal clock, exposed
        if k in arrives:
            late = max(0.0, arrives.pop(k) - clock)
            clock, exposed = clock + late, exposed + late
            info[k]["wait"] += late

    run_layers(0, L - 1, lambda k: schedule.forward[k], first_forward=True)
    head = (next(a for mode, a, _ in chain[L].variants if mode == schedule.head),)
    device += head[0]
    now = ("head", L, None)
    peaks()
    clock += costs.head_forward / rate
    prefetch(L - 1)
    clock += costs.head_backward / rate
    device -= head[0]
    head = ()
    recompute += chain[L].inner_flops
    for i in reversed(range(L)):
        now = ("backward", i, None)
        if i not in dev:  # gone: recompute from the nearest checkpoint
            j = max(k for k in inputs if k <= i)
            if inputs[j] == "host":  # never prefetched: fetched now (the store's "fetch")
                inputs[j] = "device"
                bring(j, chain[j].input_bytes)
            wait_for(j)
            run_layers(j, i, lambda k: schedule.sweep(k, i), first_forward=False)
        wait_for(i)
        now = ("backward", i, None)
        prefetch(i - 1)
        r = next(r for m, _, r in chain[i].variants if m == modes[i])
        recompute += r + chain[i].inner_flops
        clock += (costs.layer_backward + r + chain[i].inner_flops) / rate
        assert off[i] == 0 and inputs.get(i) != "host", f"layer {i}'s backward would fetch from the host"
        device -= dev.pop(i) + (chain[i].input_bytes if inputs.pop(i, None) else 0)
        del off[i], modes[i]
    assert device == 0 and host == 0, "the schedule leaves tensors stored"
    return Walk(device_peak, host_peak, to_host, to_device, recompute, clock - exposed, exposed, tuple(info), peak_at,
                peak_held)

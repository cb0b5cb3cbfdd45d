"""The activation store: every tensor a backward will need, under a stable name.

Keys are (layer, name): layer is the decoder layer's index, or None for the model-level tensors around the layers (final
norm, logits). Names are stable and read as the model does: "input", "attn_norm.rstd", "attn.probs", "mlp.act" ...

The store is the *logical* view of activation memory: it counts the bytes of the unique storages it holds (two views of
one storage count once), and it records every put, get, pop and rebuild as an event. Listeners (the tracker) receive
each event; the store itself holds tensors only while they are stored.

With a host tier (picockpt/recompute/offload.py) a put may go to host memory instead: the store then holds the
host copy and counts it in host_bytes, apart from the device's `bytes`; prefetch(layer) brings a
layer's host tensors back (device bytes again) before the backward reads them, and a get or pop of
one still on the host fetches it then. Every event says where its tensor is ("device" or "host").
"""
import contextlib
from collections import namedtuple

# no tensor inside: safe to keep. live_bytes: the device's stored bytes; host_bytes: the host tier's
Event = namedtuple("Event", "kind layer name bytes live_bytes host_bytes where", defaults=(0, "device"))


def _storage_key(tensor):
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr()), storage.nbytes()


class ActivationStore:
    def __init__(self, listener=None, host=None):
        self.tensors = {}        # (layer, name) -> tensor on the device
        self.storages = {}       # storage key -> [number of stored tensors on it, bytes]
        self.bytes = 0           # bytes of unique device storages held now
        self.peak_bytes = 0
        self.host = host         # a HostTier (picockpt/recompute/offload.py), or None: every put stays on the device
        self.host_tensors = {}   # (layer, name) -> Copy: the tensors held in host memory
        self.arriving = {}       # (layer, name) -> Arrival: prefetched, its copy perhaps in flight (CUDA)
        self.host_bytes = 0      # bytes of the host copies held now (each tensor's own bytes)
        self.events = []
        self.listener = listener  # object with .on_event(Event) and .phase(name), e.g. a Tracker

    # -- the four verbs ------------------------------------------------------
    def put(self, layer, name, tensor):
        key = (layer, name)
        if self.has(layer, name):
            raise KeyError(f"activation {_label(layer, name)} is already stored")
        if self.host is not None and self.host.wants(layer, name):  # to host memory, copied now
            self.host_tensors[key] = self.host.to_host(tensor)
            self.host_bytes += tensor.nbytes
            return self._event("put", layer, name, tensor.nbytes, "host")
        self._hold(key, tensor)
        self._event("put", layer, name, tensor.nbytes)

    def prefetch(self, layer, names=None):
        """Start bringing layer's host tensors (of `names`; None: all) back to the device."""
        for lay, name in [key for key in self.host_tensors if key[0] == layer and (names is None or key[1] in names)]:
            self._fetch(lay, name, "prefetch")

    def get(self, layer, name):
        tensor = self._lookup(layer, name)
        self._event("get", layer, name, tensor.nbytes)
        return tensor

    def pop(self, layer, name, rebuild=None):
        """Take a tensor out (the backward's last use of it). If the policy dropped it,
        `rebuild` (a one-line recipe from tensors the backward has) makes it again."""
        key = (layer, name)
        if not self.has(layer, name) and rebuild is not None:
            return self.rebuild(layer, name, rebuild)
        tensor = self._lookup(layer, name)
        del self.tensors[key]
        skey, _ = _storage_key(tensor)
        count = self.storages[skey]
        count[0] -= 1
        if count[0] == 0:  # the last stored view of this storage: its bytes are released
            del self.storages[skey]
            self.bytes -= count[1]
        self._event("pop", layer, name, tensor.nbytes)
        return tensor

    def rebuild(self, layer, name, recipe):
        """Recompute a dropped tensor for immediate use; it is *not* stored (working memory)."""
        with self.recomputing():
            tensor = recipe()
        self._event("rebuild", layer, name, tensor.nbytes)
        return tensor

    def recomputing(self):
        """A context for recomputation done inside an op (a tiled attention's tiles, a chunk of
        logits): the listener counts it in the "recompute" phase."""
        return contextlib.nullcontext() if self.listener is None else self.listener.phase("recompute")

    # -- questions -----------------------------------------------------------
    def has(self, layer, name):  # on the device or on the host
        return (layer, name) in self.tensors or (layer, name) in self.host_tensors

    def names(self, layer):
        return [name for (lay, name) in list(self.tensors) + list(self.host_tensors) if lay == layer]

    def host_names(self, layer):
        return [name for (lay, name) in self.host_tensors if lay == layer]

    def layer_bytes(self, layer):  # bytes of the unique device storages one layer's tensors are on
        return sum(dict(_storage_key(t) for (lay, _), t in self.tensors.items() if lay == layer).values())

    def inventory(self, layer):
        """name -> (shape, dtype, bytes) of what is stored for one layer now (device and host)."""
        held = {**self.tensors, **{key: copy.host for key, copy in self.host_tensors.items()}}
        return {name: (tuple(t.shape), str(t.dtype).replace("torch.", ""), t.nbytes)
                for (lay, name), t in held.items() if lay == layer}

    # -- internals -----------------------------------------------------------
    def _hold(self, key, tensor):  # a device tensor: its storage's bytes are counted once
        self.tensors[key] = tensor
        skey, nbytes = _storage_key(tensor)
        count = self.storages.setdefault(skey, [0, nbytes])
        count[0] += 1
        if count[0] == 1:  # a new storage: its bytes are now held
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)

    def _fetch(self, layer, name, kind):  # host -> device; "fetch": asked for by a read, not ahead of it
        key = (layer, name)
        copy = self.host_tensors.pop(key)
        tensor, arrival = self.host.to_device(copy)
        self.host_bytes -= tensor.nbytes
        self._hold(key, tensor)
        if arrival is not None:
            self.arriving[key] = arrival
        self._event(kind, layer, name, tensor.nbytes)

    def _lookup(self, layer, name):
        key = (layer, name)
        if key in self.host_tensors:  # never prefetched: fetched now
            self._fetch(layer, name, "fetch")
        if key in self.arriving:  # the compute stream waits for its copy (CUDA), once
            self.tensors[key] = self.host.ready(self.arriving.pop(key))
        try:
            return self.tensors[key]
        except KeyError:
            held = ", ".join(self.names(layer)) or "nothing"
            raise KeyError(f"activation {_label(layer, name)} is not stored (layer holds: {held})") from None

    def _event(self, kind, layer, name, nbytes, where="device"):
        event = Event(kind, layer, name, nbytes, self.bytes, self.host_bytes, where)
        self.events.append(event)
        if self.listener is not None:
            self.listener.on_event(event)


def _label(layer, name):
    return name if layer is None else f"layer {layer} {name}"


def format_inventory(inventory, title):
    """A printable table of name -> shape -> bytes, under its title."""
    lines = [title, f"{'name':<22}{'shape':<24}{'dtype':<10}{'bytes':>14}"]
    lines += [f"{name:<22}{str(shape):<24}{dtype:<10}{nbytes:>14,}"
              for name, (shape, dtype, nbytes) in inventory.items()]
    lines.append(f"{'total':<56}{sum(v[2] for v in inventory.values()):>14,}")
    return "\n".join(lines)

"""The activation store: every tensor a backward will need, under a stable name.

Keys are (layer, name): layer is the decoder layer's index, or None for the
model-level tensors around the layers (final norm, logits). Names are stable
and read as the model does: "input", "attn_norm.rstd", "attn.probs", "mlp.act" ...

The store is the *logical* view of activation memory: it counts the bytes of the
unique storages it holds (two views of one storage count once), and it records
every put, get, pop and rebuild as an event. Listeners (the tracker) receive
each event; the store itself holds tensors only while they are stored.
"""
import contextlib
from collections import namedtuple

Event = namedtuple("Event", "kind layer name bytes live_bytes")  # no tensor inside: safe to keep


def _storage_key(tensor):
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr()), storage.nbytes()


class ActivationStore:
    def __init__(self, listener=None):
        self.tensors = {}        # (layer, name) -> tensor
        self.storages = {}       # storage key -> [number of stored tensors on it, bytes]
        self.bytes = 0           # bytes of unique storages held now
        self.peak_bytes = 0
        self.events = []
        self.listener = listener  # object with .on_event(Event) and .phase(name), e.g. a Tracker

    # -- the four verbs ------------------------------------------------------
    def put(self, layer, name, tensor):
        key = (layer, name)
        if key in self.tensors:
            raise KeyError(f"activation {_label(layer, name)} is already stored")
        self.tensors[key] = tensor
        skey, nbytes = _storage_key(tensor)
        count = self.storages.setdefault(skey, [0, nbytes])
        count[0] += 1
        if count[0] == 1:  # a new storage: its bytes are now held
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        self._event("put", layer, name, tensor.nbytes)

    def get(self, layer, name):
        tensor = self._lookup(layer, name)
        self._event("get", layer, name, tensor.nbytes)
        return tensor

    def pop(self, layer, name, rebuild=None):
        """Take a tensor out (the backward's last use of it). If the policy dropped it,
        `rebuild` (a one-line recipe from tensors the backward has) makes it again."""
        key = (layer, name)
        if key not in self.tensors and rebuild is not None:
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
        if self.listener is None:
            tensor = recipe()
        else:
            with self.listener.phase("recompute"):
                tensor = recipe()
        self._event("rebuild", layer, name, tensor.nbytes)
        return tensor

    def recomputing(self):
        """A context for recomputation done inside an op (a tiled attention's tiles, a chunk of
        logits): the listener counts it in the "recompute" phase."""
        return contextlib.nullcontext() if self.listener is None else self.listener.phase("recompute")

    # -- questions -----------------------------------------------------------
    def has(self, layer, name):
        return (layer, name) in self.tensors

    def names(self, layer):
        return [name for (lay, name) in self.tensors if lay == layer]

    def inventory(self, layer):
        """name -> (shape, dtype, bytes) of what is stored for one layer now."""
        return {name: (tuple(t.shape), str(t.dtype).replace("torch.", ""), t.nbytes)
                for (lay, name), t in self.tensors.items() if lay == layer}

    def clear(self):
        self.tensors.clear()
        self.storages.clear()
        self.bytes = 0

    # -- internals -----------------------------------------------------------
    def _lookup(self, layer, name):
        try:
            return self.tensors[(layer, name)]
        except KeyError:
            held = ", ".join(self.names(layer)) or "nothing"
            raise KeyError(f"activation {_label(layer, name)} is not stored (layer holds: {held})") from None

    def _event(self, kind, layer, name, nbytes):
        event = Event(kind, layer, name, nbytes, self.bytes)
        self.events.append(event)
        if self.listener is not None:
            self.listener.on_event(event)


def _label(layer, name):
    return name if layer is None else f"layer {layer} {name}"


def format_inventory(inventory, title=""):
    """A printable table of name -> shape -> bytes."""
    lines = [title] if title else []
    lines.append(f"{'name':<22}{'shape':<24}{'dtype':<10}{'bytes':>14}")
    for name, (shape, dtype, nbytes) in inventory.items():
        lines.append(f"{name:<22}{str(shape):<24}{dtype:<10}{nbytes:>14,}")
    lines.append(f"{'total':<56}{sum(v[2] for v in inventory.values()):>14,}")
    return "\n".join(lines)

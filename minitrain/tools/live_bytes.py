"""An allocator-free count of the bytes a piece of PyTorch code holds: how the memory model is checked on a CPU."""

import weakref

import torch

from minitrain.compat import TorchDispatchMode, is_traceable_wrapper_subclass, tree_leaves


def _plain_tensors(tree):
    """The tensors with storages in `tree`: a wrapper subclass (torchao's float8 tensors) holds none of its own,
    so its inner tensors stand for it."""
    for t in tree_leaves(tree):
        if is_traceable_wrapper_subclass(t):
            yield from _plain_tensors([getattr(t, name) for name in t.__tensor_flatten__()[0]])
        elif isinstance(t, torch.Tensor):
            yield t


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside the context that are still alive, and their peak.

    An allocator-free measurement (it works on CPU) of what a step really holds: a storage counts from the
    op that creates it until its last tensor dies, saved-for-backward ones included, because PyTorch keeps
    a storage's Python object alive exactly as long as the storage. Views and in-place ops add nothing,
    nor do storages made before the context (parameters).
    """

    def __init__(self):
        super().__init__()
        self.current = self.peak = 0
        self._live: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._live.discard(key)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in _plain_tensors((args, kwargs))}
        for t in _plain_tensors(out):
            if t.device.type != "meta":
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._live and key not in inputs:  # new, not a view or in-place
                    self._live.add(key)
                    self.current += nbytes
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._release, key, nbytes)
        return out

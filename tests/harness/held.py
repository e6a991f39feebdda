"""What a process holds in tensors, measured: every storage that torch's allocator made and a
live tensor views, once (a DTensor by its local shard), found by the garbage collector. A view
of memory torch did not allocate (a mapped safetensors file, numpy's arrays) is not held: on a
GPU the same count is the device's allocated bytes. Not the admission check's arithmetic
(distlm.settings.layout_rules), which tests/test_fsdp.py holds against it."""

from __future__ import annotations

import gc

import torch


def held_bytes(*, collect: bool = True) -> int:
    """Bytes of every storage torch allocated that a live tensor of this process views, each
    once: the tensors the garbage collector finds, and the gradient of each (which autograd
    holds in C++: a parameter's, a whole unsharded parameter's, DDP's bucket views). `collect`:
    cyclic garbage goes first (slow); without it, what is left of it counts too."""
    from torch.distributed.tensor import DTensor

    if collect:
        gc.collect()
    seen: set[int] = set()
    total = 0

    def count(t: torch.Tensor) -> None:
        nonlocal total
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.is_meta:
            return
        storage = t.untyped_storage()
        if not storage.resizable():  # not torch's allocation: a mapped file, numpy's memory
            return
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            count(o)
            if o.is_leaf and o.requires_grad and o.grad is not None:
                count(o.grad)
    return total


class SavedBytes:
    """Bytes of what autograd keeps for the backward pass while it is entered (activations: the
    saved tensors that are not among `params`' storages), each storage once."""

    def __init__(self, params) -> None:
        from torch.distributed.tensor import DTensor

        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        self.skip = {p.untyped_storage().data_ptr() for p in local}
        self.seen: set[int] = set()
        self.bytes = 0

    def _pack(self, t: torch.Tensor):
        if type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.skip and ptr not in self.seen:
                self.seen.add(ptr)
                self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

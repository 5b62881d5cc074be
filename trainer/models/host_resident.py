"""Frozen modules that live in host memory and visit the accelerator for a moment.

FLUX's and SD3's text encoders (T5-XXL alone is 4.7B parameters, 9.5 GB in bf16) run only
when an iteration brings prompts the cache has not seen, and the transformer needs their GPU
memory the rest of the time. Moving them with `.to("cuda")` and back with `.to("cpu")` costs
two full copies per visit, and the copy back is the slow one (pageable memory: 6.0 to 6.8 s
for T5-XXL + CLIP-L on an H200, against 0.03 s of encoding). The weights are frozen, so the
device copy never holds anything the host copy lacks: the trip back is only pointing the
module's tensors at the host copy again, which costs nothing, and the host copy is pinned so
that the trip there is a DMA at the bus's speed (benchmarks/text_encoders.py measures both).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
from torch import nn


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return itertools.chain(module.named_parameters(prefix="p"), module.named_buffers(prefix="b"))


class HostResident:
    """`module` (frozen: nothing may train it) kept in host memory, pinned when `pin`, that
    `visit(device)` places on `device` for the length of a `with` block."""

    def __init__(self, module: nn.Module, *, pin: bool) -> None:
        self.module = module
        if pin:  # one copy, once: every later visit reads from it
            for _, tensor in _tensors(module):
                if tensor.device.type == "cpu" and not tensor.is_pinned():
                    tensor.data = tensor.data.pin_memory()
        self.home = {name: tensor.data for name, tensor in _tensors(module)}
        self.visits = 0  # trips to an accelerator so far (what the tests count)

    @contextlib.contextmanager
    def visit(self, device: torch.device) -> Iterator[nn.Module]:
        """The module on `device` inside the block, back in host memory after it (a no-op
        on the CPU)."""
        if device.type == "cpu":
            yield self.module
            return
        self.visits += 1
        self.module.to(device, non_blocking=True)
        try:
            yield self.module
        finally:
            self.send_home()

    def send_home(self) -> None:
        """Point every tensor at its host copy again; the device copies are freed with their
        last reference (the caching allocator keeps the memory for the transformer)."""
        for name, tensor in list(_tensors(self.module)):
            home = self.home[name]
            if torch._has_compatible_shallow_copy_type(tensor, home):  # CPU and CUDA tensors
                tensor.data = home
                continue
            # a device whose tensors are of another kind (meta, say) had `.to()` put new
            # tensors in the module: put the host ones in their place the same way
            kind, _, path = name.partition(".")
            owner_path, _, leaf = path.rpartition(".")
            owner = self.module.get_submodule(owner_path) if owner_path else self.module
            if kind == "p":
                owner._parameters[leaf] = nn.Parameter(home, requires_grad=False)
            else:
                owner._buffers[leaf] = home

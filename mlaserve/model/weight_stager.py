"""Checkpoint regions to the GPU through pinned staging buffers, copies asynchronous.

A copy from pageable memory (what `safe_open` returns) is synchronous and bounced through the
driver's own buffer: the host waits for every tensor's DMA, and nothing overlaps. Here each
region is copied by the CPU (page cache -> pinned slot; a torch copy, GIL released) and then DMA'd
(`non_blocking`) into a fresh device tensor, so the next region's CPU copy runs while this one's
DMA does, and several reader threads can fill slots at once.

Ownership of a slot (the rule the whole thing rests on):
    a slot is taken from the free queue by one thread, which first waits on the slot's event
    (the DMA that last read it has finished), fills it, enqueues the DMA from it, records the
    event after that DMA on the same stream, and only then puts it back in the queue.
So a slot is written only by the thread that holds it and only after the GPU finished reading
it; a thread holds one slot at a time (no hold-and-wait, no deadlock).

Streams: everything goes on the device's current stream of the calling thread, which is the
default stream in the loader's threads: the DMA into the device tensor, then the layer's
`param.copy_` from it (the dtype cast happens there, on the device), in the order the thread
issued them. No side stream, so a device tensor is never freed while another stream still
uses it. A tensor larger than a slot goes in row chunks (or element chunks, if contiguous).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

import torch

__all__ = ["WeightStager"]

DEFAULT_SLOT_BYTES = 64 << 20


@dataclass
class _Slot:
    buffer: torch.Tensor  # pinned uint8
    event: torch.cuda.Event


class WeightStager:
    """`to_device(t)`: CPU tensor `t` (any strides; a view of the mapped checkpoint) -> a new
    contiguous tensor on CUDA `device`, same dtype, its copy enqueued (not waited for). `slots`
    pinned buffers of `slot_bytes` each; `close()` waits for the last copies."""

    def __init__(
        self, device: torch.device, *, slots: int = 4, slot_bytes: int = DEFAULT_SLOT_BYTES
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"WeightStager stages to a CUDA device, got {device}")
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"slots and slot_bytes must be >= 1, got {slots}, {slot_bytes}")
        self.device = device if device.index is not None else torch.device(
            "cuda", torch.cuda.current_device()
        )  # fmt: skip
        self.slot_bytes = slot_bytes
        self._free: queue.Queue[_Slot] = queue.Queue()
        for _ in range(slots):
            buf = torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True)
            self._free.put(_Slot(buf, torch.cuda.Event()))

    def to_device(self, src: torch.Tensor) -> torch.Tensor:
        dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        if src.numel() == 0:
            return dst
        if src.nbytes <= self.slot_bytes:
            self._stage(src, dst)
        elif src.dim() >= 1 and src[0].nbytes <= self.slot_bytes:
            rows = max(1, self.slot_bytes // max(src[0].nbytes, 1))
            for i in range(0, src.shape[0], rows):
                self._stage(src[i : i + rows], dst[i : i + rows])
        elif src.is_contiguous():
            flat_src, flat_dst = src.reshape(-1), dst.view(-1)
            step = self.slot_bytes // src.element_size()
            for i in range(0, flat_src.numel(), step):
                self._stage(flat_src[i : i + step], flat_dst[i : i + step])
        else:  # a strided row wider than a slot: no checkpoint has one; correct, not staged
            dst.copy_(src)
        return dst

    def _stage(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        slot = self._free.get()
        try:
            slot.event.synchronize()  # the DMA that last read this slot is done
            staged = slot.buffer[: src.nbytes].view(src.dtype).view(src.shape)
            staged.copy_(src)
            dst.copy_(staged, non_blocking=True)
            slot.event.record(torch.cuda.current_stream(self.device))
        finally:
            self._free.put(slot)

    def close(self) -> None:
        """Wait for every enqueued copy (the slots' last DMAs)."""
        slots = []
        while not self._free.empty():
            slots.append(self._free.get())
        for slot in slots:
            slot.event.synchronize()
            self._free.put(slot)

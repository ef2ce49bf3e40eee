"""An update's host tensors sent to the device ahead of the loader that takes them: `prefetched` starts
each tensor's host-to-device copy (`non_blocking`) up to a window of bytes before the loader asks for it,
so the link moves the next tensors while the loader (vLLM's layer-wise reload: a layer's buffers, its
weight loaders, the backend's processing, a copy into the weights the compiled programs hold) works on the
ones before. The window bounds the device memory the early copies hold. When the last tensor has been
taken, it waits for the device: the host tensors may be reused or changed once the loader is done. On a
CPU the device is the host: each tensor is handed on as it is (`Tensor.to` copies nothing)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import torch

WINDOW_BYTES = 128 << 20  # device bytes sent ahead of the loader: about one decoder layer of a 1B model


def prefetched(
    weights: Iterable[tuple[str, torch.Tensor]], device: torch.device, window_bytes: int = WINDOW_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` in their order, each on `device`: a tensor's copy starts while fewer than
    `window_bytes` are sent and not yet taken (so at most `window_bytes` plus one tensor are ahead)."""
    if window_bytes <= 0:
        raise ValueError(f"window_bytes={window_bytes} is invalid; valid: a positive number of bytes")
    source = iter(weights)
    ahead: deque[tuple[str, torch.Tensor, int]] = deque()
    sent = 0  # bytes in `ahead`
    more = True
    while True:
        while more and sent < window_bytes:
            item = next(source, None)
            if item is None:
                more = False
                break
            name, t = item
            nbytes = t.numel() * t.element_size()
            ahead.append((name, t.to(device, non_blocking=True), nbytes))
            sent += nbytes
        if not ahead:
            _wait_for(device)  # every copy landed before the caller may reuse or change the host tensors
            return
        name, t, nbytes = ahead.popleft()
        sent -= nbytes
        yield name, t


def _wait_for(device: torch.device) -> None:
    """Waits for the work queued on `device` where it is this process's accelerator (a CPU or a meta
    device has nothing in flight)."""
    if torch.accelerator.is_available():
        current = torch.accelerator.current_accelerator()
        if current is not None and current.type == device.type:
            torch.accelerator.synchronize(device)

"""GPU compute timing with CUDA event pairs, resolved lazily.

record() puts two events around the compute region on the current stream; poll() asks the oldest
pairs with Event.query() whether the GPU has passed them and only then reads elapsed_time, so the
training loop never synchronises with the device. Resolved events go back to a pool.
"""

from __future__ import annotations

from collections import deque


class CudaEventTimer:
    """Times regions of GPU work. Not thread-safe: use from the training thread.

    Args:
        max_pending: pairs kept unresolved at most; beyond it the oldest is dropped (counted in
            `dropped`) rather than waited for.
    """

    def __init__(self, max_pending: int = 256):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        self._torch = torch
        self._free: list = []
        self._pending: deque = deque()
        self._open = None
        self._max_pending = max_pending
        self.dropped = 0

    def _event(self):
        return self._free.pop() if self._free else self._torch.cuda.Event(enable_timing=True)

    def begin(self) -> None:
        """Records the start event on the current stream."""
        self._open = self._event()
        self._open.record()

    def end(self) -> None:
        """Records the end event; the pair is resolved by a later poll()."""
        if self._open is None:
            return
        end = self._event()
        end.record()
        self._pending.append((self._open, end))
        self._open = None
        if len(self._pending) > self._max_pending:
            start, stop = self._pending.popleft()
            self._free += [start, stop]
            self.dropped += 1

    def poll(self) -> list[float]:
        """Seconds of every pair the GPU has finished, oldest first; never blocks."""
        out = []
        while self._pending and self._pending[0][1].query():
            start, stop = self._pending.popleft()
            out.append(start.elapsed_time(stop) / 1e3)
            self._free += [start, stop]
        return out

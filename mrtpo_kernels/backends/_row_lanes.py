"""The row kernels beside the GEMMs (MRTPO_OVERLAP_ROWS=1): a side stream for the chunk
driver's row kernels (backends/_chunked.py lists the driver's modules), used by the
token-chunked backward and policy loss (_chunk_backward.py) and by the log-probs forward
(_chunked_logprobs.py).
"""

from __future__ import annotations

import torch

from .. import settings


class _RowLanes:
    """MRTPO_OVERLAP_ROWS=1 on a CUDA device (16-bit GEMM path): each chunk's row kernel runs
    on a side stream while the current stream's GEMM makes the next chunk's logits into the
    other of two fp32 chunk buffers (one chunk buffer more of memory, counted in
    ``chunk_plan``'s buffer_bytes). Used by the backward and the policy loss
    (``_run_backward``) and by the log-probs forward's statistics. Ordering, by events: a
    chunk's row kernel waits for its logits GEMM (and so for all earlier work of the current
    stream: its inputs, and the dh / dW GEMMs that read the gradient buffer it writes); a
    GEMM into a buffer waits for the row kernel that last read it; ``join`` makes the
    current stream wait for every row kernel (before dh / dW, and before returning, so the
    outputs the row kernels write are ready for the caller's stream).

    Errors: the callers join in a ``finally``, so an exception between a side-stream row
    kernel and the join (a failing GEMM, a row kernel's launch, anything in between) still
    makes the current stream wait for the side stream before the exception leaves the
    driver: a buffer freed on the way out can only be reused by work ordered after every
    pending row kernel. The buffers the side stream reads or writes that the driver made on
    the current stream (the two chunk buffers, the gradient buffer's rows) are also marked
    with ``record_stream``, so the caching allocator holds them until the side stream's
    work on them is done, whichever stream asks for the memory next.
    JS is not covered: its chunk is the stacked (1 + K) C rows of a 768 MiB scratch, and a
    second one would pass the 1 GB target."""

    def __init__(self, z_buf, hidden):
        self.bufs = [z_buf, torch.empty_like(z_buf)]
        self.main = torch.cuda.current_stream(hidden.device)
        self.side = torch.cuda.Stream(device=hidden.device)
        self.free = [None, None]  # per buffer: the event after the row kernel that read it
        self.turn = 0
        for buf in self.bufs:
            buf.record_stream(self.side)

    @staticmethod
    def enabled(wanted: bool, hidden) -> bool:
        """Whether to overlap: ``wanted`` (the 16-bit GEMM path) on a CUDA device with
        MRTPO_OVERLAP_ROWS=1 (read at each call)."""
        return bool(wanted) and hidden.is_cuda and settings.overlap_rows()

    def run(self, logits_into, row_fn, g, a, b):
        """logits_into(buffer) on the current stream into the next of the two buffers, then
        row_fn(z, g, a, b) on the side stream (``on_side``)."""
        j = self.turn
        self.turn ^= 1
        if self.free[j] is not None:
            self.main.wait_event(self.free[j])
        z = logits_into(self.bufs[j])
        self.free[j] = self.on_side(row_fn, z, g, a, b)

    def on_side(self, row_fn, z, g, a, b):
        """row_fn(z, g, a, b) on the side stream after everything the current stream has
        queued so far; returns the event recorded after it."""
        ready = torch.cuda.Event()
        ready.record(self.main)
        if g is not None:
            g.record_stream(self.side)  # rows of the driver's gradient buffer
        with torch.cuda.stream(self.side):
            self.side.wait_event(ready)
            row_fn(z, g, a, b)
            done = torch.cuda.Event()
            done.record(self.side)
        return done

    def join(self):
        self.main.wait_stream(self.side)

"""Huge pages for a CPU session's weights (Linux).

ONNX Runtime packs every MatMul's weights into buffers of its own at load, on 4 KiB pages, and a CPU decode
step reads every byte of them once: the TLB misses cost about 5 % of a SmolLM2 step. After a session is made,
the 2 MiB chunks of anonymous memory that became fully resident while it loaded (its weights) are collapsed
into transparent huge pages with ``madvise(MADV_COLLAPSE)`` (Linux 6.1+), in a background thread so that
loading is not slowed. Only memory that is already resident is collapsed, so no memory is added; memory that
was resident before the load (another session's, the caller's arrays) is left alone.

Nothing here raises: where the system cannot do it, :attr:`HugePages.state` says why.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading

import numpy as np

log = logging.getLogger("rlxrt")

CHUNK = 2 << 20
MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def _anonymous_ranges(maps: str = "/proc/self/maps"):
    """2 MiB-aligned (start, end) of each private writable anonymous mapping (the heap included)."""
    with open(maps) as fh:
        for line in fh:
            parts = line.split()
            name = parts[5] if len(parts) > 5 else ""
            if name not in ("", "[heap]") or not parts[1].startswith("rw"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            start, end = (lo + CHUNK - 1) & ~(CHUNK - 1), hi & ~(CHUNK - 1)
            if end > start:
                yield start, end


def resident_chunks(libc=None) -> frozenset[int] | None:
    """Start addresses of the anonymous 2 MiB chunks whose pages are all resident; None where unsupported."""
    libc = libc or _LIBC
    if libc is None:
        return None
    page = mmap.PAGESIZE
    out: set[int] = set()
    try:
        for start, end in _anonymous_ranges():
            vec = ctypes.create_string_buffer((end - start) // page)
            if libc.mincore(start, end - start, vec) != 0:
                continue  # unmapped since /proc was read
            full = (np.frombuffer(vec.raw, np.uint8) & 1).reshape(-1, CHUNK // page).all(axis=1)
            out.update(start + int(i) * CHUNK for i in np.flatnonzero(full))
    except OSError:
        return None
    return frozenset(out)


def runs(chunks) -> list[tuple[int, int]]:
    """Adjacent chunks merged into (start, end) ranges, in address order."""
    out: list[list[int]] = []
    for c in sorted(chunks):
        if out and out[-1][1] == c:
            out[-1][1] = c + CHUNK
        else:
            out.append([c, c + CHUNK])
    return [(a, b) for a, b in out]


class HugePages:
    """The collapse of one session's weights: ``state`` is "off: why", "collapsing", or "on: N MiB"."""

    def __init__(self, state: str, chunks: frozenset[int] = frozenset(), libc=None):
        self.state = state
        self.mib = 0
        self._chunks = chunks
        self._libc = libc or _LIBC
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        if state != "collapsing":
            self._done.set()

    def start(self) -> "HugePages":
        self._thread = threading.Thread(target=self._run, name="rlxrt-hugepages", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> str:
        """Block until the collapse has finished (benchmarks call this before timing); the final state."""
        self._done.wait(timeout)
        return self.state

    def _run(self) -> None:
        done, refused = 0, None
        try:
            for start, end in runs(self._chunks):
                if self._libc.madvise(start, end - start, MADV_COLLAPSE) == 0:
                    done += end - start
                    continue
                refused = ctypes.get_errno()
                for chunk in range(start, end, CHUNK):  # one chunk that cannot be had must not cost the run
                    if end - start > CHUNK and self._libc.madvise(chunk, CHUNK, MADV_COLLAPSE) == 0:
                        done += CHUNK
        except Exception as exc:  # a background thread must not die loudly over an optimisation
            refused = repr(exc)
        self.mib = done >> 20
        if done:
            self.state = f"on: {self.mib} MiB"
        else:
            self.state = f"off: the kernel refused MADV_COLLAPSE (errno {refused}); needs Linux 6.1+ with THP"
        log.debug("huge pages: %s", self.state)
        self._done.set()


def collapse_new(before: frozenset[int] | None, libc=None) -> HugePages:
    """Start collapsing the chunks that became fully resident since ``before`` (from :func:`resident_chunks`)."""
    if before is None:
        return HugePages("off: needs Linux (mincore, madvise)")
    after = resident_chunks(libc)
    new = (after or frozenset()) - before
    if not new:
        return HugePages("off: the load added no anonymous memory (the weights are mapped from their file)")
    return HugePages("collapsing", frozenset(new), libc).start()

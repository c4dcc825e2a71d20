"""Adapter file reads straight into their destination buffers: scattered reads (one os.preadv per run of
buffers whose file ranges follow each other), and one read split into parts read side by side on a pool.

The reads release the GIL for their whole length, so a reader thread barely holds up the step loop.
"""
from __future__ import annotations

import concurrent.futures
import os

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024   # buffers per os.preadv
MIN_PART_BYTES = 4 << 20     # a read is split across threads in parts of at least this many bytes


def read_scattered(fd: int, reads: list[tuple[int, memoryview]]) -> None:
    """Fill each (file offset, buffer) of `reads` from the file: one os.preadv per run of buffers whose
    file ranges follow each other (at most IOV_MAX buffers), going on after short reads."""
    reads = sorted(reads, key=lambda r: r[0])
    i = 0
    while i < len(reads):
        start, buffers = reads[i][0], []
        end = start
        while i < len(reads) and reads[i][0] == end and len(buffers) < _IOV_MAX:
            buffers.append(reads[i][1])
            end += len(reads[i][1])
            i += 1
        while start < end:
            done = os.preadv(fd, buffers, start)
            if done == 0:
                raise OSError(f"the file ended at byte {start}, before {end}")
            start += done
            while buffers and done >= len(buffers[0]):
                done -= len(buffers[0])
                buffers.pop(0)
            if done:
                buffers[0] = buffers[0][done:]


def split_reads(reads: list[tuple[int, memoryview]], parts: int,
                min_bytes: int | None = None) -> list[list[tuple[int, memoryview]]]:
    """`reads` (file offset, buffer) in file order, cut into at most `parts` groups of about equal bytes
    (none under `min_bytes` unless it is the only one); a buffer that crosses a cut is cut in two."""
    reads = sorted(reads, key=lambda r: r[0])
    total = sum(len(buffer) for _, buffer in reads)
    parts = max(1, min(parts, total // max(1, MIN_PART_BYTES if min_bytes is None else min_bytes)))
    ends = [(g + 1) * total // parts for g in range(parts)]       # the cut after each group, in bytes
    groups: list[list[tuple[int, memoryview]]] = [[] for _ in range(parts)]
    done = g = 0
    for offset, buffer in reads:
        while len(buffer):
            while done >= ends[g]:
                g += 1
            take = min(len(buffer), ends[g] - done)
            groups[g].append((offset, buffer[:take]))
            offset, buffer, done = offset + take, buffer[take:], done + take
    return [group for group in groups if group]


def read_in_parts(fd: int, reads: list[tuple[int, memoryview]], pool: concurrent.futures.Executor | None,
                  parts: int) -> None:
    """read_scattered, with the bytes split into `parts` groups read side by side on `pool`'s threads
    (page-cache copies run at a few GB/s per thread). Returns once every part has ended; raises the
    first failure then."""
    groups = split_reads(reads, parts) if pool is not None and parts > 1 else [reads]
    if len(groups) <= 1:
        read_scattered(fd, reads)
        return
    futures = [pool.submit(read_scattered, fd, group) for group in groups]
    concurrent.futures.wait(futures)        # none may still write into the buffer, nor use fd, after this
    for future in futures:
        future.result()

"""Adapter file reads (lora/file_reads.py): scattered reads past short reads, reads split into even
file-ordered parts, parts read side by side."""
from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest


@pytest.mark.parametrize("iov_max", [1024, 3])
def test_scattered_reads_go_on_after_short_reads(tmp_path, monkeypatch, iov_max):
    """read_scattered: buffers in any order, gaps between file ranges, runs longer than IOV_MAX buffers,
    and a preadv that returns fewer bytes than asked (here at most 7 per call)."""
    import os

    from worker.lora import file_reads
    data = bytes(random.Random(0).randrange(256) for _ in range(500))
    (tmp_path / "f").write_bytes(data)
    ranges = [(0, 10), (10, 33), (33, 34), (40, 100), (100, 250), (251, 500)]
    buffers = {begin: bytearray(end - begin) for begin, end in ranges}
    reads = [(begin, memoryview(buffers[begin])) for begin, _ in reversed(ranges)]
    real = os.preadv
    monkeypatch.setattr(file_reads, "_IOV_MAX", iov_max)
    monkeypatch.setattr(file_reads.os, "preadv", lambda fd, bufs, offset: real(fd, bufs, offset) if sum(
        len(b) for b in bufs) <= 7 else real(fd, _first_bytes(bufs, 7), offset))
    with open(tmp_path / "f", "rb") as f:
        file_reads.read_scattered(f.fileno(), reads)
        assert all(bytes(buffers[begin]) == data[begin:end] for begin, end in ranges)
        with pytest.raises(OSError, match="ended"):
            file_reads.read_scattered(f.fileno(), [(495, memoryview(bytearray(10)))])


@pytest.mark.parametrize("parts, min_bytes", [(1, 1), (2, 1), (3, 1), (4, 100), (7, 1), (64, 1), (4, 10_000)])
def test_split_reads_cut_the_bytes_into_even_file_ordered_groups(parts, min_bytes):
    """Every byte of every buffer lands in exactly one group, at its own file offset; groups follow each
    other in file order, hold within one byte of total / groups, and none is under min_bytes unless alone."""
    from worker.lora.file_reads import split_reads
    rng = random.Random(parts)
    sizes = [rng.choice([0, 1, 5, 64, 300]) for _ in range(40)]
    buffers, reads, offset = [], [], 0
    for size in sizes:
        offset += rng.choice([0, 0, 3])                       # gaps between some file ranges
        buffers.append(bytearray(size))
        reads.append((offset, memoryview(buffers[-1])))
        offset += size
    total = sum(sizes)
    groups = split_reads(list(reversed(reads)), parts, min_bytes)
    expected_groups = max(1, min(parts, total // min_bytes))
    assert len(groups) == expected_groups
    sizes_per_group = [sum(len(b) for _, b in group) for group in groups]
    assert sum(sizes_per_group) == total and max(sizes_per_group) - min(sizes_per_group) <= 1
    pieces = [(offset, b) for group in groups for offset, b in group]
    assert [o for o, _ in pieces] == sorted(o for o, _ in pieces)
    for offset, b in pieces:                 # write each piece's file offsets into the buffers it views
        b[:] = bytes((offset + k) % 251 for k in range(len(b)))
    for (offset, _), buffer in zip(reads, buffers):
        assert bytes(buffer) == bytes((offset + k) % 251 for k in range(len(buffer)))


def test_reads_in_parts_fill_the_buffers_and_wait_for_every_part_before_raising(tmp_path, monkeypatch):
    from worker.lora import file_reads
    data = bytes(random.Random(1).randrange(256) for _ in range(10_000))
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(file_reads, "MIN_PART_BYTES", 100)
    buffers = [bytearray(n) for n in (3000, 1, 4999, 2000)]
    offsets = [0, 3000, 3001, 8000]
    reads = [(o, memoryview(b)) for o, b in zip(offsets, buffers)]
    assert len(file_reads.split_reads(reads, 4)) == 4
    real, slow_part_done = file_reads.read_scattered, threading.Event()

    def read_scattered(fd, group):          # the part at offset 0 ends last
        if group[0][0] == 0:
            time.sleep(0.2)
            real(fd, group)
            slow_part_done.set()
        else:
            real(fd, group)
    monkeypatch.setattr(file_reads, "read_scattered", read_scattered)
    with concurrent.futures.ThreadPoolExecutor(4) as pool, open(tmp_path / "f", "rb") as f:
        file_reads.read_in_parts(f.fileno(), reads, pool, 4)
        assert b"".join(buffers) == data
        # the last part runs past the end of the file: the error comes once the slow part has ended too
        past_end = [(2600 * i, memoryview(bytearray(2600))) for i in range(4)]
        slow_part_done.clear()
        with pytest.raises(OSError, match="ended"):
            file_reads.read_in_parts(f.fileno(), past_end, pool, 4)
        assert slow_part_done.is_set() and bytes(past_end[0][1]) == data[:2600]


def _first_bytes(buffers, n: int) -> list[memoryview]:
    out = []
    for b in buffers:
        b = memoryview(b)[:n]
        out.append(b)
        n -= len(b)
        if n == 0:
            break
    return out

"""How far each rank got, in a small file every rank maps: rank 0 writes the step it started, a follower
2 * step - 1 once it received that step and 2 * step once it finished it. When a step runs too long,
the followers furthest behind are the ones that hang (the others wait on them in a collective)."""

from __future__ import annotations

import os
import tempfile

import torch


class Progress:
    def __init__(self, path: str, size: int):
        self.path = path
        self.values = torch.from_file(path, shared=True, size=size, dtype=torch.int64)

    @classmethod
    def create(cls, size: int) -> Progress:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not a disk file
        fd, path = tempfile.mkstemp(prefix="tandem-tp-progress-", dir=shm)
        os.write(fd, bytes(8 * size))
        os.close(fd)
        return cls(path, size)

    def started(self, step: int) -> None:
        self.values[0] = step

    def received(self, rank: int, step: int) -> None:
        self.values[rank] = 2 * step - 1

    def finished(self, rank: int, step: int) -> None:
        self.values[rank] = 2 * step

    def laggards(self, step: int) -> list[int]:
        """The followers furthest behind in `step` (empty when all finished it)."""
        done = self.values[1:].tolist()
        low = min(done)
        return [] if low >= 2 * step else [r + 1 for r, v in enumerate(done) if v == low]

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

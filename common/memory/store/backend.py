"""The seam between the store tier (common/memory/store/tier.py) and a store: `StoreBackend`, and the file
backend. Every method runs on the tier's worker thread, never on the scheduler's.

A page travels as (header, page): the header is bytes (common/memory/store/objects.py), the page a uint8 view
of one host-pool page, which a backend reads from (put) or fills in place (get).
"""

from __future__ import annotations

import os
import uuid
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from common.memory.store.objects import HEADER_BYTES


class StoreUnavailable(Exception):
    """The store cannot be reached now: the tier stops using it and tries again later."""


class StoreBackend(ABC):
    @abstractmethod
    def connect(self) -> None:
        """Reach the store (raises StoreUnavailable); called again after the store was unavailable."""

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]:
        """Which of `keys` the store holds."""

    @abstractmethod
    def put(self, keys: list[str], headers: list[bytes], pages: list[torch.Tensor]) -> list[bool]:
        """Store each (header, page) under its key; True where the store holds the object afterwards."""

    @abstractmethod
    def get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bytes | None]:
        """Read each object's page into `pages[i]`; its header, or None where the object is absent or not
        readable (a page whose object is not there is left as it was)."""

    @abstractmethod
    def describe(self) -> str:
        """For the start-up log: where the store is."""

    def close(self) -> None:
        pass


class FileStore(StoreBackend):
    """One file per page under a directory (SGLang's `file` backend): written whole to a temporary name, then
    renamed, so a reader sees a whole object or none. Nothing is ever evicted: the directory is the user's to
    clear. Servers on one host, or sharing a file system, share its pages."""

    def __init__(self, path: str):
        self.path = Path(path)

    def connect(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot create {self.path}: {e}") from None

    def exists(self, keys: list[str]) -> list[bool]:
        return [(self.path / k).is_file() for k in keys]

    def put(self, keys: list[str], headers: list[bytes], pages: list[torch.Tensor]) -> list[bool]:
        return [self._put_one(k, h, p) for k, h, p in zip(keys, headers, pages, strict=True)]

    def _put_one(self, key: str, header: bytes, page: torch.Tensor) -> bool:
        final = self.path / key
        tmp = self.path / f".{key}.{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(page.numpy().data)
            os.replace(tmp, final)
            return True
        except OSError:  # a full disk, a directory removed: the page is just not stored
            tmp.unlink(missing_ok=True)
            return False

    def get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bytes | None]:
        return [self._get_one(k, p) for k, p in zip(keys, pages, strict=True)]

    def _get_one(self, key: str, page: torch.Tensor) -> bytes | None:
        try:
            with open(self.path / key, "rb") as f:
                header = f.read(HEADER_BYTES)
                f.readinto(page.numpy().data)
        except OSError:
            return None
        return header

    def describe(self) -> str:
        return f"files under {self.path}"

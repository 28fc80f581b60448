"""The Mooncake Store backend: a `MooncakeDistributedStore` client of a `mooncake_master`.

Objects live in the memory segments that clients give the store (`global_segment_size`; Tandem servers give
none by default, so a server's restart loses no object: `tandem up` runs a `mooncake_client` holding the
store's memory). The master places objects, grants each read a lease (`--default_kv_lease_ttl`) and evicts
the least recently used objects past its high watermark, so a full store keeps taking pages.

Zero copy: the host pool's buffer and a header staging buffer are registered with the client once, and
every page moves straight between the host pool and the store as (header, page) buffers of one object.
Error codes (Mooncake's types.h): RPC failures mean the store is unavailable; a missing object, an expired
lease or a full store mean only that page is not read or not stored.
"""

from __future__ import annotations

import torch

from common.memory.store.backend import StoreBackend, StoreUnavailable
from common.memory.store.config import MooncakeConfig
from common.memory.store.objects import HEADER_BYTES

MAX_BATCH = 256  # pages per call (the header staging buffer's rows)
RPC_ERRORS = {-900, -901}  # RPC_FAIL, RPC_TIMEOUT
OBJECT_ALREADY_EXISTS = -705


class MooncakeStore(StoreBackend):
    def __init__(self, config: MooncakeConfig, host_buffer: torch.Tensor, public_host: str):
        self.config, self.host_buffer = config, host_buffer
        self.hostname = config.local_hostname or public_host
        self.headers = torch.zeros((MAX_BATCH, HEADER_BYTES), dtype=torch.uint8)
        self.client = None

    def connect(self) -> None:
        if self.client is not None:
            return
        from mooncake.store import MooncakeDistributedStore

        c, client = self.config, MooncakeDistributedStore()
        rc = client.setup(
            self.hostname,
            c.metadata_server,
            c.global_segment_size,
            c.local_buffer_size,
            c.protocol,
            c.device_name,
            c.master_server_address,
        )
        if rc != 0:
            raise StoreUnavailable(f"Mooncake Store setup with master {c.master_server_address} failed ({rc})")
        for t in (self.host_buffer, self.headers):
            if client.register_buffer(t.data_ptr(), t.numel() * t.element_size()) != 0:
                raise RuntimeError("Mooncake Store refused to register the host KV pool's buffer")
        self.client = client

    def exists(self, keys: list[str]) -> list[bool]:
        codes = self.client.batch_is_exist(keys)
        self._check(codes)
        return [c == 1 for c in codes]

    def put(self, keys: list[str], headers: list[bytes], pages: list[torch.Tensor]) -> list[bool]:
        for i, h in enumerate(headers):
            self.headers[i] = torch.frombuffer(bytearray(h), dtype=torch.uint8)
        codes = self.client.batch_put_from_multi_buffers(keys, self._ptrs(pages), self._sizes(pages))
        self._check(codes)
        return [c in (0, OBJECT_ALREADY_EXISTS) for c in codes]

    def get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bytes | None]:
        codes = self.client.batch_get_into_multi_buffers(keys, self._ptrs(pages), self._sizes(pages))
        self._check(codes)
        return [bytes(self.headers[i].numpy()) if c > 0 else None for i, c in enumerate(codes)]

    def _ptrs(self, pages: list[torch.Tensor]) -> list[list[int]]:
        if len(pages) > MAX_BATCH:
            raise ValueError(f"{len(pages)} pages in one call; at most {MAX_BATCH}")
        return [[self.headers[i].data_ptr(), p.data_ptr()] for i, p in enumerate(pages)]

    @staticmethod
    def _sizes(pages: list[torch.Tensor]) -> list[list[int]]:
        return [[HEADER_BYTES, p.numel()] for p in pages]

    @staticmethod
    def _check(codes: list[int]) -> None:
        if any(c in RPC_ERRORS for c in codes):
            raise StoreUnavailable(f"the Mooncake master did not answer ({min(codes)})")

    def describe(self) -> str:
        c = self.config
        return f"Mooncake Store, master {c.master_server_address}, metadata {c.metadata_server}, {c.protocol}"

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

"""The workers added or removed at run time, shared by the router processes of one port (router/processes.py)
through a JSON file: url -> the worker (added) or null (removed). The process that takes a change (POST or
DELETE /workers) applies it to its own list and writes it into the file, under a lock; every process
follows the file and applies the changes its list lacks. Workers given by flags or found by discovery are
left alone unless a change names them."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from typing import Any

import aiohttp

from router.workers import Worker, WorkerRegistry

FOLLOW_INTERVAL_S = 0.5


class SharedWorkers:
    def __init__(self, directory: str, registry: WorkerRegistry) -> None:
        self.path = os.path.join(directory, "workers.json")
        self.registry = registry
        self.seen: int | None = None  # mtime of the file last applied

    def publish(self, added: Worker | None = None, removed: str | None = None) -> None:
        """Write one change this process made to its list into the file (synchronous: call it right after
        the change, before the next await, so that following the file cannot undo it)."""
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            changes = self._read()
            if added is not None:
                changes[added.url] = {
                    "role": added.role,
                    "bootstrap_port": added.bootstrap_port,
                    "bootstrap_host": added.bootstrap_host,
                }
            if removed is not None:
                changes[removed] = None
            with open(self.path + ".tmp", "w") as f:
                json.dump(changes, f)
            os.replace(self.path + ".tmp", self.path)

    async def follow(self, session: aiohttp.ClientSession) -> None:
        """Apply the file whenever it changed; a worker new to this process is checked at once."""
        while True:
            await asyncio.sleep(FOLLOW_INTERVAL_S)
            try:
                mtime = os.stat(self.path).st_mtime_ns
            except FileNotFoundError:
                continue
            if mtime != self.seen:
                self.seen = mtime
                await self._apply(self._read(), session)

    async def _apply(self, changes: dict[str, Any], session: aiohttp.ClientSession) -> None:
        added = []
        for url, w in changes.items():
            if w is None:
                self.registry.remove(url)
            elif url not in self.registry.workers:
                added.append(self.registry.add(url, w["role"], w["bootstrap_port"], w["bootstrap_host"]))
        await asyncio.gather(*(self.registry.check(session, w) for w in added))

    def _read(self) -> dict[str, Any]:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return {}

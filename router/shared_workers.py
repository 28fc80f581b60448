"""The workers added or removed at run time, shared by the router processes of one port (router/processes.py)
through a JSON file. The process that takes a change (POST or DELETE /workers) applies it to its own list
and to the file, under a lock; every process follows the file and applies what differs from its list."""
from __future__ import annotations

import asyncio
import fcntl
import json
import os
from typing import Any

import aiohttp

from router.workers import Worker, WorkerRegistry

FOLLOW_INTERVAL_S = 0.5


def _entry(w: Worker) -> dict[str, Any]:
    return {"url": w.url, "role": w.role, "bootstrap_port": w.bootstrap_port}


class SharedWorkers:
    def __init__(self, directory: str, registry: WorkerRegistry) -> None:
        self.path = os.path.join(directory, "workers.json")
        self.registry = registry
        self.initial = [_entry(w) for w in registry.workers.values()]  # every process starts from the same flags
        self.seen: int | None = None  # mtime of the file last applied

    def publish(self, added: Worker | None = None, removed: str | None = None) -> None:
        """Write one change this process made to its list into the file (synchronous: call it right after
        the change, before the next await, so that following the file cannot undo it)."""
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            gone = {removed, added.url if added else None}
            current = self._read()
            listed = [w for w in (self.initial if current is None else current) if w["url"] not in gone]
            if added is not None:
                listed.append(_entry(added))
            with open(self.path + ".tmp", "w") as f:
                json.dump(listed, f)
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
                await self._apply(self._read() or [], session)

    async def _apply(self, listed: list[dict[str, Any]], session: aiohttp.ClientSession) -> None:
        urls = {w["url"] for w in listed}
        for url in [u for u in self.registry.workers if u not in urls]:
            self.registry.remove(url)
        added = [self.registry.add(w["url"], w["role"], w.get("bootstrap_port")) for w in listed
                 if w["url"] not in self.registry.workers]
        await asyncio.gather(*(self.registry.check(session, w) for w in added))

    def _read(self) -> list[dict[str, Any]] | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

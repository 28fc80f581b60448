"""Decode side of the control plane: registers with each prefill it needs, reads room statuses,
pings the prefills its rooms wait on and fails those rooms when a prefill falls silent."""
from __future__ import annotations

import logging
from typing import Callable

from transfer.manager import KVArgs, KVManager
from transfer.messages import BadMessage, Ping, Pong, Register, Status
from transfer.poll import KVPoll

log = logging.getLogger(__name__)


class DecodeKVManager(KVManager):
    mode = "decode"

    def __init__(self, args: KVArgs):
        super().__init__(args)
        self.backend.register(args.aux_ptr, args.aux_record_bytes * args.aux_slots)
        self.registered_with: set[str] = set()  # prefill endpoints that know where to write
        self.on_peer_dead: list[Callable[[str], None]] = []

    def handle(self, msg: object) -> None:
        if isinstance(msg, Status):
            self._on_status(msg)
        elif isinstance(msg, Pong):
            self.liveness.seen(msg.endpoint)
        else:
            raise BadMessage(f"{type(msg).__name__} is not for a decode server")

    def _on_status(self, msg: Status) -> None:
        with self._lock:
            room = self.rooms.get(msg.room)
        if room is None or not room.owned:
            raise BadMessage(f"status for unknown room {msg.room}")
        room.status_received = True
        if room.peer is not None:
            self.liveness.seen(room.peer)
        room.poll.advance(KVPoll.Success) if msg.ok else room.poll.fail(msg.reason)

    def register_with(self, endpoint: str) -> None:
        """Tell a prefill where this decode's buffers are (once per prefill process)."""
        if endpoint in self.registered_with:
            return
        a = self.args
        self.send(endpoint, Register(self.instance_id, self.endpoint, self.backend.address(), a.kv_ptrs, a.bytes_per_page,
                                     a.num_pages, a.page_size, a.aux_ptr, a.aux_record_bytes, a.aux_slots))
        self.registered_with.add(endpoint)

    # -- heartbeat -----------------------------------------------------------------------------
    def watched_peers(self) -> set[str]:
        return {st.peer for _, st in self.rooms_snapshot()
                if st.owned and st.peer and st.poll.state >= KVPoll.WaitingForInput and not st.status_received and not st.peer_dead}

    def ping(self, peers: set[str]) -> None:
        for peer in peers:
            self.send(peer, Ping(self.instance_id))

    def declare_dead(self, peer: str, silent_s: float) -> None:
        reason = f"prefill {peer} answered no heartbeat for {silent_s:.1f} s (dead or frozen)"
        log.warning("%s: failing the rooms waiting on it", reason)
        for _, st in self.rooms_snapshot():
            if st.peer == peer and not st.status_received:
                st.peer_dead = True
                st.poll.fail(reason)
        self.registered_with.discard(peer)
        self.drop_socket(peer)
        for callback in self.on_peer_dead:
            callback(peer)

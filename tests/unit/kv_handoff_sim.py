"""A simulated PD pair for the model-based test of the KV handoff: a prefill and a decode scheduler with
fake runners that write each token's id into its KV slot, real pools and role bookkeeping, real transfer
managers on the loopback backend, a control plane whose frames the test delivers (in any order, twice,
or never), and one fake clock. No threads: the test decides what runs when."""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from common.config import ServerConfig
from common.engine.kv_ready import HostEvent
from common.engine.model_runner import BatchResult
from common.engine.output import OutputProcessor
from common.engine.role import SchedulerView
from common.engine.scheduler import Scheduler
from common.memory.allocator import PagedAllocator
from common.memory.manager import MemoryManager
from common.memory.prefix_cache import NoPrefixCache
from common.memory.radix_cache import RadixCache
from common.memory.req_to_token_pool import ReqToTokenPool
from decode_node.peers import PeerInfo
from decode_node.role import DecodeRole
from prefill_node.role import PrefillRole
from transfer.aux_record import RECORD_BYTES
from transfer.decode.aux_pool import AuxPool
from transfer.decode.decode_manager import DecodeKVManager
from transfer.manager import KVArgs
from transfer.messages import encode, next_seq
from transfer.prefill.prefill_manager import PrefillKVManager

VOCAB, EOS = 1000, 999
SECRET = "sim-secret"
CONFIG = ServerConfig(
    page_size=4,
    max_total_tokens=4 * 40,
    max_running_requests=6,
    chunked_prefill_size=8,
    pairing_timeout_s=30,
    kv_wait_timeout_s=30,
    transfer_timeout_s=20,
    heartbeat_interval_s=2,
    heartbeat_misses=2,
)
NUM_PAGES = CONFIG.max_total_tokens // CONFIG.page_size
CONTEXT_LEN = 64  # a prefill computes ahead of pairing in all but 16 of the 40 pages


class Clock:
    """Monotonic and wall clock at once."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Network:
    """Frames between the fake control planes; a frame to an endpoint nobody serves is lost."""

    clock: Clock
    in_flight: list[tuple[str, bytes]] = field(default_factory=list)
    delivered: list[tuple[str, bytes]] = field(default_factory=list)
    handlers: dict[str, object] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)  # endpoints of frozen processes: frames wait

    def deliverable(self) -> list[int]:
        return [i for i, (ep, _) in enumerate(self.in_flight) if ep not in self.held]

    def deliver(self, i: int) -> None:
        endpoint, raw = self.in_flight.pop(i)
        self.delivered.append((endpoint, raw))
        handler = self.handlers.get(endpoint)
        if handler is not None:
            handler(raw)

    def replay(self, i: int) -> None:
        endpoint, raw = self.delivered[i]
        handler = self.handlers.get(endpoint)
        if handler is not None:
            handler(raw)


class FakeControlPlane:
    _ports = itertools.count(1)

    def __init__(self, net: Network, sender: str):
        self.net, self.sender = net, sender
        self.endpoint = f"sim://{sender}:{next(self._ports)}"
        self.alive = True

    def start(self, on_frame) -> None:
        self.net.handlers[self.endpoint] = on_frame

    def send(self, endpoint: str, msg: object) -> None:
        self.net.in_flight.append((endpoint, encode(msg, SECRET, self.sender, next_seq(), self.net.clock())))

    def drop(self, endpoint: str) -> None:
        pass

    def close(self) -> None:
        self.net.handlers.pop(self.endpoint, None)


class StreamEvents:
    """The KV events of one simulated device stream: numbered in recording order and, like CUDA events on
    one stream, complete in that order, so waiting on one covers every event recorded before it."""

    def __init__(self) -> None:
        self.recorded = 0
        self.waited = 0  # the newest event number some thread waited on
        self.page_event: dict[int, int] = {}  # page -> number of the event after the forward that last wrote it

    def record(self, slots: torch.Tensor) -> HostEvent:
        self.recorded += 1
        number, event = self.recorded, HostEvent()
        for page in (slots // CONFIG.page_size).tolist():
            self.page_event[page] = number
        real_wait = event.synchronize

        def synchronize() -> None:
            real_wait()
            self.waited = max(self.waited, number)

        event.synchronize = synchronize
        event.record()
        return event

    def unwaited(self, pages: list[int]) -> list[int]:
        """Of `pages`, those written by a forward that no thread has waited for yet."""
        return [p for p in pages if self.page_event.get(p, 0) > self.waited]


class KVRunner:
    """Next token = last token + 1; the KV of token t at slot s is the value t in every buffer."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers
        self.fail_next = False  # the next forward dies half way (after writing some of its KV)
        self.events = StreamEvents()

    def run(self, plan) -> BatchResult:
        if self.fail_next:
            self.fail_next = False
            for buf in self.buffers[:1]:
                buf[plan.out_cache_locs[0]] = -7  # garbage in the first request's new slots, one layer
            raise RuntimeError("CUDA out of memory (simulated)")
        tokens = torch.tensor(
            [t for r, ext in zip(plan.reqs, plan.extend_lens) for t in r.fill_ids[r.kv_len - ext : r.kv_len]]
        )
        for buf in self.buffers:
            buf[torch.cat(plan.out_cache_locs)] = tokens
        ids = [(r.fill_ids[r.kv_len - 1] + 1) % VOCAB if s else None for r, s in zip(plan.reqs, plan.sample)]
        n = len(plan.reqs)
        return BatchResult(ids, [None] * n, [None] * n, [None] * n, self.events.record(torch.cat(plan.out_cache_locs)))


class FakeTokenizer:
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def kv_args(buffers: list[torch.Tensor], aux: AuxPool | None = None) -> KVArgs:
    c = CONFIG
    return KVArgs(
        [b.data_ptr() for b in buffers],
        [b.numel() * 8 for b in buffers],
        [c.page_size * 8] * len(buffers),
        NUM_PAGES,
        c.page_size,
        backend="loopback",
        secret=SECRET,
        aux_ptr=aux.data_ptr if aux else 0,
        aux_record_bytes=RECORD_BYTES,
        aux_slots=aux.num_slots if aux else 0,
        kv_wait_timeout_s=c.kv_wait_timeout_s,
        transfer_timeout_s=c.transfer_timeout_s,
        heartbeat_interval_s=c.heartbeat_interval_s,
        heartbeat_misses=c.heartbeat_misses,
        max_queued_chunks=4,
    )


class Side:
    """One simulated server process: its buffers, scheduler, role and transfer manager."""

    def __init__(self, net: Network, clock: Clock, mode: str, lookup=None, prefix_cache: bool = True):
        """`prefix_cache` False: as --disable-radix-cache."""
        c = CONFIG
        self.net, self.clock, self.mode = net, clock, mode
        self.buffers = [torch.full(((NUM_PAGES + 1) * c.page_size,), -1, dtype=torch.int64) for _ in range(2)]
        allocator = PagedAllocator(NUM_PAGES, c.page_size)
        self.memory = MemoryManager(
            ReqToTokenPool(c.max_running_requests + 8, 200, "cpu"),
            allocator,
            RadixCache(allocator, c.page_size) if prefix_cache else NoPrefixCache(allocator, c.page_size),
            c.page_size,
        )
        output = OutputProcessor(FakeTokenizer(), {EOS}, context_len=CONTEXT_LEN)
        self.runner = KVRunner(self.buffers)
        self.sched = Scheduler(c, self.runner, self.memory, output, clock=clock)
        make_control = lambda sender, counters: FakeControlPlane(net, sender)  # noqa: E731
        common = dict(
            control=make_control, clock=clock, wall_clock=clock, threaded=False, wake_scheduler=self.sched.wake
        )
        if mode == "prefill":
            self.manager = PrefillKVManager(kv_args(self.buffers), **common)
            self.sched.role = PrefillRole(SchedulerView(self.sched), self.manager, c)
        else:
            self.aux = AuxPool(2 * c.max_running_requests)
            self.manager = DecodeKVManager(kv_args(self.buffers, self.aux), **common)
            self.sched.role = DecodeRole(SchedulerView(self.sched), self.manager, self.aux, lookup, VOCAB, c)
        self.alive, self.frozen = True, False

    @property
    def runs(self) -> bool:
        return self.alive and not self.frozen

    def freeze(self, frozen: bool) -> None:
        self.frozen = frozen
        (self.net.held.add if frozen else self.net.held.discard)(self.manager.endpoint)

    def kill(self) -> None:
        self.alive = False
        self.net.handlers.pop(self.manager.endpoint, None)
        self.net.held.discard(self.manager.endpoint)

    def run_transfers(self) -> None:
        if self.mode == "prefill":
            for worker in self.manager.workers.alive():
                while worker.run_once():
                    pass


def done_future(result: PeerInfo | None = None, error: Exception | None = None) -> Future:
    f: Future = Future()
    f.set_exception(error) if error is not None else f.set_result(result)
    return f

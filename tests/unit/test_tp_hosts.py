"""A TP group across hosts without starting processes: the flags' refusals as `tandem serve` prints them,
and the host board over a real TCPStore in this process: heartbeats, the silence window on both sides,
a posted fault (the first stays), remote progress copied for the step watchdog; start-up: a host waits
for host 0 quietly (one line) and within --dist-timeout, and ranks that never join are named."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from pydantic import ValidationError

from common.config import ServerConfig
from common.parallel.group import host_store, join_store, start_barrier
from common.ranks.host import Host, host0_config
from common.ranks.host_board import HostBoard
from common.ranks.launch import free_port, local_ranks
from common.ranks.progress import Progress
from common.ranks.remote_hosts import RemoteHosts
from common.wire.user_error import UserError, config_error
from tandem.server import check_before_loading

ADDR = "10.0.0.1:5000"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(tp_size=4, nnodes=2, node_rank=2, dist_init_addr=ADDR), "--node-rank 2 must be below --nnodes 2"),
        (dict(tp_size=3, nnodes=2, dist_init_addr=ADDR), "--tp-size 3 must be a multiple of --nnodes 2"),
        (dict(tp_size=4, nnodes=2), "--nnodes 2 needs --dist-init-addr HOST:PORT"),
        (dict(tp_size=2, nnodes=2, dist_init_addr="10.0.0.1"), "--dist-init-addr '10.0.0.1' is not HOST:PORT"),
    ],
)
def test_bad_host_flags_are_refused_naming_them(flags, message):
    with pytest.raises(ValidationError) as e:
        ServerConfig(**flags)
    assert message in str(config_error(e.value))


def test_host0_checks_that_its_rendezvous_port_is_free():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        addr = f"127.0.0.1:{held.getsockname()[1]}"
        config = ServerConfig(tp_size=2, nnodes=2, dist_init_addr=addr, port=free_port())
        with pytest.raises(UserError, match=f"--dist-init-addr {held.getsockname()[1]}: another process listens"):
            check_before_loading(config)


def test_each_host_runs_an_even_share_of_the_ranks():
    config = dict(tp_size=4, nnodes=2, dist_init_addr=ADDR)
    assert [local_ranks(ServerConfig(**config, node_rank=k)) for k in (0, 1)] == [range(0, 2), range(2, 4)]
    assert local_ranks(ServerConfig(tp_size=3)) == range(0, 3)


@pytest.fixture
def board_pair():
    """Host 0's board (hosting the store, as rank 0 does) and host 1's, joined to it."""
    addr = f"127.0.0.1:{free_port()}"
    host0 = HostBoard(host_store(addr, 4, 30), 0)
    yield addr, host0, HostBoard(join_store(addr, 30), 1)


def remote_view(addr: str, board: HostBoard, window_s: float):
    config = ServerConfig(tp_size=4, nnodes=2, dist_init_addr=addr, heartbeat_interval_s=window_s / 2)
    return RemoteHosts(config, board), Progress.create(4)


def test_host0_names_a_silent_host_once_serving(board_pair):
    addr, host0, host1 = board_pair
    remote, progress = remote_view(addr, host0, 0.4)
    try:
        host1.publish({2: (111, "S", 6), 3: (112, "T", 5)})
        assert remote.poll(serving=False, progress=progress) is None
        assert progress.values[2:].tolist() == [6, 5]  # for the step watchdog's laggards
        assert remote.describe(3) == "pid 112 on host 1, state T"
        time.sleep(0.5)
        assert remote.poll(serving=False, progress=progress) is None  # start-up: not judged
        host1.publish({})
        assert remote.poll(serving=True, progress=progress) is None
        time.sleep(0.5)
        problem = remote.poll(serving=True, progress=progress)
        assert problem.startswith("host 1 (tp ranks 2-3) has sent no heartbeat for "), problem
    finally:
        progress.remove()


def test_the_first_posted_fault_stays_and_every_host_reads_it(board_pair):
    addr, host0, host1 = board_pair
    remote, progress = remote_view(addr, host0, 10)
    try:
        assert host1.fault() is None and remote.poll(serving=True, progress=progress) is None
        host1.set_fault("tp rank 3 (pid 9 on host 1) exited with code -9")
        host0.set_fault("a later one")
        assert remote.poll(serving=True, progress=progress) == "tp rank 3 (pid 9 on host 1) exited with code -9"
        assert host1.fault() == "tp rank 3 (pid 9 on host 1) exited with code -9"
    finally:
        progress.remove()


def test_host_k_judges_host0_only_once_it_serves(board_pair):
    addr, host0, host1 = board_pair
    host = Host.__new__(Host)  # its watching half only: no ranks started
    host.board, host.host0, host.problem, host.window_s = host1, None, None, 0.3
    host0.publish({}, serving=False)
    host._read_host0()
    time.sleep(0.4)
    assert host._host0_silence() is None
    host0.publish({}, serving=True)
    host._read_host0()
    assert host._host0_silence() is None
    time.sleep(0.4)
    assert host._host0_silence().startswith("host 0 has sent no heartbeat for ")
    host0.set_fault("tp rank 1 exited")
    host._read_host0()
    assert host.problem == "the TP group is broken: tp rank 1 exited"


def test_host_k_runs_its_ranks_with_host0s_config_but_its_own_place(board_pair):
    addr, host0, host1 = board_pair
    leader = ServerConfig(tp_size=4, nnodes=2, dist_init_addr=addr, page_size=32, api_key="k0", cluster_secret="s0")
    host0.post_config(leader)
    assert "k0" not in host0.store.get("tandem/config").decode()  # secrets stay off the unauthenticated store
    own = ServerConfig(tp_size=4, nnodes=2, node_rank=1, dist_init_addr=addr, model="/mnt/m", cluster_secret="s1")
    config = host0_config(own, host1.config())
    assert (config.page_size, config.node_rank, config.model, config.cluster_secret) == (32, 1, "/mnt/m", "s1")
    lost = ServerConfig(tp_size=6, nnodes=3, node_rank=2, dist_init_addr=addr)
    with pytest.raises(UserError, match="--node-rank 2 must be below --nnodes 2"):
        host0_config(lost, host1.config())


def test_a_host_started_first_waits_quietly_with_one_line_then_joins(caplog, capfd):
    """Hosts start at once (as a LeaderWorkerSet starts them): host 1 polls host 0's port with plain
    connections, says so once, and joins once host 0's store listens: no c10d stack trace."""
    addr = f"127.0.0.1:{free_port()}"
    stores = []
    host0 = threading.Timer(1.5, lambda: stores.append(host_store(addr, 2, 30)))
    host0.start()
    with caplog.at_level(logging.INFO):
        store = join_store(addr, 30, start_s=20, waiting="host 1: waiting for host 0")
    store.set("k", "v")
    host0.join(30)  # host 0's store may accept host 1 before its own call returns
    assert stores[0].get("k") == b"v"
    assert [r.message for r in caplog.records] == ["host 1: waiting for host 0"]
    assert "c10d" not in capfd.readouterr().err


def test_a_host_whose_host0_never_comes_stops_with_one_clear_line(caplog, capfd):
    addr = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO), pytest.raises(UserError) as e:
        join_store(addr, 30, start_s=1.0, waiting="host 2: waiting for host 0")
    assert 1.0 <= time.monotonic() - t0 < 3
    assert f"nothing listens at --dist-init-addr {addr} after --dist-timeout" in str(e.value)
    assert len(caplog.records) == 1 and "c10d" not in capfd.readouterr().err


def test_ranks_that_never_join_are_named_within_the_start_up_bound():
    """Host 0's rank 0 and host 1's rank 1 joined; host 2 never started: rank 0 names rank 2 (host 2)."""
    addr = f"127.0.0.1:{free_port()}"
    store = host_store(addr, 3, 30)
    rank1 = threading.Thread(target=start_barrier, args=(join_store(addr, 30), 1, 3, 10.0, 1))
    rank1.start()
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        start_barrier(store, 0, 3, 1.0, 1)
    assert time.monotonic() - t0 < 3
    assert str(e.value).startswith("tp ranks [2] (host 2) did not join the TP group within --dist-timeout 1 s")
    store.set("tandem/joined/2", "1")  # a late host 2 lets rank 1's wait end before the store goes
    rank1.join(5)


def test_a_silence_counts_only_from_when_every_host_had_loaded(board_pair):
    """Host 1 beat long before loading ended (host 0's watcher starved meanwhile): not held against it."""
    addr, host0, host1 = board_pair
    remote, progress = remote_view(addr, host0, 0.4)
    try:
        host1.publish({})
        assert remote.poll(serving=False, progress=progress) is None
        time.sleep(0.6)  # loading: longer than the window, and no beat read
        assert remote.poll(serving=True, progress=progress) is None
        time.sleep(0.5)
        assert remote.poll(serving=True, progress=progress).startswith("host 1 (tp ranks 2-3) has sent no heartbeat")
    finally:
        progress.remove()

"""A TP group across nodes without starting processes: the flags' refusals as `tandem serve` prints them,
and the node board over a real TCPStore in this process: heartbeats, the silence window on both sides,
a posted fault (the first stays), remote progress copied for the step watchdog; start-up: a node waits
for node 0 quietly (one line) and within --dist-timeout, and ranks that never join are named."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from pydantic import ValidationError

from common.config import ServerConfig
from common.parallel.group import join_rendezvous, serve_rendezvous, start_barrier
from common.ranks.launch import free_port, local_ranks
from common.ranks.node import Node, node0_config
from common.ranks.node_board import NodeBoard
from common.ranks.progress import Progress
from common.ranks.remote_nodes import RemoteNodes
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


def test_node0_checks_that_its_rendezvous_port_is_free():
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
    """Node 0's board (hosting the store, as rank 0 does) and node 1's, joined to it."""
    addr = f"127.0.0.1:{free_port()}"
    node0 = NodeBoard(serve_rendezvous(addr, 4, 30), 0)
    yield addr, node0, NodeBoard(join_rendezvous(addr, 30), 1)


def remote_view(addr: str, board: NodeBoard, window_s: float):
    config = ServerConfig(tp_size=4, nnodes=2, dist_init_addr=addr, heartbeat_interval_s=window_s / 2)
    return RemoteNodes(config, board), Progress.create(4)


def test_node0_names_a_silent_host_once_serving(board_pair):
    addr, node0, node1 = board_pair
    remote, progress = remote_view(addr, node0, 0.4)
    try:
        node1.publish({2: (111, "S", 6), 3: (112, "T", 5)})
        assert remote.poll(serving=False, progress=progress) is None
        assert progress.values[2:].tolist() == [6, 5]  # for the step watchdog's laggards
        assert remote.describe(3) == "pid 112 on node 1, state T"
        time.sleep(0.5)
        assert remote.poll(serving=False, progress=progress) is None  # start-up: not judged
        node1.publish({})
        assert remote.poll(serving=True, progress=progress) is None
        time.sleep(0.5)
        problem = remote.poll(serving=True, progress=progress)
        assert problem.startswith("node 1 (tp ranks 2-3) has sent no heartbeat for "), problem
    finally:
        progress.remove()


def test_the_first_posted_fault_stays_and_every_host_reads_it(board_pair):
    addr, node0, node1 = board_pair
    remote, progress = remote_view(addr, node0, 10)
    try:
        assert node1.fault() is None and remote.poll(serving=True, progress=progress) is None
        node1.set_fault("tp rank 3 (pid 9 on node 1) exited with code -9")
        node0.set_fault("a later one")
        assert remote.poll(serving=True, progress=progress) == "tp rank 3 (pid 9 on node 1) exited with code -9"
        assert node1.fault() == "tp rank 3 (pid 9 on node 1) exited with code -9"
    finally:
        progress.remove()


def test_host_k_judges_node0_only_once_it_serves(board_pair):
    addr, node0, node1 = board_pair
    node = Node.__new__(Node)  # its watching half only: no ranks started
    node.board, node.node0, node.problem, node.window_s = node1, None, None, 0.3
    node0.publish({}, serving=False)
    node._read_node0()
    time.sleep(0.4)
    assert node._node0_silence() is None
    node0.publish({}, serving=True)
    node._read_node0()
    assert node._node0_silence() is None
    time.sleep(0.4)
    assert node._node0_silence().startswith("node 0 has sent no heartbeat for ")
    node0.set_fault("tp rank 1 exited")
    node._read_node0()
    assert node.problem == "the TP group is broken: tp rank 1 exited"


def test_host_k_runs_its_ranks_with_node0s_config_but_its_own_place(board_pair):
    addr, node0, node1 = board_pair
    leader = ServerConfig(tp_size=4, nnodes=2, dist_init_addr=addr, page_size=32, api_key="k0", cluster_secret="s0")
    node0.post_config(leader)
    assert (
        "k0" not in node0.rendezvous.get("tandem/config").decode()
    )  # secrets stay off the unauthenticated rendezvous store
    own = ServerConfig(tp_size=4, nnodes=2, node_rank=1, dist_init_addr=addr, model="/mnt/m", cluster_secret="s1")
    config = node0_config(own, node1.config())
    assert (config.page_size, config.node_rank, config.model, config.cluster_secret) == (32, 1, "/mnt/m", "s1")
    lost = ServerConfig(tp_size=6, nnodes=3, node_rank=2, dist_init_addr=addr)
    with pytest.raises(UserError, match="--node-rank 2 must be below --nnodes 2"):
        node0_config(lost, node1.config())


def test_a_host_started_first_waits_quietly_with_one_line_then_joins(caplog, capfd):
    """Nodes start at once (as a LeaderWorkerSet starts them): node 1 polls node 0's port with plain
    connections, says so once, and joins once node 0's store listens: no c10d stack trace."""
    addr = f"127.0.0.1:{free_port()}"
    stores = []
    node0 = threading.Timer(1.5, lambda: stores.append(serve_rendezvous(addr, 2, 30)))
    node0.start()
    with caplog.at_level(logging.INFO):
        store = join_rendezvous(addr, 30, start_s=20, waiting="node 1: waiting for node 0")
    store.set("k", "v")
    node0.join(30)  # node 0's store may accept node 1 before its own call returns
    assert stores[0].get("k") == b"v"
    assert [r.message for r in caplog.records] == ["node 1: waiting for node 0"]
    assert "c10d" not in capfd.readouterr().err


def test_a_host_whose_node0_never_comes_stops_with_one_clear_line(caplog, capfd):
    addr = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO), pytest.raises(UserError) as e:
        join_rendezvous(addr, 30, start_s=1.0, waiting="node 2: waiting for node 0")
    assert 1.0 <= time.monotonic() - t0 < 3
    assert f"nothing listens at --dist-init-addr {addr} after --dist-timeout" in str(e.value)
    assert len(caplog.records) == 1 and "c10d" not in capfd.readouterr().err


def test_ranks_that_never_join_are_named_within_the_start_up_bound():
    """Node 0's rank 0 and node 1's rank 1 joined; node 2 never started: rank 0 names rank 2 (node 2)."""
    addr = f"127.0.0.1:{free_port()}"
    store = serve_rendezvous(addr, 3, 30)
    rank1 = threading.Thread(target=start_barrier, args=(join_rendezvous(addr, 30), 1, 3, 10.0, 1))
    rank1.start()
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        start_barrier(store, 0, 3, 1.0, 1)
    assert time.monotonic() - t0 < 3
    assert str(e.value).startswith("tp ranks [2] (node 2) did not join the TP group within --dist-timeout 1 s")
    store.set("tandem/joined/2", "1")  # a late node 2 lets rank 1's wait end before the store goes
    rank1.join(5)


def test_a_silence_counts_only_from_when_every_host_had_loaded(board_pair):
    """Node 1 beat long before loading ended (node 0's watcher starved meanwhile): not held against it."""
    addr, node0, node1 = board_pair
    remote, progress = remote_view(addr, node0, 0.4)
    try:
        node1.publish({})
        assert remote.poll(serving=False, progress=progress) is None
        time.sleep(0.6)  # loading: longer than the window, and no beat read
        assert remote.poll(serving=True, progress=progress) is None
        time.sleep(0.5)
        assert remote.poll(serving=True, progress=progress).startswith("node 1 (tp ranks 2-3) has sent no heartbeat")
    finally:
        progress.remove()

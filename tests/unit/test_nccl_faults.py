"""Rank death on CUDA, checked on the CPU: NCCL never raises when a peer dies (its collectives spin on the
device and rank 0 waits in its next read), so the group is formed eagerly on the rank's GPU with NCCL's
own error handling off, and rank 0's supervisor, on a fault it names, aborts the communicators; the step
whose read that released is failed, not trusted."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.parallel import group
from common.ranks import ranks
from common.ranks.ranks import RankFault, Ranks
from common.wire.sampling_params import SamplingParams


def test_on_cuda_the_group_is_formed_on_the_ranks_own_gpu_and_nccl_handles_no_errors(monkeypatch):
    calls = {}
    monkeypatch.delenv(group.NCCL_ERROR_HANDLING_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.setdefault("set_device", index))
    monkeypatch.setattr(group.dist, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(group.dist, "new_group", lambda **kw: "host-group")
    tp = group.init_group(5, 8, "store", "cuda", 60.0, per_node=4)
    assert (tp.rank, tp.size) == (5, 8) and calls["set_device"] == 1
    assert calls["init"]["backend"] == "nccl" and calls["init"]["device_id"] == torch.device("cuda", 1)
    assert group.os.environ[group.NCCL_ERROR_HANDLING_ENV] == "0"
    calls.clear()
    monkeypatch.setenv(group.NCCL_ERROR_HANDLING_ENV, "2")  # the operator's choice stays
    group.init_group(1, 2, "store", "cpu", 60.0, per_node=2)
    assert calls["init"]["backend"] == "gloo" and "device_id" not in calls["init"]
    assert group.os.environ[group.NCCL_ERROR_HANDLING_ENV] == "2"


def test_aborting_is_for_cuda_groups_only():
    assert group.abort_collectives("cpu") is None  # gloo raises on a closed peer by itself
    assert group.abort_collectives("cuda") is None  # no group in this process: nothing to abort


def supervisor(device: str) -> Ranks:
    """Rank 0's supervisor without processes: the state _set_fault and check_step use."""
    r = Ranks.__new__(Ranks)
    r.config = ServerConfig(device=device)
    r.fault, r.procs, r.remote, r._lock = None, [], None, threading.Lock()
    return r


def test_a_fault_aborts_the_collectives_once_and_fails_the_step_it_released(monkeypatch, caplog):
    aborted = []
    monkeypatch.setattr(ranks, "abort_collectives", lambda device: aborted.append(device) or "no communicator")
    r = supervisor("cuda")
    r.check_step()  # a healthy group: the step stands
    r._set_fault("tp rank 1 (pid 7) exited with code -9")
    r._set_fault("tp rank 2 (pid 8) exited with code 3")  # the first fault is the one named
    assert aborted == ["cuda"]
    assert "could not abort the NCCL communicators" in caplog.text
    with pytest.raises(RankFault, match="tp rank 1 .* exited with code -9"):
        r.check_step()


def test_the_runner_checks_the_step_once_its_tokens_reached_the_host(tiny_model_dir, caplog):
    """A step released by an abort read garbage: the runner asks after the read, and the step's requests
    fail naming the fault instead of taking its tokens."""
    engine = Engine(ServerConfig(model=str(tiny_model_dir), max_total_tokens=2048))
    fault: list[str] = []

    def check():
        if fault:
            raise RankFault(fault[0])

    engine.runner.check_step = check
    s = engine.scheduler
    req = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0))
    s.add_request(req)
    while not req.output_ids:
        s.step()
    fault.append("tp rank 1 (pid 9) exited with code -9")
    with caplog.at_level(logging.ERROR):
        while s.step():
            pass
    assert req.finished and len(req.output_ids) == 1  # the released step's token was never taken
    assert "RankFault('tp rank 1 (pid 9) exited with code -9')" in caplog.text

"""A follower rank (1..tp_size-1): joins rank 0's group, builds its shard of the model and its KV pool,
then runs every forward rank 0 sends, until rank 0 says stop or goes away.

It decides nothing: no scheduler, no request table, no sampling. Its logits are dropped (rank 0 samples
from the all-gathered ones). An error ends the process; rank 0 sees the exit and names this rank,
unless it was a collective failing (exit code PEER_GONE_EXIT): then another rank is gone, and that one
is named. A prefill's or decode's follower also runs its own KV transfer engine: the entry point its
server names (common.ranks.launch) passes `services`, started once the pool exists, whose report goes to
rank 0 with the rank's (under "transfer").

    python -m common.ranks.follower --rank R --size N --addr HOST:PORT --progress FILE --config JSON
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from common.config import ServerConfig
from common.lora.follower import FollowerLora
from common.lora.setup import read_lora
from common.memory.kv_pool import KVPool
from common.model.eplb import rebalance_experts
from common.model.loader import load_hf_config, resolve_model_dir
from common.parallel.group import PEER_GONE_EXIT, PeerGone, init_group, join_rendezvous, start_barrier
from common.ranks.progress import Progress
from common.ranks.rank_model import RankModel, build_rank_model, model_layout, rank_report
from common.ranks.ranks import GROUP_TIMEOUT_S
from common.ranks.step import OP_REBALANCE, OP_STOP, StepChannel
from common.wire.user_error import UserError

log = logging.getLogger(__name__)
STARTUP_MARGIN_S = 5.0


Services = Callable[[ServerConfig, KVPool], Any]  # starts what else a rank runs; returns it (with `report()`)


def exit_with_rank0(files: list[str]) -> None:
    """Exit as soon as our starter's end of our stdin closes (rank 0, or node k's process, exited however
    it did), removing the shared `files` it may not have removed (it died before)."""

    def wait() -> None:
        sys.stdin.buffer.read()
        for path in files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        os._exit(0)

    threading.Thread(target=wait, name="rank0-watch", daemon=True).start()


def serve_steps(rank: int, built: RankModel, channel: StepChannel, progress: Progress) -> None:
    while True:
        op, step, batch = channel.receive()
        if op == OP_STOP:
            return
        progress.received(rank, step)
        if op == OP_REBALANCE:
            rebalance_experts(built.model, built.model.tp)
        else:
            if len(batch.input_ids):  # an idle batch (DP attention) only joins the collectives
                built.attn.init_forward(batch)
            built.model(batch, built.attn)
        progress.finished(rank, step)


def main(argv: list[str] | None = None, services: Services | None = None) -> None:
    p = argparse.ArgumentParser(prog="common.ranks.follower")
    for flag in ("--rank", "--size"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--addr", required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--config", required=True)
    ns = p.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("TANDEM_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s [tp{ns.rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = ServerConfig.model_validate(json.loads(ns.config))
    exit_with_rank0([ns.progress])
    torch.manual_seed(config.seed)
    rendezvous = join_rendezvous(ns.addr, GROUP_TIMEOUT_S)
    try:  # rank 0 decides first (its bound is the same, counted earlier) and names the ranks missing
        start_barrier(rendezvous, ns.rank, ns.size, config.dist_timeout + STARTUP_MARGIN_S, config.ranks_per_node)
    except (UserError, RuntimeError) as e:
        log.error("%s", str(e).splitlines()[0])
        logging.shutdown()
        os._exit(1)
    tp = model_layout(
        init_group(ns.rank, ns.size, rendezvous, config.device, GROUP_TIMEOUT_S, config.ranks_per_node), config
    )
    model_dir = resolve_model_dir(config.model, quantization=config.quantization)
    dtype = getattr(torch, config.torch_dtype_name)
    hf = load_hf_config(model_dir)
    lora = read_lora(config, hf)  # --enable-lora: the same adapters as rank 0, this rank's part of each slot
    built = build_rank_model(config, model_dir, hf, dtype, tp)
    follow_lora = FollowerLora(lora, built.model).batch if lora is not None else None
    started = services(config, built.kv_pool) if services is not None else None  # lives as long as we serve
    tp.all_gather_objects(rank_report(ns.rank, built) | ({"transfer": started.report()} if started else {}))
    code = 0
    try:
        channel = StepChannel(tp, config.device, config.page_size, follow_lora)
        serve_steps(ns.rank, built, channel, Progress(ns.progress, ns.size))
        log.info("stopped by rank 0")
    except PeerGone as e:  # not this rank's fault: whoever starts and watches it names the rank that is gone
        log.error("a collective failed, another rank is gone: %s", e)
        code = PEER_GONE_EXIT
    logging.shutdown()
    os._exit(code)  # not through interpreter teardown: the stdin watcher blocks in a read


if __name__ == "__main__":
    main()

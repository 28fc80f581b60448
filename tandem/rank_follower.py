"""The follower rank of a `tandem serve` server at `--tp-size N` (rank 0 starts it, by this name, which
tandem/server.py hands it: common.ranks.launch): common.ranks.follower, plus, on a prefill or decode, the rank's
own KV transfer engine and agent (transfer.rank_agent), started once its pool exists and reported to rank 0.

    python -m tandem.rank_follower --rank R --size N --addr HOST:PORT --progress FILE --config JSON
"""

from __future__ import annotations

from common.config import ServerConfig
from common.memory.kv_pool import KVPool
from common.ranks import follower
from transfer.backends.factory import make_backend
from transfer.bulk_priority import create_lowered
from transfer.rank_agent import RankAgent


def start_agent(config: ServerConfig, pool: KVPool) -> RankAgent | None:
    """This rank's engine on its own device, its pool registered; a prefill's agent serves rank 0; None on a
    monolithic server (no KV crosses)."""
    if config.disaggregation_mode == "null":
        return None
    on_cuda = config.device == "cuda"
    backend = create_lowered(
        lambda: make_backend(
            config.transfer_backend,
            config.public_host,
            config.transfer_protocol,
            config.transfer_device,
            config.transfer_timeout_s,
            on_cuda,
            pool.device_index,
        )
    )
    (buffer,) = pool.buffer_infos()
    serve = config.disaggregation_mode == "prefill"
    triple = (buffer.data_ptr, buffer.nbytes, buffer.bytes_per_page)
    return RankAgent(backend, triple, on_cuda, config.public_host, config.cluster_secret, serve, pool.device_index)


if __name__ == "__main__":
    follower.main(services=start_agent)

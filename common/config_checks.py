"""The flag combinations a server cannot run, refused at start-up with one line naming the flags
(ServerConfig's validator calls `check_flags`; common/config.py holds the flags themselves)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.memory.store.config import parse_store_config
from common.wire.addresses import split_host_port
from common.wire.kv_events import parse_kv_events_config

if TYPE_CHECKING:
    from common.config import ServerConfig


def check_flags(c: ServerConfig) -> None:
    """Every flag combination the server cannot run is refused here, at start-up, naming the flags."""
    if c.chunked_prefill_size > 0 and c.chunked_prefill_size % c.page_size:
        raise ValueError(
            f"--chunked-prefill-size {c.chunked_prefill_size} is not a multiple of --page-size {c.page_size}: "
            "give a multiple, or 0 to turn chunked prefill off"
        )
    if c.ssl_keyfile and not c.ssl_certfile:
        raise ValueError("ssl_keyfile needs ssl_certfile")
    check_hosts(c)
    check_dp_ep(c)
    if c.kv_events_config:
        parse_kv_events_config(c.kv_events_config)  # a bad field stops the server at start-up
    if c.enable_hierarchical_cache and (c.disable_radix_cache or c.tp_size > 1):
        raise ValueError(
            "--enable-hierarchical-cache needs the radix cache and --tp-size 1: "
            "drop --disable-radix-cache, or run it at --tp-size 1"
        )
    if c.disaggregation_enable_kv_checksum and (c.tp_size > 1 or c.device == "cuda"):
        raise ValueError(
            "--disaggregation-enable-kv-checksum checks the KV in host memory at --tp-size 1 only: "
            "drop it, or run this server at --tp-size 1 on the CPU"
        )
    check_speculative(c)
    if c.enable_pd_role_switch and (c.disaggregation_mode == "null" or c.tp_size > 1):
        raise ValueError(
            "--enable-pd-role-switch needs --disaggregation-mode prefill or decode and --tp-size 1: a monolithic server "
            "has no role to switch, and the ranks of a TP group cannot switch yet"
        )
    check_store(c)
    check_lora(c)
    check_deterministic(c)
    if c.transfer_backend == "loopback" and c.disaggregation_mode != "null":
        raise ValueError("--transfer-backend loopback is for unit tests only: use mooncake or nixl")


def check_deterministic(c: ServerConfig) -> None:
    """--enable-deterministic-inference holds where its batch-invariant ops were built: the CPU's products and
    the torch backend's fixed split; on CUDA tiled products and FlashInfer's unsplit KV (docs/gpu.md), with no
    prefix cache and no speculation there (a prefix hit or a verify changes FlashInfer's query tile); within one
    TP group of at most 2 ranks (a sum of two partials is the same in either order), with no other rank's batch
    in the forward."""
    if not c.enable_deterministic_inference:
        return
    cuda = c.device == "cuda"
    found = [
        (cuda and c.attention_backend == "torch", "--device cuda --attention-backend torch", "flashinfer on CUDA"),
        (c.attention_backend == "flashinfer" and not cuda, "--attention-backend flashinfer off CUDA", "torch"),
        (
            cuda and not c.disable_radix_cache,
            "the prefix cache on CUDA (a hit shortens the prefill: FlashInfer picks another query tile)",
            "--disable-radix-cache",
        ),
        (
            cuda and c.speculative_algorithm is not None,
            "--speculative-algorithm on CUDA (FlashInfer verifies in another query tile than a decode step)",
            "no speculation",
        ),
        (
            c.tp_size > 2,
            f"--tp-size {c.tp_size} (an all-reduce of 3 or more partials in a batch-dependent order)",
            "--tp-size 1 or 2",
        ),
        (
            c.enable_dp_attention or c.ep_size > 1,
            "--enable-dp-attention / --ep-size (other ranks' tokens in the forward)",
            "neither",
        ),
        (c.enable_lora, "--enable-lora (its products are not batch-invariant yet)", "no --enable-lora"),
    ]
    for bad, what, instead in found:
        if bad:
            raise ValueError(
                f"--enable-deterministic-inference is not implemented with {what}: use {instead}, "
                "or drop --enable-deterministic-inference"
            )


DRAFTS_FROM_PATH = ("STANDALONE", "EAGLE", "EAGLE3")  # what --speculative-draft-model-path gives


def check_speculative(c: ServerConfig) -> None:
    """The speculative flags fit together; what is not implemented is refused naming it."""
    algo = c.speculative_algorithm
    if algo is None:
        if c.speculative_draft_model_path:
            raise ValueError("--speculative-draft-model-path needs --speculative-algorithm STANDALONE, EAGLE or EAGLE3")
        return
    if c.speculative_eagle_topk != 1:
        raise ValueError(
            f"--speculative-eagle-topk {c.speculative_eagle_topk}: tree verification is not implemented, use 1"
        )
    steps, tokens = c.speculative_num_steps, c.speculative_num_draft_tokens
    if steps is not None and tokens is not None and tokens != steps + 1:
        raise ValueError(
            f"--speculative-num-draft-tokens {tokens} with --speculative-num-steps {steps}: a chain (topk 1) "
            f"verifies the last token and one draft per step, so give {steps + 1} or only one of the two"
        )
    if algo in DRAFTS_FROM_PATH and not c.speculative_draft_model_path:
        raise ValueError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path (its draft's directory)")
    if algo not in DRAFTS_FROM_PATH and c.speculative_draft_model_path:
        raise ValueError(f"--speculative-draft-model-path is for STANDALONE, EAGLE and EAGLE3 only, not {algo}")
    if c.enable_dp_attention:
        raise ValueError(
            f"--speculative-algorithm {algo} with --enable-dp-attention is not implemented (each DP rank would "
            "verify its own drafts in the one shared forward): drop one of the two"
        )
    if algo != "NGRAM" and c.tp_size > 1:
        raise ValueError(f"--speculative-algorithm {algo} runs its draft on one rank: use --tp-size 1 (or NGRAM)")
    if c.speculative_ngram_min_match_window_size > c.speculative_ngram_max_match_window_size:
        raise ValueError("--speculative-ngram-min-match-window-size is above --speculative-ngram-max-match-window-size")


def check_store(c: ServerConfig) -> None:
    if c.hicache_storage_backend is None:
        if c.hicache_storage_backend_extra_config:
            raise ValueError("--hicache-storage-backend-extra-config needs --hicache-storage-backend file|mooncake")
        return
    if not c.enable_hierarchical_cache:
        raise ValueError(
            f"--hicache-storage-backend {c.hicache_storage_backend} is the tier behind the host tier: "
            "add --enable-hierarchical-cache"
        )
    parse_store_config(c.hicache_storage_backend, c.hicache_storage_backend_extra_config)


def check_hosts(c: ServerConfig) -> None:
    """--nnodes, --node-rank and --dist-init-addr fit together and with --tp-size (SGLang's meanings)."""
    if c.node_rank >= c.nnodes:
        raise ValueError(f"--node-rank {c.node_rank} must be below --nnodes {c.nnodes}")
    if c.tp_size % c.nnodes:
        raise ValueError(f"--tp-size {c.tp_size} must be a multiple of --nnodes {c.nnodes} (ranks per host)")
    if c.dist_init_addr is not None:
        try:
            split_host_port(c.dist_init_addr)
        except ValueError as e:
            raise ValueError(f"--dist-init-addr {e}") from None
    if c.nnodes == 1:
        return
    if c.dist_init_addr is None:
        raise ValueError(f"--nnodes {c.nnodes} needs --dist-init-addr HOST:PORT (host 0's address)")


def check_dp_ep(c: ServerConfig) -> None:
    """--ep-size, --enable-dp-attention / --dp-size and EPLB fit together and with --tp-size."""
    if c.ep_size not in (1, c.tp_size):
        raise ValueError(f"--ep-size {c.ep_size} must be 1 or --tp-size {c.tp_size} (whole experts over every rank)")
    if c.moe_a2a_backend == "deepep":
        raise ValueError(
            "--moe-a2a-backend deepep: Tandem does not ship DeepEP's kernels; use --moe-a2a-backend none "
            "(torch.distributed all-to-all: NCCL on CUDA, gloo on the CPU)"
        )
    if c.enable_dp_attention and c.dp_size != c.tp_size:
        raise ValueError(f"--enable-dp-attention needs --dp-size equal to --tp-size (got {c.dp_size} and {c.tp_size})")
    if c.dp_size > 1 and not c.enable_dp_attention:
        raise ValueError(
            f"--dp-size {c.dp_size} without --enable-dp-attention: run {c.dp_size} servers behind the router "
            "instead, or add --enable-dp-attention"
        )
    if c.enable_dp_attention and c.nnodes > 1:
        raise ValueError("--enable-dp-attention with --nnodes > 1 is not supported: run DP attention on one host")
    if (c.enable_eplb or c.ep_num_redundant_experts) and c.ep_size == 1:
        raise ValueError("--enable-eplb and --ep-num-redundant-experts need expert parallelism: give --ep-size")


def check_lora(c: ServerConfig) -> None:
    """--enable-lora and its flags fit together; what LoRA does not compose with yet is refused naming it (the
    adapters themselves are checked when they are read: common/lora/manager.py)."""
    if not c.enable_lora:
        if c.lora_paths:
            raise ValueError("--lora-paths needs --enable-lora")
        return
    if c.enable_pd_role_switch:
        raise ValueError("--enable-lora with --enable-pd-role-switch is not implemented yet: drop one of the two")
    if c.enable_dp_attention:
        raise ValueError("--enable-lora with --enable-dp-attention is not implemented yet: drop one of the two")

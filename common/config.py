"""One config object per server process, validated once at start-up.

Every field is a CLI flag (`--page-size`) and an environment variable (`TANDEM_PAGE_SIZE`).
Derived values are properties, never copies.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.config_checks import check_flags
from common.lora.targets import TARGET_MODULES as LORA_TARGETS
from common.wire.body import ARRIVAL_TIMEOUT_S
from common.wire.kv_layout import LOOPBACK_BACKEND, TRANSFER_BACKENDS

DisaggregationMode = Literal["null", "prefill", "decode"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
STORE_WAITS = "the default with a KV store: a queued request waits for its prefix from the store, up to the timeout"


class ServerConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid", frozen=True, populate_by_name=True)

    model: str = Field("builtin", description="HF safetensors dir, GGUF file, or 'builtin'")
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=1, le=65535)
    disaggregation_mode: DisaggregationMode = Field(
        "null",
        validation_alias=AliasChoices("TANDEM_DISAGGREGATION_MODE", "TANDEM_DISAGG_MODE"),  # the old name too
        description="null: a monolithic server; prefill or decode: one half of a PD pair (SGLang's flag)",
    )
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attention_backend: Literal["auto", "torch", "flashinfer"] = "auto"
    flashinfer_backend: Literal["fa2", "fa3", "auto"] = Field(
        "fa2",
        description="FlashInfer's kernel family (as SGLang pins it): fa2 builds two kernels; auto adds FA3's on Hopper "
        "(several more minutes of first-start compilation)",
    )
    disable_cuda_graph: bool = Field(
        False, description="CUDA: run every decode step eagerly instead of replaying captured CUDA graphs"
    )
    cuda_graph_max_bs: int | None = Field(
        None, ge=1, le=4096, description="CUDA: the largest decode batch replayed from a graph (default 256)"
    )
    kernel_cache_dir: str | None = Field(
        None, description="where compiled attention kernels are kept across restarts (FlashInfer's JIT cache)"
    )
    quantization: str | None = Field(
        None,
        description="insist on the checkpoint's weight quantization (SGLang's and vLLM's names; read from "
        "config.json's quantization_config without it): fp8 (DeepSeek's FP8 blocks), compressed-tensors (FP8 or "
        "int4 pack-quantized), awq, gptq (awq_marlin, gptq_marlin: the same)",
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="KV cache storage: the model's dtype, or float8 with per-tensor scales (torch backend)"
    )
    seed: int = 0
    tp_size: int = Field(
        1, ge=1, le=64, description="tensor-parallel ranks: the server starts tp_size - 1 more processes (one GPU each)"
    )
    nnodes: int = Field(
        1, ge=1, le=64, description="machines (nodes) the TP group spans: each runs tp_size / nnodes ranks"
    )
    node_rank: int = Field(
        0, ge=0, description="this node's index among --nnodes: 0 serves HTTP with rank 0, others only run ranks"
    )
    dist_init_addr: str | None = Field(
        None, description="HOST:PORT where node 0 serves the TP group's rendezvous store (needed with --nnodes > 1)"
    )
    dist_timeout: float = Field(
        600.0,
        gt=0,
        description="seconds a TP group's start-up waits for node 0's rendezvous store and for every rank to join it "
        "(SGLang's flag); loading the model comes after, unbounded",
    )
    # expert parallelism and DP attention over the --tp-size ranks (SGLang's flags; docs/dp-attention.md)
    ep_size: int = Field(
        1, ge=1, le=64, description="MoE layers hold whole experts over this many ranks (1 or --tp-size)"
    )
    moe_a2a_backend: Literal["none", "deepep"] = Field(
        "none", description="how EP moves tokens between ranks: torch.distributed (gloo / NCCL); deepep is refused"
    )
    enable_dp_attention: bool = Field(
        False, description="each rank runs its own requests' attention (scheduler, batch, KV pool); MoE spans ranks"
    )
    dp_size: int = Field(1, ge=1, le=64, description="attention data-parallel ranks (--enable-dp-attention: --tp-size)")
    load_balance_method: Literal["auto", "round_robin", "minimum_tokens", "follow_bootstrap_room"] = Field(
        "auto",
        description="how requests spread over DP ranks (auto: follow_bootstrap_room on a decode, else round_robin)",
    )
    enable_eplb: bool = Field(False, description="rebalance expert placement from measured loads while serving (EP)")
    ep_num_redundant_experts: int = Field(0, ge=0, description="extra copies of experts over the EP ranks")
    eplb_rebalance_num_iterations: int = Field(1000, ge=1, description="forward steps between EPLB rebalances")

    # memory
    page_size: int = Field(16, ge=1, le=256)
    max_running_requests: int = Field(32, ge=1)
    max_total_tokens: int | None = Field(
        None,
        ge=16,
        description="KV cache capacity in tokens (CPU: default 16384; CUDA: a cap on what --mem-fraction-static gives)",
    )
    mem_fraction_static: float = Field(
        0.85,
        gt=0.0,
        lt=1.0,
        description="CUDA: share of the GPU's memory for weights and the KV pool; the rest is for activations",
    )
    context_length: int | None = Field(None, ge=16, description="default: the model's")
    chunked_prefill_size: int = Field(512, description="tokens per prefill chunk; <=0 disables")
    max_prefill_tokens: int = Field(4096, ge=16, description="token budget of one prefill batch")
    disable_radix_cache: bool = False
    kv_events_config: str | None = Field(
        None,
        description="publish the prefix cache's changes as vLLM KV cache events: JSON with vLLM's fields, e.g. "
        '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}',
    )
    enable_hierarchical_cache: bool = Field(
        False, description="a host-memory tier behind the prefix cache: evicted pages are copied there and loaded back"
    )
    hicache_ratio: float = Field(2.0, gt=0, description="host tier pages as a multiple of the device pool's")
    hicache_size: float = Field(0.0, ge=0, description="host tier size in GiB (overrides --hicache-ratio when > 0)")
    hicache_write_policy: Literal["write_through", "write_back"] = Field(
        "write_through", description="copy KV to the host tier when it is cached (write_through) or when evicted"
    )
    hicache_storage_backend: Literal["file", "mooncake"] | None = Field(
        None,
        description="a KV store every server shares, behind the host tier (needs --enable-hierarchical-cache): "
        "file (a directory) or mooncake (Mooncake Store)",
    )
    hicache_storage_backend_extra_config: str | None = Field(
        None,
        description="JSON for the store: Mooncake's names (master_server_address, metadata_server, protocol, "
        "global_segment_size, ...), file_path, prefetch_threshold, prefetch_timeout_base, ... (docs/kv-store.md)",
    )
    hicache_storage_prefetch_policy: PrefetchPolicy = Field(
        None,  # resolved by _store_waits_by_default: never None once validated
        description="how long a request waits for its prefix to come from the store: not at all (best_effort), until "
        "it has come (wait_complete), or at most prefetch_timeout_base + prefetch_timeout_per_ki_token per 1024 "
        "tokens (timeout); default: timeout when --hicache-storage-backend is given (SGLang's best_effort rarely "
        "waits for any of it: a cold server would compute every prefix the store holds), else best_effort",
    )
    max_queued_requests: int = Field(1024, ge=1)
    responses_store_size: int = Field(
        1000, ge=1, description="stored responses kept for previous_response_id and GET (the oldest evicted first)"
    )
    enable_priority_scheduling: bool = Field(
        False, description="honour requests' priority field (higher first): admission order and who is retracted"
    )

    # speculative decoding (SGLang's flags; docs/speculative.md)
    speculative_algorithm: Literal["NGRAM", "STANDALONE", "NEXTN", "EAGLE", "EAGLE3"] | None = Field(
        None,
        description="draft tokens and verify them in one forward: NGRAM (the request's own tokens), STANDALONE "
        "(a draft model), NEXTN (the checkpoint's MTP layer), EAGLE or EAGLE3 (a head in "
        "--speculative-draft-model-path over the target's last hidden state or three of its layers)",
    )
    speculative_num_steps: int | None = Field(None, ge=1, le=32, description="draft steps per verify (default 3)")
    speculative_eagle_topk: int = Field(1, ge=1, description="draft branches per step: 1 (a chain) is implemented")
    speculative_num_draft_tokens: int | None = Field(
        None,
        ge=2,
        le=64,
        description="tokens one verify scores per request: the last one and the drafts (default steps + 1)",
    )
    speculative_draft_model_path: str | None = Field(
        None,
        description="STANDALONE: the draft model (same tokenizer and attention shape as --model); EAGLE, EAGLE3: "
        "the head's directory",
    )
    speculative_ngram_min_match_window_size: int = Field(1, ge=1, description="NGRAM: shortest suffix matched")
    speculative_ngram_max_match_window_size: int = Field(12, ge=1, description="NGRAM: longest suffix matched")

    # PD disaggregation
    transfer_backend: Literal[(*TRANSFER_BACKENDS, LOOPBACK_BACKEND)] = TRANSFER_BACKENDS[0]
    transfer_protocol: Literal["tcp", "rdma"] = "tcp"
    transfer_device: str = Field("", description="RDMA device names for Mooncake, e.g. mlx5_0")
    advertise_host: str | None = Field(None, description="address peers use to reach this server (default: --host)")
    bootstrap_port: int = Field(8998, ge=1, le=65535)
    bootstrap_url: str | None = Field(None, description="standalone bootstrap server for prefill to register with")
    enable_pd_role_switch: bool = Field(
        False,
        description="POST /pd_role_switch turns this prefill into a decode or back without reloading the weights "
        "(SGLang's flag; docs/placement.md): it takes no new work, lets what runs finish, and serves the other role",
    )
    pd_role_switch_timeout_s: float = Field(
        300.0, gt=0, description="how long a role switch waits for the work in flight; past it the role stays"
    )
    pairing_timeout_s: float = Field(
        300.0, gt=0, description="how long a request may wait for its peer to reserve memory"
    )
    kv_wait_timeout_s: float = Field(
        300.0, gt=0, description="decode: how long reserved pages wait for the prefill's KV"
    )
    transfer_timeout_s: float = Field(
        60.0,
        gt=0,
        description="one bound for four clocks of the KV's way: a prefill's batch write to a decode (the transfer "
        "engine's own timeout); a prefill rank 0's wait for each TP rank's agent to write its slice (plus a grace); "
        "a decode's wait for an aborted room's final status before its pages are reused; a decode batch out of "
        "KV pages waiting for pages in flight to come back before its oldest request ends with 503",
    )
    heartbeat_interval_s: float = Field(
        5.0,
        gt=0,
        description="one interval for three clocks: a decode pings each prefill it waits on and the prefill "
        "watches the pings (a control connection silent this long is dialled again); a prefill re-registers "
        "with the bootstrap registry (at least every 15 s); the nodes of a TP group spanning machines "
        "(--nnodes > 1) post their heartbeats",
    )
    heartbeat_misses: int = Field(
        2,
        ge=2,
        description="silent intervals before a peer is declared dead and its rooms fail (>= 2: a pong answers a ping sent up to one interval earlier)",
    )
    cluster_secret: str | None = None
    disaggregation_enable_kv_checksum: bool = Field(
        False,
        description="the prefill hashes every page run it sends, the decode checks the pages before the room's KV "
        "is read or cached: a mismatch fails the room, which the router retries (SGLang's flag; on both roles)",
    )
    kv_load_failure_policy: Literal["fail", "recompute"] = Field(
        "fail",
        description="decode: when a room's KV does not arrive whole (its prefill died, the transfer failed or timed "
        "out, a checksum differed): fail the request, which the router moves to another pair, or compute the "
        "prompt here (vLLM's kv_load_failure_policy)",
    )

    # serving
    watchdog_timeout_s: float = Field(
        300.0, gt=0, description="a scheduler step running longer than this makes /health answer 503"
    )
    api_key: str | None = None
    ssl_certfile: str | None = Field(
        None, description="serve HTTPS (and the embedded bootstrap) with this PEM certificate"
    )
    ssl_keyfile: str | None = Field(None, description="the certificate's private key (default: in --ssl-certfile)")
    ssl_ca_certs: str | None = Field(
        None,
        description="CA bundle to verify peers' HTTPS with (the bootstrap registry; default: the system's); with a "
        "certificate or this, bootstrap lookups use https",
    )
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    head_timeout_s: float = Field(
        ARRIVAL_TIMEOUT_S,
        gt=0,
        description="a connection whose whole request head has not arrived this long after it opened, or after "
        "its previous answer, is closed unanswered (a client sending nothing, or its head slowly, holds no connection)",
    )

    # LoRA adapters (SGLang's and vLLM's flags; common/lora/)
    enable_lora: bool = Field(False, description="serve LoRA adapters (--lora-paths) beside the base model")
    lora_paths: list[str] | None = Field(
        None, description="the adapters: NAME=PATH of PEFT directories (or PATH, named by its last part)"
    )
    max_loras_per_batch: int = Field(
        8, ge=1, le=256, description="adapter slots: distinct adapters running at once (more wait, LRU)"
    )
    max_lora_rank: int | None = Field(
        None, ge=1, le=1024, description="the largest rank a slot holds (default: the adapters')"
    )
    lora_target_modules: list[Literal[LORA_TARGETS]] | None = Field(  # type: ignore[valid-type]
        None, description="projections adapters may change (default: those the adapters target)"
    )

    # structured outputs, tool calls, reasoning (docs/structured-output.md)
    grammar_backend: Literal["xgrammar", "none"] = Field(
        "xgrammar",
        description="constrained decoding (json_schema, regex, ebnf, tool_choice required/named); none refuses them. "
        "Where xgrammar does not import, the default serves unconstrained requests only (one warning); the flag "
        "given explicitly refuses to start",
    )
    constrained_json_disable_any_whitespace: bool = Field(
        False, description="JSON grammars allow no whitespace but one space after ':' and ','"
    )
    constrained_json_max_whitespace: int = Field(
        16, ge=1, description="whitespace characters a JSON grammar allows in one run (a model cannot pad forever)"
    )
    grammar_cache_size: int = Field(512, ge=1, description="compiled grammars kept (LRU)")
    tool_call_parser: Literal["hermes", "qwen25", "llama3", "mistral", "deepseekv3", "pythonic"] | None = Field(
        None, description="how tool_choice auto finds tool calls in the model's text (its family's format)"
    )
    reasoning_parser: Literal["deepseek-r1", "qwen3"] | None = Field(
        None, description="split the thinking part into reasoning_content; grammars apply after it ends"
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM: how long requests in flight may run on before they fail with a 503 and the server exits",
    )

    @model_validator(mode="before")
    @classmethod
    def _store_waits_by_default(cls, data: object) -> object:
        """A user who configures a store expects it used: without --hicache-storage-prefetch-policy, a server with a
        store waits for its prefixes (timeout), one without keeps SGLang's default."""
        if isinstance(data, dict) and data.get("hicache_storage_prefetch_policy") is None:
            policy = "timeout" if data.get("hicache_storage_backend") else "best_effort"
            data = {**data, "hicache_storage_prefetch_policy": policy}
        return data

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        check_flags(self)  # common/config_checks.py
        return self

    @property
    def speculative_draft_len(self) -> int:
        """Draft tokens proposed per request and verify (0: no speculative decoding)."""
        if self.speculative_algorithm is None:
            return 0
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens - 1
        return self.speculative_num_steps or 3

    @property
    def drafts_from_hidden(self) -> bool:
        """NEXTN, EAGLE and EAGLE3: a draft head reads the target's hidden states of every forward (TP 1, eager
        forwards, a prefix hit gives up its last page: common/engine/spec/head_drafter.py)."""
        return self.speculative_algorithm in ("NEXTN", "EAGLE", "EAGLE3")

    @property
    def lb_method(self) -> str:
        """--load-balance-method with auto resolved as SGLang does."""
        if self.load_balance_method != "auto":
            return self.load_balance_method
        return "follow_bootstrap_room" if self.disaggregation_mode == "decode" else "round_robin"

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            import socket

            return socket.gethostbyname(socket.gethostname())
        return self.host

    @property
    def peer_tls(self) -> str | bool | None:
        """How to verify the bootstrap registries this server calls: None for plain HTTP, else a CA bundle
        path or True (the system's CAs). A TLS server expects TLS of its peers."""
        if self.ssl_ca_certs:
            return self.ssl_ca_certs
        return True if self.ssl_certfile else None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    @property
    def chunked_prefill_enabled(self) -> bool:
        return self.chunked_prefill_size > 0

    def summary(self) -> str:
        items = self.model_dump(exclude={"api_key", "cluster_secret"})
        items["api_key"] = "set" if self.api_key else None
        items["cluster_secret"] = "set" if self.cluster_secret else None
        notes = {}
        if self.hicache_storage_backend and self.hicache_storage_prefetch_policy == "timeout":
            notes["hicache_storage_prefetch_policy"] = f"  ({STORE_WAITS})"
        width = max(len(k) for k in items)
        return "\n".join(f"  {k:<{width}} = {v}{notes.get(k, '')}" for k, v in items.items())

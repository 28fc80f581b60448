"""Decode CUDA graphs' logic on the CPU (common.engine.cuda_graph): which batch sizes get a graph and when
there are none, the static buffers a step is padded into (padding rows on the padding page), capture
largest first into one pool, and a padded step's logits equal the eager step's with only the padding page
written besides, through the torch backend and through FlashInfer's graph wrappers (a recording
stand-in: tests/unit/fake_flashinfer.py). A real capture needs a GPU (tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from common.attention.flashinfer_backend import FlashInferAttention
from common.config import ServerConfig
from common.core.request import Req
from common.engine.cuda_graph import StaticInputs, StepGraphs
from common.engine.engine import Engine
from common.memory.static_reserve import capture_sizes, graph_plan
from common.wire.sampling_params import SamplingParams
from tests.integration.tiny_model import random_prompts, save_tiny_llama
from tests.unit import fake_flashinfer


def test_the_batch_sizes_that_get_a_graph():
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]


def gpu_config(**flags) -> ServerConfig:
    return ServerConfig(**{"device": "cuda", "max_running_requests": 512, **flags})


@pytest.mark.parametrize(
    "config, backend, capturable, says",
    [
        (ServerConfig(), "torch", True, "off: --device cpu"),
        (gpu_config(disable_cuda_graph=True), "flashinfer", True, "off: --disable-cuda-graph"),
        (gpu_config(), "torch", True, "off: --attention-backend torch"),
        (gpu_config(tp_size=2), "flashinfer", True, "off: --tp-size 2"),
        (gpu_config(disaggregation_mode="prefill"), "flashinfer", True, "off: a prefill server decodes nothing"),
        (gpu_config(), "flashinfer", False, "off: the model's forward reads the device back"),
        (gpu_config(speculative_algorithm="NEXTN"), "flashinfer", True, "off: NEXTN keeps the target's hidden"),
        (gpu_config(), "flashinfer", True, "up to 256 (35 sizes"),
        (gpu_config(cuda_graph_max_bs=48), "flashinfer", True, "up to 48 (9 sizes"),
        (gpu_config(disaggregation_mode="decode", max_running_requests=12), "flashinfer", True, "up to 12 (5 sizes"),
    ],
)
def test_graphs_only_where_they_can_replay_and_the_log_says_why(config, backend, capturable, says):
    sizes, line = graph_plan(config, backend, capturable)
    assert says in line and bool(sizes) == ("off" not in line)


def test_a_step_fills_the_static_buffers_and_pads_to_the_padding_page():
    inputs = StaticInputs(8, padding_row=99, page_size=16, device="cpu")
    engine_batch = FakeDecode([5, 17, 33], page_size=16)
    batch = inputs.fill(engine_batch.batch, 4, torch.zeros(100, 64, dtype=torch.int32))
    assert batch.input_ids.tolist() == [7, 8, 9, 0] and batch.positions.tolist() == [4, 16, 32, 0]
    assert batch.out_cache_loc.tolist() == [20, 40, 60, 0] and batch.req_pool_indices.tolist() == [3, 1, 2, 99]
    meta = batch.pages
    assert meta.seq_lens.tolist() == [5, 17, 33, 1] and batch.rope_lens.tolist() == [5, 17, 33, 1]
    assert meta.kv_indptr.tolist() == [0, 1, 3, 6, 7] and meta.kv_indptr_device.tolist() == [0, 1, 3, 6, 7]
    assert meta.last_page_len.tolist() == [5, 1, 1, 1] and meta.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert (meta.max_len, meta.min_len, meta.total_pages) == (33, 1, 7)
    assert batch.seq_lens.tolist() == [5, 17, 33, 1] and batch.logits_indices.tolist() == [0, 1, 2, 3]
    # the same buffers, rewritten for a smaller step: the addresses a graph reads do not move
    again = inputs.fill(FakeDecode([9], page_size=16).batch, 2, batch.req_to_token)
    assert again.input_ids.data_ptr() == batch.input_ids.data_ptr()
    assert again.out_cache_loc.tolist() == [20, 0] and again.pages.kv_indptr.tolist() == [0, 1, 2]
    padding_only = inputs.fill(None, 8, batch.req_to_token)
    assert padding_only.req_pool_indices.tolist() == [99] * 8 and padding_only.pages.total_pages == 8


class FakeDecode:
    """A decode batch's tensors as DecodeTensors builds them, for rows 3, 1, 2..."""

    def __init__(self, lens: list[int], page_size: int):
        from common.core.forward_batch import ForwardBatch, ForwardMode
        from common.core.page_meta import build_page_meta

        n = len(lens)
        pages, (positions,) = build_page_meta(lens, [1] * n, page_size, "cpu", [[x - 1 for x in lens]])
        self.batch = ForwardBatch(
            ForwardMode.DECODE,
            torch.tensor([7, 8, 9][:n]),
            positions.long(),
            torch.tensor([20, 40, 60][:n]),
            torch.tensor([3, 1, 2][:n]),
            torch.tensor(lens),
            torch.ones(n, dtype=torch.int64),
            torch.arange(n),
            None,
            pages,
            pages.seq_lens,
        )


class EagerCapture:
    """The capture stand-in: runs the forward at capture and again at each replay (a graph replays the
    same kernels on the same buffers), and records the pool each capture was given."""

    def __init__(self):
        self.pools = []

    def __call__(self, fn, pool):
        self.pools.append(pool)
        out = fn()
        return type("Replayed", (), {"output": out, "replay": staticmethod(fn)})()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-hd64"), head_dim=64)


def decoding_engine(model_dir, n: int) -> Engine:
    engine = Engine(ServerConfig(model=str(model_dir), max_total_tokens=4096, max_running_requests=16))
    s = engine.scheduler
    for i, p in enumerate(random_prompts(n, 5, 40)):
        s.add_request(Req(f"r{i}", p, SamplingParams(max_new_tokens=50, ignore_eos=True, temperature=0)))
    while len(s.decode.running) < n:
        s.step()
    return engine


@pytest.mark.parametrize("attention", ["torch", "flashinfer"])
def test_a_padded_step_replayed_equals_the_eager_step_and_writes_only_the_padding_page_besides(
    model_dir, monkeypatch, attention
):
    engine = decoding_engine(model_dir, 3)
    runner, pool = engine.runner, engine.kv_pool
    attn = runner.attn
    if attention == "flashinfer":
        fake_flashinfer.install(monkeypatch)
        attn = FlashInferAttention(pool, attn.num_q_heads, attn.head_dim, attn.scaling)
    plan = engine.scheduler.decode_plan()
    batch = plan.decode.forward_batch(plan.out_cache_locs[0], runner.req_to_token)
    before = pool.buffer.clone()
    attn.init_forward(batch)
    want = runner.model(batch, attn)
    eager_pool = pool.buffer.clone()
    pool.buffer.copy_(before)

    capture = EagerCapture()
    attn.prepare_graphs(8, 64)
    graphs = StepGraphs(
        runner.model, attn, runner.req_to_token, engine.memory.req_pool.padding_row, [1, 2, 4, 8], 512, "cpu", capture
    )
    graphs.capture_all(pool="the pool")
    assert list(graphs.graphs) == [8, 4, 2, 1] and capture.pools == ["the pool"] * 4  # largest first, one pool
    pool.buffer.copy_(before)
    got = graphs.run(batch)
    assert graphs.bucket(3) == 4 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # pages 1..: the eager step's writes (values equal to rounding: a GEMM of 4 rows is not one of 3), no other
    assert torch.equal(pool.buffer[1:] != before[1:], eager_pool[1:] != before[1:])
    torch.testing.assert_close(pool.buffer, eager_pool.index_copy(0, torch.tensor([0]), pool.buffer[:1]))
    if attention == "flashinfer":
        wrappers = fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper.calls[1:]  # after the eager one
        assert [w.kwargs["use_cuda_graph"] for w in wrappers] == [True] * 4
        assert [len(w.kwargs["paged_kv_last_page_len_buffer"]) for w in wrappers] == [8, 4, 2, 1]
        assert all(w.kwargs["paged_kv_indices_buffer"] is attn.graph_buffers[1].indices for w in wrappers)
        replayed = attn.graph_wrappers[4, 1].plans[-1]
        assert replayed["indices"][-1] == 0 and replayed["last_page_len"][-1] == 1  # the padding row: page 0


def test_the_runner_replays_graphs_up_to_their_largest_size_and_runs_larger_steps_eagerly(model_dir):
    engine = decoding_engine(model_dir, 3)
    runner = engine.runner
    graphs = StepGraphs(
        runner.model, runner.attn, runner.req_to_token, engine.memory.req_pool.padding_row, [1, 2], 512, "cpu",
        EagerCapture(),
    )  # fmt: skip
    graphs.capture_all()
    replayed = []
    real_run = graphs.run
    graphs.run = lambda batch: replayed.append(batch.batch_size) or real_run(batch)
    runner.graphs = [graphs]
    s = engine.scheduler
    s.step()  # 3 running: larger than the largest graph
    s.abort_now(s.decode.running[-1], "aborted by the test", 499)
    s.step()
    assert replayed == [2]


def test_a_verify_step_fills_the_static_buffers_with_padding_rows_of_k_plus_1_tokens():
    from common.core.forward_batch import ForwardMode
    from common.engine.extend_batch import ExtendRow, build_extend_batch

    req_to_token = torch.arange(100 * 64, dtype=torch.int32).reshape(100, 64)
    rows = [ExtendRow(3, [7, 8, 9], 4, all_logits=True), ExtendRow(1, [5, 6, 2], 0, all_logits=True)]
    verify, _ = build_extend_batch(rows, 2, "cpu", req_to_token, ForwardMode.VERIFY)
    inputs = StaticInputs(4, padding_row=99, page_size=2, device="cpu", tokens=3)
    batch = inputs.fill(verify, 4, req_to_token)
    assert batch.mode == ForwardMode.VERIFY and batch.extend_lens.tolist() == [3] * 4
    assert batch.input_ids.tolist() == [7, 8, 9, 5, 6, 2] + [0] * 6
    assert batch.positions.tolist() == [4, 5, 6, 0, 1, 2] + [0, 1, 2] * 2
    assert batch.rope_lens.tolist() == [5, 6, 7, 1, 2, 3] + [1, 2, 3] * 2
    assert batch.out_cache_loc.tolist() == [196, 197, 198, 64, 65, 66] + [0] * 6
    assert batch.req_pool_indices.tolist() == [3, 1, 99, 99] and batch.seq_lens.tolist() == [7, 3, 3, 3]
    meta = batch.pages  # a padding row: 3 tokens on 2 pages (page 0 twice), 1 token in the last
    assert meta.kv_indptr.tolist() == [0, 4, 6, 8, 10] and meta.last_page_len.tolist() == [1, 1, 1, 1]
    assert meta.qo_indptr.tolist() == [0, 3, 6, 9, 12] and batch.logits_indices.tolist() == list(range(12))
    assert (meta.max_len, meta.min_len, meta.total_pages) == (7, 3, 10)


def ngram_engine(model_dir, graphs: bool, attention: str, monkeypatch) -> tuple[Engine, list[Req], list[int]]:
    """Three requests decoded with NGRAM (k = 2) to the end, drafts padded to k, verify steps replayed from
    graphs of 3 tokens per request when `graphs`; the sizes of the verify steps that replayed one."""
    config = ServerConfig(
        model=str(model_dir), max_total_tokens=4096, max_running_requests=16, speculative_algorithm="NGRAM",
        speculative_num_steps=2,
    )  # fmt: skip
    engine = Engine(config)
    runner, replayed = engine.runner, []
    if attention == "flashinfer":
        fake_flashinfer.install(monkeypatch)
        a = runner.attn
        runner.attn = FlashInferAttention(engine.kv_pool, a.num_q_heads, a.head_dim, a.scaling)
    if graphs:
        runner.attn.prepare_graphs(4, 64, 3)
        verify = StepGraphs(
            runner.model, runner.attn, runner.req_to_token, engine.memory.req_pool.padding_row, [1, 2, 4], 512,
            "cpu", EagerCapture(), tokens=3,
        )  # fmt: skip
        verify.capture_all()
        real_run = verify.run
        verify.run = lambda batch: replayed.append(batch.batch_size) or real_run(batch)
        runner.graphs = [verify]
    engine.scheduler.decode.spec.pad_drafts = True  # as capture_graphs sets it (eager: the same drafts)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, random_prompts(1, 20, 21)[0]]
    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=16 + i, ignore_eos=True, temperature=0), return_logprob=True)
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.scheduler.add_request(r)
    while engine.scheduler.step():
        pass
    return engine, reqs, replayed


@pytest.mark.parametrize("attention", ["torch", "flashinfer"])
def test_verify_steps_replayed_from_graphs_equal_eager_verify_steps(model_dir, monkeypatch, attention):
    graphed, got, replayed = ngram_engine(model_dir, True, attention, monkeypatch)
    prefill_wrappers = fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper.calls  # before the eager run's install
    eager, want, _ = ngram_engine(model_dir, False, attention, monkeypatch)
    assert replayed[:3] == [3, 3, 3]  # every verify of full drafts (padded: the third prompt has no n-gram)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.spec_verify_ct for r in got] == [r.spec_verify_ct for r in want] and sum(r.spec_verify_ct for r in got)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, rtol=1e-4, atol=1e-4)
    assert graphed.memory.check_integrity().free == eager.memory.check_integrity().free
    if attention == "flashinfer":
        wrappers = [w for w in prefill_wrappers if w.kwargs.get("use_cuda_graph")]
        assert [len(w.kwargs["qo_indptr_buf"]) for w in wrappers] == [5, 3, 2]  # captured largest first
        assert all(w.kwargs["paged_kv_indices_buf"] is graphed.runner.attn.graph_buffers[3].indices for w in wrappers)
        assert wrappers[1].plans[-1]["qo_indptr"].tolist() == [0, 3, 6]  # k + 1 query rows per request
        assert {p["uniform_q_len"] for w in wrappers for p in w.plans} == {3}  # FlashInfer's CUDA-graph planner
        assert all("uniform_q_len" not in p for p in graphed.runner.attn.prefill.plans)  # eager: ragged

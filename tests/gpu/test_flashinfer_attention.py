"""FlashInfer's paged prefill and decode over the page-major pool, fed by the host-built page metadata
(page_meta.py), against the torch backend on the same pool: extend batches with cached prefixes and
partial last pages, decode batches of mixed lengths (bf16). And a decode step on CUDA reads back only
the sampled tokens, with either backend."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer")

from common.attention.flashinfer_backend import FlashInferAttention  # noqa: E402
from common.attention.torch_backend import TorchAttention  # noqa: E402
from common.config import ServerConfig  # noqa: E402
from common.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from common.core.page_meta import build_page_meta  # noqa: E402
from common.core.request import Req  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.memory.kv_pool import KVPool  # noqa: E402
from common.wire.sampling_params import SamplingParams  # noqa: E402
from tests.integration.tiny_model import save_tiny_llama  # noqa: E402
from tests.unit.test_decode_hot_path import ScalarReads  # noqa: E402

PAGE, HQ, HKV, DIM = 16, 8, 2, 128
LENGTHS = [(0, 37), (48, 20), (100, 1), (5, 60)]  # (cached prefix, new tokens) per request


def batch_of(mode: ForwardMode, lengths: list[tuple[int, int]], table: torch.Tensor) -> ForwardBatch:
    seq_lens = [p + n for p, n in lengths]
    ext = [n for _, n in lengths]
    rows = torch.arange(len(lengths), device="cuda")
    slots = torch.cat([table[i, p : p + n].long() for i, (p, n) in enumerate(lengths)])
    positions = torch.cat([torch.arange(p, p + n, device="cuda") for p, n in lengths])
    pages, _ = build_page_meta(seq_lens, ext, PAGE, "cuda", [])
    return ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(len(slots), dtype=torch.int64, device="cuda"),
        positions=positions,
        out_cache_loc=slots,
        req_pool_indices=rows,
        seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.tensor(ext),
        logits_indices=torch.arange(len(slots), device="cuda"),
        req_to_token=table,
        pages=pages,
        rope_lens=pages.seq_lens,
    )


def fragmented_table(lengths: list[tuple[int, int]], max_len: int = 256) -> torch.Tensor:
    """Each request's pages scattered over the pool (ids shuffled), slots page by page."""
    per_req = max_len // PAGE
    page_ids = torch.randperm(len(lengths) * per_req, generator=torch.Generator().manual_seed(0)) + 1
    table = torch.zeros(len(lengths), max_len, dtype=torch.int32)
    for i in range(len(lengths)):
        pages = page_ids[i * per_req : (i + 1) * per_req]
        table[i] = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
    return table.cuda()


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_flashinfer_equals_the_torch_backend_on_the_page_major_pool(mode):
    torch.manual_seed(0)
    lengths = LENGTHS if mode == ForwardMode.EXTEND else [(p + n - 1, 1) for p, n in LENGTHS]
    pool = KVPool(1, len(LENGTHS) * 16, PAGE, HKV, DIM, torch.bfloat16, "cuda")
    pool.buffer.normal_()  # the cached prefixes: KV already in the pages
    table = fragmented_table(lengths)
    batch = batch_of(mode, lengths, table)
    tokens = int(batch.out_cache_loc.shape[0])
    q = torch.randn(tokens, HQ, DIM, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(tokens, HKV, DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    outs = []
    for backend in (TorchAttention(pool, HQ, DIM, DIM**-0.5), FlashInferAttention(pool, HQ, DIM, DIM**-0.5)):
        backend.init_forward(batch)
        outs.append(backend.forward(q, k, v, 0, batch).float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)


class DeviceToHost(TorchDispatchMode):
    """Copies from the device to the host, and scalar reads (each waits for the device)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet is torch.ops.aten._local_scalar_dense:
            self.count += 1
        elif packet in (torch.ops.aten._to_copy, torch.ops.aten.copy_) and isinstance(out, torch.Tensor):
            src = args[1] if packet is torch.ops.aten.copy_ else args[0]
            self.count += int(out.device.type == "cpu" and src.device.type == "cuda")
        return out


@pytest.fixture(scope="module")
def head_dim_64_model(tmp_path_factory):
    """The tiny Llama with heads of 64 (FlashInfer serves 64, 128 and 256; its own 16 gets torch)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-hd64"), head_dim=64)


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_a_cuda_decode_step_of_16_reads_back_only_the_sampled_tokens(head_dim_64_model, backend):
    config = ServerConfig(
        model=str(head_dim_64_model), device="cuda", dtype="bfloat16", attention_backend=backend,
        max_running_requests=16, max_total_tokens=16384,
    )  # fmt: skip
    engine = Engine(config)
    for i in range(16):
        engine.scheduler.add_request(
            Req(f"r{i}", [1 + i] * (20 + i), SamplingParams(max_new_tokens=64, ignore_eos=True))
        )
    while len(engine.scheduler.decode.running) < 16:
        engine.scheduler.step()
    engine.scheduler.step()
    for _ in range(20):
        with ScalarReads() as reads, DeviceToHost() as copies:
            assert engine.scheduler.step()
        assert copies.count <= 1 and reads.reads == ["tolist"], (copies.count, reads.reads)

"""--enable-deterministic-inference on a GPU (the check's `deterministic_tests` step; never run on a GPU yet):
the same prompts, greedy and seeded with logprobs, alone and then in batches of 8 and 32 with other random
requests, replayed from CUDA graphs and eagerly, and with a chunked prefill, give bit-identical tokens and
logprobs; the ops under them (tiled products, RMSNorm, log_softmax) keep a row's bits whatever the batch.
Each part prints one `deterministic: <part>: held|DIFFERS` line (the check's summary collects them); the
prefill-chunk-against-decode-step comparison is reported, not asserted (FlashInfer computes them in different
query tiles: docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer")

from common.config import ServerConfig  # noqa: E402
from common.core.request import Req  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.model.llama import RMSNorm  # noqa: E402
from common.parallel import invariant  # noqa: E402
from common.parallel.layers import linear  # noqa: E402
from common.wire.sampling_params import SamplingParams  # noqa: E402
from tests.integration.tiny_model import VOCAB, random_prompts, save_tiny_llama  # noqa: E402

# every prompt's last 64-token chunk is over 32 tokens (x 2 query heads per KV head: over 64 packed rows, the
# query tile of a whole prompt), so the chunked prefill holds by FlashInfer's contract (docs/gpu.md)
LENGTHS, NEW, CHUNK = (100, 180, 250, 300), 16, 64


def report(part: str, held: bool, detail: str = "") -> bool:
    print(f"deterministic: {part}: {'held' if held else 'DIFFERS'}{' (' + detail + ')' if detail else ''}")
    return held


def targets() -> list[Req]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in LENGTHS]
    params = [dict(temperature=0), dict(temperature=0.8, seed=11)]
    return [
        Req(f"t{i}", p, SamplingParams(max_new_tokens=NEW, ignore_eos=True, **params[i % 2]), return_logprob=True)
        for i, p in enumerate(prompts)
    ]


def answers(engine: Engine, batch: int | None) -> list[tuple]:
    """The targets' (tokens, logprobs): each alone (batch None), or all with random others up to `batch`."""
    groups = [[r] for r in targets()] if batch is None else [targets()]
    out = []
    for group in groups:
        others = [
            Req(f"o{i}", p, SamplingParams(max_new_tokens=8 + i % 9, temperature=0.7, ignore_eos=True))
            for i, p in enumerate(random_prompts(max(0, (batch or 0) - len(group)), 5, 200, seed=batch or 0))
        ]
        for r in [*group, *others]:
            engine.scheduler.add_request(r)
        while engine.scheduler.step():
            pass
        out += [(list(r.output_ids), list(r.output_logprobs)) for r in group]
    return out


def engine_with(tmp, **flags) -> Engine:
    config = ServerConfig(
        model=str(tmp), device="cuda", dtype="bfloat16", enable_deterministic_inference=True,
        disable_radix_cache=True, max_running_requests=40, cuda_graph_max_bs=32, max_total_tokens=32768, **flags,
    )  # fmt: skip
    engine = Engine(config)
    engine.warm_up()
    return engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-det"), head_dim=64)


@pytest.fixture(scope="module")
def alone(model_dir):
    engine = engine_with(model_dir)
    assert engine.runner.graphs, "the decode graphs were captured"
    return engine, answers(engine, None)


@pytest.mark.parametrize("batch", [8, 32])
def test_the_same_prompts_in_batches_of_other_requests_give_the_same_bits(alone, batch):
    engine, want = alone
    assert report(f"batch {batch} == alone (graphs)", answers(engine, batch) == want)


def test_eager_steps_give_what_graph_replays_give(alone, model_dir):
    eager = engine_with(model_dir, disable_cuda_graph=True)
    assert report("eager batch 8 == graphs alone", answers(eager, 8) == alone[1])


def test_a_chunked_prefill_gives_what_one_chunk_gives(alone, model_dir):
    chunked = engine_with(model_dir, chunked_prefill_size=CHUNK)
    assert report(f"chunked prefill ({CHUNK}) == one chunk", answers(chunked, 8) == alone[1])


def test_a_token_in_a_prefill_chunk_against_the_same_token_in_a_decode_step(alone):
    """Reported only: the prompt plus its first k tokens prefilled gives token k + 1's logprob in a prefill
    query tile; the decode step gave it in a decode tile."""
    engine, want = alone
    req, k = targets()[0], NEW // 2
    tokens, logprobs = want[0]
    again = Req("p", req.prompt_ids + tokens[:k], SamplingParams(max_new_tokens=1, temperature=0))
    again.return_logprob = True
    engine.scheduler.add_request(again)
    while engine.scheduler.step():
        pass
    same = again.output_ids == tokens[k : k + 1] and again.output_logprobs[0] == logprobs[k]
    report(
        "prefill chunk == decode step (FlashInfer: not promised)", same, f"{again.output_logprobs[0]} vs {logprobs[k]}"
    )


def rows_held(op, x: torch.Tensor) -> int:
    """How many of the positions checked give a row the bits it has computed alone."""
    m = len(x)
    return sum(torch.equal(op(x)[i], op(x[i : i + 1])[0]) for i in sorted({0, m // 2, m - 1}))


def test_the_ops_keep_a_rows_bits_whatever_the_batch():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1536, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    norm = RMSNorm(576, 1e-5).cuda().to(torch.bfloat16)
    ops = {
        "tiled linear": lambda x: linear(x, w),
        "tiled RMSNorm": norm,
        "log_softmax over the vocabulary": lambda x: torch.log_softmax(x.float() @ w[:, :576].T.float(), -1),
    }
    invariant.enable(True)
    try:
        held = {name: [] for name in ops}
        for m in (2, 7, 33, 64, 65, 200, 513):
            x = torch.randn(m, 576, device="cuda", dtype=torch.bfloat16, generator=g)
            for name, op in ops.items():
                held[name].append(rows_held(op, x) == len({0, m // 2, m - 1}))
    finally:
        invariant.enable(False)
    plain = sum(rows_held(lambda x: F.linear(x, w), torch.randn(m, 576, device="cuda", dtype=torch.bfloat16,
                generator=g)) for m in (7, 200, 513))  # fmt: skip
    report("untiled F.linear rows (for comparison)", plain == 9, f"{plain}/9 rows kept their bits")
    assert all([report(name, all(h)) for name, h in held.items()])

"""The multi-turn workload (`--dataset-name multi-turn`): conversations of `--mt-num-turns` turns, where
turn k's prompt is turn k-1's prompt, its answer and `--mt-turn-input-len` new tokens, as chat and agent
traffic grows. Each conversation starts at its arrival time (Poisson at the request rate) and sends its
next turn `--mt-think-time-s` after the previous answer ended; `--max-concurrency` caps requests in flight.
The answer is the server's own (its `output_ids` on /generate, else its text tokenized), so a server's
prefix cache can hold the whole history."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from tandem.bench.client import RequestOutput, timed_request
from tandem.bench.endpoint import Endpoint
from tandem.bench.stats import distribution
from tandem.bench.workload import Workload


@dataclass(frozen=True)
class Conversation:
    """What the client says: its first prompt and the new tokens of each later turn."""

    first: list[int]
    additions: list[list[int]]  # turns 2..K
    output_len: int

    @property
    def turns(self) -> int:
        return 1 + len(self.additions)


def build_conversations(ns: argparse.Namespace, w: Workload) -> list[Conversation]:
    """--num-prompts conversations: first prompts of --random-input-len tokens (times --random-range-ratio),
    answers of --random-output-len, --mt-turn-input-len new tokens per later turn."""
    firsts = w.lengths(ns.num_prompts, ns.random_input_len, ns.random_range_ratio)
    return [
        Conversation(
            w.random_ids(n),
            [w.random_ids(ns.mt_turn_input_len) for _ in range(ns.mt_num_turns - 1)],
            ns.random_output_len,
        )
        for n in firsts
    ]


def answer_ids(w: Workload, out: RequestOutput) -> list[int]:
    """The answer's token ids as the server generated them, or its text tokenized where it sent no ids."""
    if out.output_ids is not None:
        return out.output_ids
    return w.tokenizer.encode(out.text, add_special_tokens=False).ids


async def converse(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    w: Workload,
    conv: Conversation,
    think_time_s: float,
    limit,
    bar: tqdm,
) -> list[RequestOutput]:
    """Every turn of `conv` in order; a failed turn ends the conversation, its later turns failed too."""
    outputs: list[RequestOutput] = []
    ids = conv.first
    for turn in range(1, conv.turns + 1):
        if turn > 1:
            await asyncio.sleep(think_time_s)
            ids = ids + answer_ids(w, outputs[-1]) + conv.additions[turn - 2]
        async with limit:
            out = await timed_request(session, endpoint, w.request(ids, conv.output_len))
        out.turn = turn
        outputs.append(out)
        bar.update(1)
        if not out.success:
            skipped = [RequestOutput(error=f"turn {out.turn} failed", turn=t) for t in range(turn + 1, conv.turns + 1)]
            bar.update(len(skipped))
            return outputs + skipped
    return outputs


async def run_conversations(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    w: Workload,
    conversations: list[Conversation],
    arrivals: list[float],
    think_time_s: float,
    max_concurrency: int | None,
    bar: tqdm,
) -> tuple[list[RequestOutput], float]:
    """Conversation i starts at arrivals[i] seconds; return every turn's output (conversation by
    conversation) and the run's duration."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(conv: Conversation, at: float) -> list[RequestOutput]:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        return await converse(session, endpoint, w, conv, think_time_s, limit, bar)

    per_conv = await asyncio.gather(*(one(c, t) for c, t in zip(conversations, arrivals)))
    return [o for outs in per_conv for o in outs], time.perf_counter() - start


def per_turn(outputs: list[RequestOutput]) -> list[dict]:
    """For each turn: requests completed and failed, prompt and cached tokens (the prefill's, or a
    monolithic server's; and a PD decode's own), TTFT mean and percentiles."""
    turns = sorted({o.turn for o in outputs if o.turn is not None})
    rows = []
    for t in turns:
        mine = [o for o in outputs if o.turn == t]
        ok = [o for o in mine if o.success]
        cached = [o.cached_tokens for o in ok if o.cached_tokens is not None]
        decode_cached = [o.decode_cached_tokens for o in ok if o.decode_cached_tokens is not None]
        rows.append(
            {
                "turn": t,
                "completed": len(ok),
                "failed": len(mine) - len(ok),
                "input_tokens": sum(o.prompt_len for o in ok),
                "cached_tokens": sum(cached) if cached else None,
                "decode_cached_tokens": sum(decode_cached) if decode_cached else None,
            }
            | distribution("ttft", [o.ttft for o in ok])
        )
    return rows

"""The router's HTTP/1.1 client against scripted servers on 127.0.0.1: every way of framing an answer, answers
cut into pieces at every byte, connection reuse, a stale pooled connection, and each failure it reports."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from router.http1 import ConnectFailed, ConnectionLost, Pool, Pools

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return await reader.readexactly(length)


def run(script: Script, client: Callable[[Pool, list[int]], Awaitable[None]]) -> list[int]:
    """Serve `script` (given each connection's number) and run `client` against it; the connections made."""
    connections: list[int] = []

    async def main() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(len(connections))
            try:
                await script(reader, writer, connections[-1])
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        pool = Pool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            await asyncio.wait_for(client(pool, connections), 10)
        finally:
            pool.close()
            server.close()

    asyncio.run(main())
    return connections


async def post(pool: Pool, body: bytes = b'{"x": 1}', timeout: float = 5.0):
    return await pool.post("/generate", body, timeout).send()


def test_content_length_answers_in_pieces_reuse_one_connection():
    answer = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\nX-A: b\r\n\r\n{"ok": 123}'

    async def script(reader, writer, _):
        while True:
            assert await read_request(reader) == b'{"x": 1}'
            for i in range(len(answer)):  # one byte per write
                writer.write(answer[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0)

    async def client(pool, _):
        for _ in range(3):
            resp = await post(pool)
            assert (resp.status, resp.header("X-A"), resp.header("nope"), await resp.read()) == (
                200,
                "b",
                None,
                b'{"ok": 123}',
            )
            resp.close()

    assert run(script, client) == [0]


def test_chunked_answers_with_extensions_and_trailers_arrive_chunk_by_chunk():
    async def script(reader, writer, _):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event in (b"data: 1\n\n", b"data: 22\n\n"):
            writer.write(b"%x;ext=1\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\nX-Trailer: t\r\n\r\n")
        await read_request(reader)  # the same connection carries the next request
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")

    async def client(pool, _):
        resp = await post(pool)
        assert [await resp.chunk(), await resp.chunk(), await resp.chunk()] == [b"data: 1\n\n", b"data: 22\n\n", b""]
        resp = await post(pool)
        assert resp.status == 204 and await resp.read() == b""

    assert run(script, client) == [0]


def test_a_body_until_close_after_an_interim_answer_is_read_whole_and_not_reused():
    async def script(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200 OK\r\n\r\nall of ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"it")

    async def client(pool, _):
        for _ in range(2):
            resp = await post(pool)
            assert resp.status == 200 and await resp.read() == b"all of it"

    assert run(script, client) == [0, 1]


def test_a_pooled_connection_the_worker_closed_unanswered_is_replaced_once():
    async def script(reader, writer, n):
        await read_request(reader)
        if n == 0:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await read_request(reader)  # the second request: closed without an answer, like an idle timeout
            writer.transport.abort()
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh")

    async def client(pool, _):
        assert await (await post(pool)).read() == b"ok"
        assert await (await post(pool)).read() == b"fresh"

    assert run(script, client) == [0, 1]


def test_a_fresh_connection_closed_unanswered_is_an_error():
    async def script(reader, writer, n):
        await read_request(reader)
        writer.transport.abort()

    async def client(pool, _):
        with pytest.raises(ConnectionLost):
            await post(pool)

    assert run(script, client) == [0]


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
    ],
)
def test_malformed_or_cut_answers_are_connection_lost(answer):
    async def script(reader, writer, _):
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(0.05)

    async def client(pool, _):
        with pytest.raises(ConnectionLost):
            resp = await post(pool)
            await resp.read()

    run(script, client)


def test_refused_connection_and_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connecting is refused

    async def refused() -> None:
        with pytest.raises(ConnectFailed):
            await Pool(f"http://127.0.0.1:{port}").post("/generate", b"{}", 5).send()

    asyncio.run(refused())

    async def silent(reader, writer, _):
        await read_request(reader)
        await asyncio.sleep(5)

    async def client(pool, _):
        with pytest.raises(asyncio.TimeoutError):
            await post(pool, timeout=0.2)

    run(silent, client)


def test_fail_from_outside_ends_the_wait_and_closes_the_connection():
    async def script(reader, writer, _):
        await read_request(reader)
        assert await reader.read() == b""  # the client closed the connection
        script.saw_close = True

    async def client(pool, _):
        resp = pool.post("/generate", b"{}", 5)
        asyncio.get_running_loop().call_later(0.1, resp.fail, RuntimeError("the other half failed"))
        with pytest.raises(RuntimeError, match="the other half failed"):
            await resp.send()
        await asyncio.sleep(0.1)

    script.saw_close = False
    run(script, client)
    assert script.saw_close


def test_an_answer_collected_for_on_done_larger_than_the_read_buffer_completes():
    """The prefill's half is collected whole through on_done (nobody reads chunks to resume a paused
    connection): a 3 MiB answer, several times the high-water mark, arrives complete."""
    big = b"x" * (3 << 20)

    async def script(reader, writer, _):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big))
        for i in range(0, len(big), 64 << 10):
            writer.write(big[i : i + (64 << 10)])
            await writer.drain()

    async def client(pool, _):
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        resp = pool.post("/generate", b"{}", 5.0, on_done=lambda r: done.set_result((r.status, r.error, r.body())))
        resp.start()
        status, error, body = await done
        assert (status, error, len(body), body == big) == (200, None, len(big), True)

    run(script, client)


def test_pools_send_the_workers_key_and_an_endless_head_is_connection_lost():
    async def script(reader, writer, n):
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"\r\nAuthorization: Bearer wk-1\r\n" in head
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" if n == 0 else b"HTTP/1.1 200 OK\r\n")
        while n:  # headers that never end
            writer.write(b"X-Pad: " + b"y" * 1000 + b"\r\n")
            await writer.drain()

    async def client(pool, _):
        pools, url = Pools("wk-1"), f"http://{pool.host}:{pool.port}"
        try:
            assert await (await pools.get(url).post("/generate", b"{}", 5).send()).read() == b"ok"
            with pytest.raises(ConnectionLost, match="no complete head"):
                await pools.get(url + "/").post("/generate", b"{}", 5).send()
        finally:
            pools.close()

    assert run(script, client) == [0, 1]

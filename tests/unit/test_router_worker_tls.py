"""The router reaching https workers it discovered (no cluster: an in-process HTTPS server on 127.0.0.1 whose
certificate names only a Service's name, as one certificate for every replica of a role would). With
--ssl-ca-certs, discovery makes https worker URLs from the pods' addresses and verifies each worker against
the discovery name, in health checks and on the request path; a worker given by address is verified against
that address, which the certificate does not name."""

from __future__ import annotations

import asyncio
import ssl

import aiohttp
from aiohttp import web

from router.config import RouterConfig
from router.discovery import Discovery, Target, targets_from_config
from router.http1 import ConnectFailed, Pools
from router.tls import client_context
from router.workers import WorkerRegistry
from tests.integration.tls_certs import make_certs

SERVICE = "tandem-prefill.llm.svc"


def test_ssl_ca_certs_makes_discovered_workers_https_and_named_by_their_service(tmp_path):
    certs = make_certs(tmp_path, names=(SERVICE,))
    config = RouterConfig(
        prefill_discovery=f"{SERVICE}:30000", decode_discovery="d.svc:30001", ssl_ca_certs=str(certs.ca)
    )
    assert targets_from_config(config) == [
        Target("prefill", SERVICE, 30000, 8998, None, tls=True),
        Target("decode", "d.svc", 30001, tls=True),
    ]
    plain = targets_from_config(RouterConfig(decode_discovery="d.svc:30001"))
    assert plain == [Target("decode", "d.svc", 30001)] and plain[0].url("10.0.0.1") == "http://10.0.0.1:30001"


async def _https_server(certs) -> tuple[web.AppRunner, int]:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(text=f"{request.method} {request.path}")

    app = web.Application()
    app.router.add_get("/health", answer)
    app.router.add_post("/generate", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.cert, certs.key)
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def test_a_discovered_https_worker_is_verified_against_its_discovery_name(tmp_path):
    certs = make_certs(tmp_path, names=(SERVICE,))  # not 127.0.0.1: a pod's address is in no certificate

    async def scenario() -> None:
        runner, port = await _https_server(certs)
        config = RouterConfig(prefill_discovery=f"{SERVICE}:{port}", ssl_ca_certs=str(certs.ca))
        tls = client_context(config)
        registry = WorkerRegistry(failure_threshold=1)

        async def dns(host: str, _port: int) -> list[str]:
            return ["127.0.0.1"] if host == SERVICE else []

        added, _ = await Discovery(registry, targets_from_config(config), dns).refresh()
        url = f"https://127.0.0.1:{port}"
        assert added == {url} and registry.workers[url].tls_name == SERVICE
        by_address = registry.add(f"https://localhost:{port}", "decode")  # verified against "localhost"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as session:
            await registry.check_all(session)
        assert registry.workers[url].healthy and registry.workers[url].failures == 0
        assert not by_address.healthy and by_address.failures == 1
        pools = Pools("wk", tls)
        answer = await pools.get(url, SERVICE).post("/generate", b"{}", 5).send()
        assert await answer.read() == b"POST /generate"
        try:
            await pools.get(f"https://localhost:{port}").post("/generate", b"{}", 5).send()
            raise AssertionError("a certificate that does not name the host was accepted")
        except ConnectFailed as e:
            assert "CERTIFICATE_VERIFY_FAILED" in str(e) and "localhost" in str(e)
        pools.close()
        await runner.cleanup()

    asyncio.run(scenario())

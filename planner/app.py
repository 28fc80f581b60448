"""`tandem planner`: every --interval-s, observe (planner/observe.py), decide (planner/decide.py), act
(planner/act.py), and export it all on /metrics (its own port, --port):

    tandem_planner_workers{worker_role}            servers of each role it saw
    tandem_planner_desired_workers{worker_role}    servers of each role it wants
    tandem_planner_pressure{worker_role}           each role's pressure (1: at its limit)
    tandem_planner_ttft_p90_seconds, tandem_planner_itl_p90_seconds    the interval's observed latencies
    tandem_planner_ttft_predicted_seconds          a prompt arriving now: its time at the prefills (planner/decide.py)
    tandem_planner_decisions_total{action,reason}  every interval's decision (action none included)
    tandem_planner_actions_total{outcome}          changes made: done, failed
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from common.edge.prometheus import render
from planner.act import Flip, Scale
from planner.config import PlannerConfig
from planner.decide import Decider, Decision
from planner.observe import Observation, Observer

log = logging.getLogger("tandem.planner")


class PlannerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.workers = Gauge("tandem_planner_workers", "servers of each role seen", ["worker_role"], registry=r)
        self.desired = Gauge(
            "tandem_planner_desired_workers", "servers of each role wanted", ["worker_role"], registry=r
        )
        self.pressure = Gauge(
            "tandem_planner_pressure", "each role's pressure (1: at its limit)", ["worker_role"], registry=r
        )
        self.ttft = Gauge("tandem_planner_ttft_p90_seconds", "the last interval's p90 time to first token", registry=r)
        self.itl = Gauge("tandem_planner_itl_p90_seconds", "the last interval's p90 inter-token latency", registry=r)
        self.ttft_predicted = Gauge(
            "tandem_planner_ttft_predicted_seconds",
            "a prompt arriving now: the seconds to compute the prompts queued ahead of it and its own",
            registry=r,
        )
        self.decisions = Counter(
            "tandem_planner_decisions",
            "decisions, one per interval, by action and reason",
            ["action", "reason"],
            registry=r,
        )
        self.actions = Counter(
            "tandem_planner_actions", "changes made, by outcome (done, failed)", ["outcome"], registry=r
        )

    def record(self, obs: Observation, decision: Decision) -> None:
        for role in ("prefill", "decode"):
            self.workers.labels(role).set(getattr(obs, role))
            self.desired.labels(role).set(getattr(decision, role))
            self.pressure.labels(role).set(decision.pressure.get(role, 0.0))
        self.ttft.set(obs.ttft_p90_s or 0.0)
        self.itl.set(obs.itl_p90_s or 0.0)
        self.ttft_predicted.set(obs.ttft_predicted_s or 0.0)
        self.decisions.labels(decision.action, decision.reason).inc()


class Planner:
    def __init__(self, config: PlannerConfig):
        self.config = config
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
        self.observer = Observer(config.router, self.headers)
        self.decider = Decider(config)
        self.metrics = PlannerMetrics()
        self.scale = Scale(config) if config.actuator == "scale" else None
        self.actuator = self.scale or (Flip(config, self.headers) if config.actuator == "flip" else None)

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            start = time.monotonic()
            try:
                await self.step(session)
            except Exception as e:  # the router may be restarting: the next interval tries again
                log.warning("planning interval failed: %r", e)
            await asyncio.sleep(max(0.0, self.config.interval_s - (time.monotonic() - start)))

    async def step(self, session: aiohttp.ClientSession) -> Decision:
        obs = await self.observer.observe(session, time.monotonic())
        if self.scale is not None:
            obs.prefill, obs.decode = await self.scale.replicas(session)
        decision = self.decider.decide(obs, time.monotonic())
        self.metrics.record(obs, decision)
        p = decision.pressure
        log.log(
            logging.INFO if decision.action != "none" else logging.DEBUG,
            "P:D %d:%d, pressure prefill %.2f decode %.2f (queue %.2f s, KV %.0f%%, waiting for pages %d, TTFT p90 %s "
            "predicted %s, ITL p90 %s): %s (%s)",
            obs.prefill, obs.decode, p["prefill"], p["decode"], obs.queue_s, 100 * obs.kv_use, obs.waiting_for_pages,
            _ms(obs.ttft_p90_s), _ms(obs.ttft_predicted_s), _ms(obs.itl_p90_s), decision.action, decision.reason,
        )  # fmt: skip
        if decision.action != "none" and self.actuator is not None:
            outcome = await self.actuator.apply(session, decision, obs)
            failed = "fail" in outcome or outcome.startswith("no ")
            self.metrics.actions.labels("failed" if failed else "done").inc()
            log.log(logging.WARNING if failed else logging.INFO, "planner: %s", outcome)
        return decision


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


async def serve_planner(config: PlannerConfig) -> None:
    planner = Planner(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = None
    if config.port:
        app = web.Application()
        app.router.add_get("/health", lambda _: web.Response())
        app.router.add_get(
            "/metrics",
            lambda _: web.Response(body=render(planner.metrics.registry, "planner"), content_type="text/plain"),
        )
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, config.host, config.port).start()
    log.info("planner: %s mode, %s actuator, every %g s, watching %s", config.mode, config.actuator, config.interval_s,
             config.router)  # fmt: skip
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        task = asyncio.create_task(planner.run(session))
        await stop.wait()
        task.cancel()
    if runner is not None:
        await runner.cleanup()

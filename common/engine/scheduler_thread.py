"""The thread that runs Scheduler.step() in a loop, and its watchdog.

Between steps with nothing to do the thread sleeps until Scheduler.wake() (a new request, an abort, a
peer's control message, a transfer's end, a lookup done), or at the latest BUSY_POLL_S later while
requests wait on something (only their deadlines need that), IDLE_POLL_S when none does.

The loop never dies of a bug: an exception that escapes a step (the scheduler already isolates errors
per request) is logged, the requests the scheduler tracks are failed with its cause, and the loop goes
on. `health_problem()` says when the scheduler cannot serve: its thread is gone, or one step has been
running for longer than --watchdog-timeout-s (a stuck forward); /health then answers 503 with it, so a
router takes the worker out of rotation.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from common.engine.scheduler import Scheduler

log = logging.getLogger(__name__)
BUSY_POLL_S = 0.02
IDLE_POLL_S = 0.5
T = TypeVar("T")


def on_scheduler_thread(scheduler: Scheduler, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
    """`fn()` run on the scheduler thread between two steps; its result (or exception) as a Future."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def call() -> None:
        try:
            fut.set_result(fn())
        except Exception as e:
            fut.set_exception(e)

    scheduler.run_on_scheduler(call)
    return fut


class SchedulerThread:
    def __init__(self, scheduler: Scheduler, watchdog_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.scheduler = scheduler
        self.watchdog_timeout_s = watchdog_timeout_s
        self.clock = clock
        self.step_started: float | None = None  # set while a step runs
        self.died: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self.scheduler.wake()

    def stop(self) -> None:
        self._stop = True
        self.scheduler.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # only something outside Exception gets here; say so on /health
            self.died = e
            log.critical("the scheduler thread died: %r", e, exc_info=e)

    def _loop(self) -> None:
        sched = self.scheduler
        while not self._stop:
            sched.woken.clear()  # before the step: a wake() during it makes the wait below return at once
            self.step_started = self.clock()
            try:
                worked = sched.step()
            except Exception as e:  # a bug outside any one request: end what the scheduler holds
                log.exception("scheduler step failed")
                self._fail_tracked(f"internal error in the scheduler: {e!r}")
                worked = False
            self.step_started = None
            if not worked:
                sched.woken.wait(BUSY_POLL_S if sched.has_work() else IDLE_POLL_S)

    def _fail_tracked(self, message: str) -> None:
        for req in self.scheduler.tracked_requests():
            try:
                self.scheduler.abort_now(req, message, 500)
            except Exception:
                log.exception("request %s could not be failed", req.rid)

    def health_problem(self) -> str | None:
        if self.died is not None or (self._thread.ident is not None and not self._thread.is_alive() and not self._stop):
            return f"the scheduler thread died: {self.died!r}"
        started = self.step_started
        if started is not None and self.clock() - started > self.watchdog_timeout_s:
            return (
                f"a scheduler step has been running for {self.clock() - started:.0f} s "
                f"(over --watchdog-timeout-s {self.watchdog_timeout_s:g}): a stuck forward or transfer"
            )
        return None

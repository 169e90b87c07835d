"""Assemble a broker from a config: managers, store, scheduler, HTTP app; and run it on uvloop."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvloop
from aiohttp import web
from sqlalchemy.engine import make_url

from managers.basic.manager import BasicManager
from managers.counted import CountedUnitsManager
from managers.cpu.manager import CpuManager
from managers.gpu.config import wanted
from managers.gpu.manager import GpuManager
from managers.gpu.slo_view import GpuSloView
from tangram.broker import Broker
from tangram.config import Config
from tangram.core.fencing import Fencing, leading
from tangram.core.seam import ResourceManager
from tangram.frozen_survivors import FrozenSurvivors
from tangram.leadership import Leadership, fence
from tangram.server.api import build_app
from tangram.server.auth import AUTH
from tangram.server.bind_auth import check_bind, token_for_bind
from tangram.server.request_guard import http_settings
from tangram.server.standby import stand_by
from tangram.slo.admission import SloAdmission
from tangram.store.fence import Fence
from tangram.store.store import Store
from tangram.tracing import ActionTracer, tracer_from_config

log = logging.getLogger("tangram")

#: allocations between collections of the youngest generation (Python's default is 700). Every action allocates a
#: few dozen containers, so at the default the older generations, which hold every record kept in memory, are
#: scanned over and over while a burst goes by (docs/PERFORMANCE.md); a young collection scans only what is new.
GC_YOUNG_OBJECTS = 7_000

#: the exit status of a leader that stopped because it may no longer hold its lock (a supervisor restarts it)
LOST_LEADERSHIP_EXIT = 3


def build_managers(config: Config) -> list[ResourceManager]:
    managers: list[ResourceManager] = []
    if config.basic:
        managers.append(BasicManager(list(config.basic)))
    if config.pools:
        managers.append(CountedUnitsManager(config.pools))
    if config.cpu.enabled:
        managers.append(CpuManager(config.cpu))
    if wanted(config.gpu):
        managers.append(GpuManager(config.gpu))
    return managers


@asynccontextmanager
async def running_broker(config: Config, managers: list[ResourceManager] | None = None,
                         fenced_by: Fence | None = None, tracer: ActionTracer | None = None
                         ) -> AsyncIterator[tuple[Broker, web.Application]]:
    """A started broker and its app; everything is closed and flushed on exit. ``managers``: others than the
    config's (a benchmark's node agents with modelled sandboxes); ``fenced_by``: the leader's fence on its store;
    ``tracer``: another than ``[tracing]``'s (a test's in-memory exporter)."""
    own_tracer = tracer_from_config(config.tracing) if tracer is None else None
    tracer = tracer or own_tracer
    store = await Store.open(config.store.url, fence=fenced_by)
    try:
        scheduler = config.scheduler
        managers = build_managers(config) if managers is None else managers
        gpu = next((manager for manager in managers if isinstance(manager, GpuManager)), None)
        slo = SloAdmission(None if gpu is None else GpuSloView(gpu), store, config.access.slo_plans)
        broker = Broker(managers, store, scheduler, plugins=[slo.plugins()], max_queue=scheduler.max_queue,
                        retain_s=scheduler.retain_s, tracer=tracer)
        try:
            await broker.start()
            yield broker, build_app(broker, config.server, config.limits, slo, config.access)
        finally:
            await broker.close()
    finally:  # whatever a manager's close raised, pending records still reach the database, and spans their sink
        await store.close()
        if own_tracer is not None:
            await asyncio.to_thread(own_tracer.close)


async def serve(config: Config, insecure: bool = False) -> None:
    """Serve until SIGTERM or SIGINT. With ``[store] leader_election``, first stand by until this broker leads.
    ``insecure``: listen on a non-loopback address even with ``[auth] required = false``
    (``tangram.server.bind_auth``)."""
    check_bind(config.server.host, config.access.auth.required, insecure=insecure)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    leadership = None
    if config.store.leader_election:
        leadership = await Leadership.open(config.store.url, config.server.url())
        if not await stand_by(config.server, leadership, stop):
            await leadership.close()
            return
    try:
        await lead(config, stop, leadership)
    finally:
        if leadership is not None:
            await leadership.close()


async def lead(config: Config, stop: asyncio.Event, leadership: Leadership | None) -> None:
    """Run the broker until ``stop``; a leader that may have lost its lock exits at once instead (another broker
    may lead the store by then: nothing more of this one's may reach it, nor its agents, sandboxes and upstreams:
    ``tangram/core/fencing.py``)."""
    fencing = leadership.fencing if leadership is not None else Fencing()
    fenced = fence(leadership.epoch, fencing) if leadership is not None and leadership.epoch is not None else None
    async with leading(fencing), running_broker(config, fenced_by=fenced) as (broker, app):
        token = await token_for_bind(app[AUTH], config.server.host)
        runner = web.AppRunner(app, access_log=None, **http_settings(config.server))
        await runner.setup()
        site = web.TCPSite(runner, config.server.host, config.server.port)
        await site.start()
        # everything built so far (modules, classes, request schemas, the app) lives as long as the process:
        # keep it out of the full collections that the actions' records trigger as they accumulate
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_YOUNG_OBJECTS)
        if token is not None:  # on stderr, not in the log, which may be kept
            print(f"tangram: {config.server.host!r} is not a loopback address and no API token existed, so auth is "
                  f"on now with this admin token (shown only now; the store keeps its SHA-256):\n{token}\n"
                  f"Make tokens for tasks with it (POST /v1/admin/tokens) or `tangram token create TASK`.",
                  file=sys.stderr, flush=True)
        log.info("ARL-Tangram broker listening on http://%s:%d (store %s)", config.server.host,
                 config.server.port, make_url(config.store.url).render_as_string(hide_password=True))
        lost = asyncio.create_task(leadership.lost()) if leadership is not None else None
        deposed = asyncio.create_task(fencing.deposed.wait())  # by the store's fence, the lock's check or an agent
        stopping = asyncio.create_task(stop.wait())
        survivors = FrozenSurvivors(asyncio.get_running_loop())
        survivors.start()
        try:
            await asyncio.wait({stopping, deposed} | ({lost} if lost else set()),
                               return_when=asyncio.FIRST_COMPLETED)
            if (lost is not None and lost.done()) or deposed.done():
                log.critical("stopping at once: %s", fencing.deposed_by)
                logging.shutdown()
                os._exit(LOST_LEADERSHIP_EXIT)
            # drain while still serving, so clients waiting on running actions get their results; then stop
            # serving, and the broker and store close (queued actions stay in the store for the next start)
            log.info("stopping: draining for at most %.0f s", config.server.drain_s)
            await broker.drain(config.server.drain_s)
        finally:
            survivors.stop()
            for task in (stopping, lost, deposed):
                if task is not None:
                    task.cancel()
            await runner.cleanup()


def run(config: Config, insecure: bool = False) -> None:
    uvloop.run(serve(config, insecure))

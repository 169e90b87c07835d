"""A broker standing by (issue 39): its ``/metrics`` says ``tangram_leader 0`` and its ``/readyz`` names the
leader, while another leads the same PostgreSQL store; when the leader lets go it leads. In-process, through
``stand_by`` itself: subprocess brokers made this flaky (a first broker's process once exited while it waited to
lead), and what is under test is the standby's answers, not a process's start."""

from __future__ import annotations

import asyncio

import aiohttp

from tangram.config import ServerConfig
from tangram.leadership import Leadership
from tangram.server.standby import stand_by
from tests.harness import until
from tests.scrape import Scrape
from tests.test_recovery import free_port

LEADER_URL = "http://leader.example:8300"


async def answers(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url + "/healthz") as response:
            return response.status == 200
    except aiohttp.ClientConnectionError:
        return False


async def test_the_standby_says_leader_0_names_the_leader_and_leads_once_it_lets_go(postgres_url: str) -> None:
    leader = await Leadership.open(postgres_url, LEADER_URL)
    await leader.acquire()
    server = ServerConfig(port=free_port())
    url = f"http://127.0.0.1:{server.port}"
    standby = await Leadership.open(postgres_url, url)
    stop = asyncio.Event()
    standing = asyncio.create_task(stand_by(server, standby, stop))
    try:
        async with aiohttp.ClientSession() as http:
            await until(lambda: answers(http, url), 10)
            async with http.get(url + "/metrics") as response:
                assert response.status == 200
                assert Scrape(await response.text()).value("tangram_leader") == 0
            async with http.get(url + "/readyz") as response:
                assert response.status == 503
                body = await response.json()
            assert body["error"]["code"] == "standby" and body["error"]["leader"] == LEADER_URL, body
            assert not standing.done()
            await leader.close()
            assert await asyncio.wait_for(standing, 30) is True  # it took the lock
            assert standby.epoch is not None and standby.leader_url == url
    finally:
        stop.set()
        if not standing.done():
            standing.cancel()
        await asyncio.gather(standing, return_exceptions=True)
        await leader.close()
        await standby.close()

"""The status page end to end: a real broker over loopback HTTP, real actions, the page in headless Chromium.

Set ``TANGRAM_STATUS_SCREENSHOT=docs/status-page.png`` to save the live-charts test's page as the docs screenshot.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from tangram.config import parse_config
from tangram.server.broker_views import broker_stats, resource_rows
from tangram.server.history import History
from tangram.server.status_page import HISTORY
from tangram.service import running_broker
from tests.harness import Live, broker_from_file, live_broker, live_upstream
from tests.test_gpu_live_placement import run_all, stand_ins
from tests.test_gpu_live_placement import write_config as write_typed_config
from tests.test_slo_admission import HEAVY, QUICK, write_config
from tests.test_slo_admission import broker as slo_broker
from tests.test_slo_admission import call as slo_call
from tests.test_slo_admission import reward as slo_reward

SCREENSHOT_ENV = "TANGRAM_STATUS_SCREENSHOT"
LEASES = {"lease.local": {"concurrency": 8}, "lease.gpu-quota": {"concurrency": 4}}
CONFIG = {"basic": LEASES, "cpu": {"enabled": False}}

# Every chart's series as the values it plots, read from the uPlot instance the page drew it with (the chart is a
# canvas); ``pixel`` is one pixel of the plot area in the y axis' units, ``ymax`` the top of that axis.
READ_CHARTS = """
const charts = {};
for (const id of ["chart-utilization", "chart-queue", "chart-act"]) {
  const holder = document.getElementById(id);
  const plot = holder.chart;
  if (plot === undefined) return null;
  const series = {};
  plot.series.forEach((line, i) => {
    if (i) series[line.label] = plot.data[i].filter((value) => value !== null);
  });
  const empty = holder.querySelector(".empty");
  charts[id] = {series, ymax: plot.scales.y.max, pixel: plot.scales.y.max / (plot.bbox.height / devicePixelRatio),
                shown: plot.series.every((line) => line.show), canvas: holder.querySelector("canvas") !== null,
                empty: empty.hidden ? null : empty.textContent};
}
return charts;
"""

# The header, footer and resources table as a ``header`` object; scripts append what they return.
HEADER = """
const text = (id) => document.getElementById(id).textContent;
const header = {queued: text("total-queued"), running: text("total-running"), leases: text("total-leases"),
        connection: document.getElementById("connection").dataset.state,
        samples: document.getElementById("footer").dataset.samples,
        last_t: document.getElementById("footer").dataset.lastT,
        rows: [...document.querySelectorAll("#resources tbody tr[data-resource]")].map((row) => ({
          resource: row.dataset.resource, pool: row.dataset.pool,
          in_use: Number(row.querySelector(".in-use").textContent),
          capacity: Number(row.querySelector(".capacity").textContent),
          queued: Number(row.querySelector(".queued").textContent)}))};
"""


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "tangram.db")


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    """Debian's headless Chromium driven by its own chromedriver (never one Selenium Manager would download)."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "chromium and chromedriver are missing: run scripts/install-chromium.sh"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1680,1000", "--lang=en-GB"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    try:
        yield chrome
    finally:
        chrome.quit()


@dataclass
class PageBroker:
    live: Live
    history: History
    server: TestServer


@asynccontextmanager
async def broker_with_page(raw: dict[str, Any], db_path: str, interval_s: float) -> AsyncIterator[PageBroker]:
    """Like ``live_broker``, with the app's history sampled every ``interval_s`` and its server reachable, so a
    test can watch fast-moving charts and take the broker off the network while the page is open."""
    raw = {**raw, "store": {"url": f"sqlite+aiosqlite:///{db_path}"}}
    async with running_broker(parse_config(raw)) as (broker, app):
        app[HISTORY] = History(broker, interval_s=interval_s, keep_s=max(600.0, 10 * interval_s))
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as http:
                live = Live(broker, str(server.make_url("")).rstrip("/"), http)
                yield PageBroker(live, app[HISTORY], server)
        finally:
            await server.close()


async def in_page(browser: webdriver.Chrome, script: str) -> Any:
    return await asyncio.to_thread(browser.execute_script, script)


async def until(browser: webdriver.Chrome, script: str, what: str, timeout_s: float = 60.0) -> Any:
    """The first truthy value of ``script`` in the page, polled while the broker keeps serving on this loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await in_page(browser, script)
        if value:
            return value
        assert time.monotonic() < deadline, f"the page never showed {what}"
        await asyncio.sleep(0.1)


async def page_errors(browser: webdriver.Chrome, *, allow_network: bool = False) -> list[dict[str, Any]]:
    """Browser log entries at error level; with ``allow_network``, failed fetches to a stopped broker excepted."""
    entries = await asyncio.to_thread(browser.get_log, "browser")
    return [e for e in entries if e["level"] == "SEVERE" and not (allow_network and e.get("source") == "network")]


async def test_root_redirects_to_the_page_which_loads_only_its_own_files(db):
    async with live_broker(CONFIG, db) as live:
        async with live.http.get(live.url + "/", allow_redirects=False) as response:
            assert (response.status, response.headers["Location"]) == (302, "/ui")
        async with live.http.get(live.url + "/ui") as response:
            assert response.status == 200 and response.content_type == "text/html"
            assert response.headers["Content-Security-Policy"].startswith("default-src 'self'")
            page = await response.text()
        for asset, kind in (("/ui/status.js", "javascript"), ("/ui/status.css", "text/css"),
                            ("/ui/uplot-1.6.32.min.js", "javascript"), ("/ui/uplot-1.6.32.min.css", "text/css")):
            assert f'"{asset}"' in page
            async with live.http.get(live.url + asset) as response:
                assert response.status == 200 and kind in response.content_type
        assert "http://" not in page and "https://" not in page
        code, reply = await live.call("GET", "/ui/missing.js")
        assert (code, reply["error"]["field"]) == (404, "path")
        code, doc = await live.call("GET", "/openapi.json")
        assert {"/", "/ui", "/v1/status/history"} <= set(doc["paths"])


@pytest.mark.parametrize("since", ["yesterday", "nan", "inf", "-1", ""])
async def test_history_rejects_a_bad_since(db, since):
    async with live_broker(CONFIG, db) as live:
        code, reply = await live.call("GET", f"/v1/status/history?since={since}")
        assert code == 400 and reply["error"]["field"] == "since" and reply["error"]["reason"]


async def test_history_endpoint_returns_samples_after_since(db):
    async with broker_with_page(CONFIG, db, interval_s=3600.0) as page:
        times = [page.history.sample().t for _ in range(3)]
        code, everything = await page.live.call("GET", "/v1/status/history")
        assert code == 200 and (everything["interval_s"], everything["keep_s"]) == (3600.0, 36000.0)
        assert [s["t"] for s in everything["samples"]] == times
        _, newer = await page.live.call("GET", f"/v1/status/history?since={times[0]!r}")
        assert [s["t"] for s in newer["samples"]] == times[1:]
        assert set(newer["samples"][0]) == {"t", "utilization", "queued", "queued_total", "running", "leases",
                                            "finished", "act_p50_s", "act_p90_s", "act_p99_s"}


async def test_an_empty_history_shows_waiting_charts_and_the_live_table(db, browser):
    async with broker_with_page(CONFIG, db, interval_s=3600.0) as page:
        await asyncio.to_thread(browser.get, page.live.url + "/")
        header = await until(browser, HEADER + "return header.connection === 'live' && header.rows.length ? "
                                               "header : null;", "a live table")
        assert header["samples"] == "0" and (header["queued"], header["running"], header["leases"]) == ("0", "0", "0")
        assert {(r["resource"], r["capacity"]) for r in header["rows"]} == {("lease.local", 8), ("lease.gpu-quota", 4)}
        charts = await in_page(browser, READ_CHARTS)
        for chart in charts.values():
            assert chart["empty"].startswith("No samples yet") and chart["canvas"]
            assert all(points == [] for points in chart["series"].values())
        assert set(charts["chart-act"]["series"]) == {"p50", "p90", "p99"}
        assert set(charts["chart-queue"]["series"]) == {"total"}
        assert await page_errors(browser) == []


async def hold_leases(live: Live, resource: str, count: int) -> list[str]:
    replies = await asyncio.gather(*(live.call("POST", "/v1/actions?wait=true&wait_timeout_s=10",
                                               json={"task": "page", "kind": "lease", "demand": {resource: 1}})
                                     for _ in range(count)))
    assert all(record["state"] == "succeeded" for _, record in replies)
    return [record["id"] for _, record in replies]


def api_call(resource: str, sleep_s: float) -> dict[str, Any]:
    return {"task": "search", "kind": "api", "demand": {resource: 1},
            "spec": {"method": "POST", "path": "/q", "body": {"sleep_s": sleep_s}}}


async def drive_load(page: PageBroker) -> None:
    """Waves of work so that every chart moves: slow API calls that queue behind their concurrency while quick
    ones keep finishing beside them (spread ACT percentiles), leases taken and returned, and at the end a steady
    state (leases held, actions queued behind them) the test can check."""
    live, pause = page.live, page.history.interval_s * 4
    slow = [api_call("api.search", 0.1 * (1 + i % 4)) for i in range(24)]
    quick = [api_call("api.fast", 0.02)] * 3
    for take, give_back in ((5, 3), (6, 4)):  # lease.local: 5 of 8 held, 2, 8, then 4 (50%) from here on
        _, batch = await live.call("POST", "/v1/actions:batch", json={"actions": slow})
        taken = await hold_leases(live, "lease.local", take)
        pending = {record["id"] for record in batch["actions"]}
        while pending:
            await live.call("POST", "/v1/actions:batch", json={"actions": quick})
            await asyncio.sleep(page.history.interval_s / 2)
            pending = {i for i in pending if not live.broker.actions[i].state.terminal}
        for lease_id in taken[:give_back]:
            await live.call("DELETE", f"/v1/leases/{lease_id}")
        await asyncio.sleep(pause)
    await hold_leases(live, "lease.gpu-quota", 4)
    for _ in range(3):
        code, _ = await live.call("POST", "/v1/actions", json={"task": "page", "kind": "lease",
                                                               "demand": {"lease.gpu-quota": 1}})
        assert code == 201
    await asyncio.sleep(pause)


async def test_live_charts_follow_the_broker_and_survive_its_loss(db, browser):
    async with live_upstream() as upstream:
        basic = {**LEASES, "api.search": {"concurrency": 4, "upstream": {"base_url": upstream.url}},
                 "api.fast": {"concurrency": 8, "upstream": {"base_url": upstream.url}}}
        async with broker_with_page({**CONFIG, "basic": basic}, db, interval_s=0.25) as page:
            live = page.live
            await asyncio.to_thread(browser.get, live.url + "/ui")
            await drive_load(page)
            settled = page.history.samples[-1].t  # nothing changes from here on
            header = await until(browser, HEADER + f"return Number(header.last_t) > {settled!r} ? header : null;",
                                 "the steady state")
            charts = await in_page(browser, READ_CHARTS)
            _, history = await live.call("GET", "/v1/status/history")
            shown = [s for s in history["samples"] if s["t"] <= float(header["last_t"])]
            stats, rows = broker_stats(live.broker), resource_rows(live.broker)

            assert [header["queued"], header["running"], header["leases"]] == \
                [str(stats["queued"]), str(stats["running"]), str(stats["leases"])] == ["3", "0", "8"]
            assert sorted((r["resource"], r["pool"], r["in_use"], r["capacity"], r["queued"]) for r in header["rows"]) \
                == sorted((r["resource"], r["pool"], r["in_use"], r["capacity"], r["queued"]) for r in rows)

            for chart in charts.values():
                assert chart["shown"] and chart["canvas"] and chart["empty"] is None
                assert all(max(points) <= chart["ymax"] for points in chart["series"].values() if points)

            utilization = charts["chart-utilization"]
            assert utilization["ymax"] == 100
            assert set(utilization["series"]) == {"api.search", "api.fast", "lease.local", "lease.gpu-quota"}
            assert int(header["samples"]) == len(shown) > 8
            for resource, points in utilization["series"].items():
                assert len(points) == len(shown)
                expected = [100 * s["utilization"][resource] for s in shown]
                assert max(abs(a - b) for a, b in zip(points, expected)) <= utilization["pixel"]
            assert utilization["series"]["lease.gpu-quota"][-1] == pytest.approx(100, abs=utilization["pixel"])
            assert utilization["series"]["lease.local"][-1] == pytest.approx(50, abs=utilization["pixel"])
            assert max(utilization["series"]["api.search"]) == pytest.approx(100, abs=utilization["pixel"])

            queue = charts["chart-queue"]
            assert queue["series"]["total"][-1] == pytest.approx(3, abs=queue["pixel"])
            peak = max(s["queued"]["api.search"] for s in shown)
            assert peak > 0  # the API waves waited behind a concurrency of 4
            assert max(queue["series"]["api.search"]) == pytest.approx(peak, abs=queue["pixel"])

            act = charts["chart-act"]  # a point per interval in which actions finished, a gap elsewhere
            for name in ("p50", "p90", "p99"):
                expected = [s[f"act_{name}_s"] for s in shown if s[f"act_{name}_s"] is not None]
                assert len(act["series"][name]) == len(expected) >= 2
                assert max(abs(a - b) for a, b in zip(act["series"][name], expected)) <= act["pixel"]
            assert await page_errors(browser) == []

            screenshot = os.environ.get(SCREENSHOT_ENV)
            if screenshot:
                height = await in_page(browser, "return Math.ceil(document.getElementById('footer')"
                                                ".getBoundingClientRect().bottom) + outerHeight - innerHeight;")
                await asyncio.to_thread(browser.set_window_size, 1680, height)
                await asyncio.to_thread(browser.save_screenshot, screenshot)

            await page.server.close()
            state = await until(browser, "const s = document.getElementById('connection').dataset.state;"
                                         "return s === 'disconnected' ? s : null;", "the disconnected state")
            assert state == "disconnected"
            kept, after = await in_page(browser, READ_CHARTS), await in_page(browser, HEADER + "return header;")
            assert int(after["samples"]) >= len(shown)  # the last data stays on screen
            assert all(len(points) == int(after["samples"]) for points in kept["chart-utilization"]["series"].values())
            assert await page_errors(browser, allow_network=True) == []


SLO_ROWS = """
const rows = [...document.querySelectorAll("#slo tbody tr[data-task]")].map((row) => ({
  task: row.dataset.task, cells: [...row.cells].map((cell) => cell.textContent),
  over: row.querySelector(".predicted").classList.contains("over")}));
return {hidden: document.getElementById("slo-panel").hidden, rows};
"""


async def test_the_slo_table_shows_each_planned_tasks_prediction_and_attainment(tmp_path, browser):
    path = tmp_path / "tangram.toml"
    write_config(path, {})
    async with slo_broker(path) as live:
        await asyncio.to_thread(browser.get, live.url + "/ui")
        await until(browser, HEADER + "return header.connection === 'live' ? header : null;", "a live page")
        assert await in_page(browser, SLO_ROWS) == {"hidden": True, "rows": []}  # no task has a plan

        for task, plan in (("heavy", HEAVY), ("quick", QUICK)):  # quick gets a GPU reserved beside heavy
            code, body = await slo_call(live, "PUT", f"/v1/tasks/{task}/slo", json=plan)
            assert code == 200, body
        code, record = await slo_call(live, "POST", "/v1/actions?wait=true", json=slo_reward("quick", "b"))
        assert record["state"] == "succeeded", record
        shown = await until(browser, SLO_ROWS.replace(
            "return {", "return rows.length === 2 && rows[1].cells[4] === '1' && {"), "the planned task's window")
        # as predicted now, with the restore the manager has learned from quick's action
        code, body = await slo_call(live, "GET", "/v1/tasks/slo")
        predicted = {task["task"]: task["prediction"]["slowdown"] for task in body["tasks"]}
        assert not shown["hidden"] and shown["rows"] == [
            {"task": "heavy", "over": False, "cells": ["heavy", "1.10×", f"{predicted['heavy']:.2f}×", "–", "0", "0",
                                                       "–", "–"]},
            {"task": "quick", "over": False, "cells": ["quick", "1.50×", f"{predicted['quick']:.2f}×", "1", "1", "1",
                                                       "100%", shown["rows"][1]["cells"][7]]}]
        assert shown["rows"][1]["cells"][7].endswith("×")
        assert await page_errors(browser) == []


PLACEMENT_ROWS = """
const rows = [...document.querySelectorAll("#placement tbody tr[data-service]")].map((row) => ({
  service: row.dataset.service, cells: [...row.cells].map((cell) => cell.textContent)}));
return {hidden: document.getElementById("placement-panel").hidden, rows,
        how: document.getElementById("placement-how").textContent};
"""


async def test_the_placement_table_shows_where_each_service_runs(tmp_path, browser):
    path = tmp_path / "tangram.toml"
    write_typed_config(path)
    async with broker_from_file(path, stand_ins) as live:
        await asyncio.to_thread(browser.get, live.url + "/ui")
        await until(browser, HEADER + "return header.connection === 'live' ? header : null;", "a live page")
        shown = await in_page(browser, PLACEMENT_ROWS)
        assert not shown["hidden"] and shown["rows"] == [] and "not solved yet" in shown["how"]
        for _ in range(3):
            await run_all(live, ["g"] * 16 + ["a"] * 2)
        shown = await until(browser, PLACEMENT_ROWS.replace(
            "return {", "return rows.length === 2 && rows.every((r) => r.cells[3] === 'yes') && {"),
            "both services placed")
        rows = {row["service"]: row["cells"] for row in shown["rows"]}
        assert rows["a"][2].startswith("h100 ") and "h20" not in rows["a"][2]
        assert "h100" in rows["g"][2] and "h20" in rows["g"][2]
        assert float(rows["g"][1]) > float(rows["a"][1]) > 0
        assert shown["how"].startswith("ilp, answered by ilp: every load served")
        assert await page_errors(browser) == []

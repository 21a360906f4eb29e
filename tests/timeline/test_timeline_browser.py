"""The timeline page as a person uses it, in headless Debian chromium over the DevTools
protocol: it loads a page built from real scheduler output without console errors, its rows
and the colours drawn on its canvas match the step records, hovering a cell shows the request,
and it keeps screenshots in tests/timeline/artifacts/. A 100,000-step file opens within a
stated time and says what it dropped.

Chromium comes from tests/timeline/setup_browser_tests.sh (or is installed here when missing
and we are root); otherwise these tests skip with the reason."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from timeline_browser import Browser, ensure_chromium
from timeline_gen import run_cramped, run_slo, write_synthetic_steps
from tokenweir.timeline import build_page
from tokenweir.timeline.layout import (COLORS, CUT, DECODE, PAUSED, PREEMPTED, PREFILL,
                                       STATES, SWAPPED, WAITING)

ARTIFACTS = Path(__file__).parent / "artifacts"
SCALE_BUILD_SECONDS = 60  # python: 100k-step JSONL -> page (about 5 s alone on 2 cores)
SCALE_OPEN_SECONDS = 20  # chromium: load and first draw of that page
REDRAW_MS = 150  # one full redraw of both canvases at any zoom


@pytest.fixture(scope="module")
def browser():
    pytest.importorskip("websocket", reason="websocket-client (dev extra) is not installed")
    path, why = ensure_chromium()
    if path is None:
        pytest.skip(why)
    b = Browser(path, width=1400, height=1000)
    yield b
    b.close()


def _expected_state(step: dict, rid: str, arrival: float) -> int:
    """What the page must show for `rid` in this step, from the record alone."""
    if rid in step.get("cut", ()):
        return CUT
    if rid in step.get("preempted", ()):
        return PREEMPTED
    ran = {r["id"]: r for r in step["reqs"]}
    if rid in ran:
        return PREFILL if ran[rid]["prefill"] else DECODE
    if rid in step.get("swapped", ()):
        return SWAPPED
    if rid in step.get("paused", ()):
        return PAUSED
    return WAITING if step["start"] >= arrival else 0


def _one_cell_per_state(trace) -> dict[int, tuple[int, str]]:
    """state -> (step, request id): the first cell of each state in the trace (a waiting
    cell: a step between a request's arrival and its first scheduled step)."""
    found: dict[int, tuple[int, str]] = {}
    first_seen: dict[str, int] = {}
    for s in trace.steps:
        for rid in [r["id"] for r in s["reqs"]] + s["paused"] + s["preempted"] + s["swapped"]:
            first_seen.setdefault(rid, s["step"])
            found.setdefault(_expected_state(s, rid, trace.requests[rid]["arrival"]),
                             (s["step"], rid))
    for rid, first in first_seen.items():
        arrival = trace.requests[rid]["arrival"]
        for s in trace.steps[:first]:
            if s["start"] >= arrival + 0.005:
                found.setdefault(WAITING, (s["step"], rid))
                break
    return found


def _open(browser: Browser, page: Path) -> float:
    seconds = browser.open(page.resolve().as_uri())
    for _ in range(200):
        if browser.evaluate("!!(window.timelineState && timelineState.ready)"):
            return seconds
        time.sleep(0.05)
    raise AssertionError(f"the page never became ready; errors: {browser.errors()}")


def _check_cells(browser: Browser, panel: int, trace) -> set[int]:
    """Each state's first cell: the page's state and the canvas pixel match the record."""
    cells = _one_cell_per_state(trace)
    for state, (step, rid) in cells.items():
        assert browser.evaluate(f"timelineState.stateAt({panel}, '{rid}', {step})") == \
            STATES[state], (rid, step)
        for _ in range(20):  # the panels' scroll sync runs on async scroll events: let it settle
            at = browser.evaluate(f"timelineState.showCell({panel}, '{rid}', {step}, 16)")
            time.sleep(0.01)
            pixels = [browser.evaluate(f"timelineState.pixelAt({panel}, {at['x'] + dx}, "
                                       f"{at['y'] + dy})")
                      for dx, dy in ((0, 0), (-4, 2), (4, -2))]
            if pixels.count(COLORS[state]) >= 2:
                break
        assert pixels.count(COLORS[state]) >= 2, (STATES[state], rid, step, pixels)
    return set(cells)


def _hover(browser: Browser, panel: int, rid: str, step: int) -> str:
    """Hover the cell at the page's current zoom (fit after setMode); the tooltip's text."""
    at = browser.evaluate(f"timelineState.cellCenter({panel}, '{rid}', {step})")
    browser.mouse_move(at["x"], at["y"])
    for _ in range(100):
        text = browser.evaluate("timelineState.tooltipText()")
        if text:
            return text
        time.sleep(0.02)
    raise AssertionError("hovering a cell showed no tooltip")


def test_slo_vs_fcfs_page(browser, tmp_path):
    _, slo = run_slo("slo")
    _, fcfs = run_slo("fcfs")
    page = build_page([slo, fcfs], tmp_path / "slo_vs_fcfs.html")
    _open(browser, page)
    assert browser.errors() == []
    state = json.loads(browser.evaluate("JSON.stringify(timelineState.panels)"))
    assert [p["numSteps"] for p in state] == [len(slo.steps), len(fcfs.steps)]
    by_arrival = sorted(slo.requests, key=lambda rid: slo.requests[rid]["arrival"])
    assert browser.evaluate("timelineState.rowIds") == by_arrival
    assert browser.evaluate("timelineState.notesText()") == "Nothing dropped."
    shown = _check_cells(browser, 0, slo)
    assert {CUT, PAUSED, PREFILL, DECODE, WAITING} <= shown  # the slo policy's marks
    _check_cells(browser, 1, fcfs)  # the same rows, the other policy, side by side
    cut_step = next(s for s in slo.steps if s["cut"])
    rid = cut_step["cut"][0]
    browser.evaluate("timelineState.setMode('step')")  # back to the whole run in view
    text = _hover(browser, 0, rid, cut_step["step"])
    info = slo.requests[rid]
    assert f"request {rid}" in text and f"arrival {info['arrival'] * 1000:.1f} ms" in text
    assert f"step {cut_step['step']}: cut" in text and "shared with" in text
    assert browser.evaluate("timelineState.hoverRow()") == rid
    ARTIFACTS.mkdir(exist_ok=True)
    browser.screenshot(ARTIFACTS / "timeline_slo_vs_fcfs.png")
    browser.evaluate("timelineState.setMode('time')")
    assert browser.evaluate("timelineState.mode()") == "time"
    browser.screenshot(ARTIFACTS / "timeline_slo_vs_fcfs_time.png")
    assert browser.errors() == []


def _middle_of_longest_swap(trace) -> tuple[str, int]:
    runs: dict[str, list[int]] = {}  # id -> [first step, length] of its longest swap so far
    current: dict[str, list[int]] = {}
    for s in trace.steps:
        for rid in s["swapped"]:
            run = current.get(rid)
            current[rid] = [run[0], run[1] + 1] if run and run[0] + run[1] == s["step"] \
                else [s["step"], 1]
            if current[rid][1] > runs.get(rid, [0, 0])[1]:
                runs[rid] = current[rid]
    rid, (first, length) = max(runs.items(), key=lambda kv: kv[1][1])
    return rid, first + length // 2


def test_recompute_vs_swap_page(browser, tmp_path):
    _, recompute = run_cramped("recompute")
    _, swap = run_cramped("swap")
    page = build_page([recompute, swap], tmp_path / "recompute_vs_swap.html")
    _open(browser, page)
    assert browser.errors() == []
    assert PREEMPTED in _check_cells(browser, 0, recompute)
    assert SWAPPED in _check_cells(browser, 1, swap)
    browser.evaluate("timelineState.setMode('step')")
    rid, step = _middle_of_longest_swap(swap)  # columns are < 1 px wide at this zoom
    text = _hover(browser, 1, rid, step)
    hovered = re.search(r"step (\d+): swapped", text)  # a pixel spans more than one step
    assert f"request {rid}" in text and hovered and abs(int(hovered[1]) - step) <= 2, text
    ARTIFACTS.mkdir(exist_ok=True)
    browser.screenshot(ARTIFACTS / "timeline_recompute_vs_swap.png")
    assert browser.errors() == []


def test_100k_steps_open_and_scroll(browser, tmp_path):
    records = tmp_path / "long.jsonl"
    num_requests = write_synthetic_steps(records, num_steps=100_000)
    started = time.monotonic()
    page = build_page([records], tmp_path / "long.html")
    build_seconds = time.monotonic() - started
    open_seconds = _open(browser, page)
    print(f"100k steps, {num_requests} requests: page {page.stat().st_size / 1e6:.1f} MB "
          f"built in {build_seconds:.1f} s, opened in {open_seconds:.1f} s, first draw "
          f"{browser.evaluate('timelineState.renderMs'):.0f} ms")
    assert build_seconds < SCALE_BUILD_SECONDS and open_seconds < SCALE_OPEN_SECONDS
    assert browser.errors() == []
    notes = browser.evaluate("timelineState.notesText()")
    assert f"dropped {num_requests - 5000} requests" in notes  # it says what it dropped
    panel = browser.evaluate("timelineState.panels[0]")
    assert panel["numSteps"] == panel["numCols"] == 100_000
    redraws = [browser.evaluate("timelineState.timeRedraw()")]  # whole run in view
    for _ in range(5):
        browser.evaluate("timelineState.scrollBy(0, 20000)")
        redraws.append(browser.evaluate("timelineState.timeRedraw()"))
    browser.evaluate("timelineState.showCell(0, 'q4000', 53330, 8)")  # zoomed in, far right
    redraws.append(browser.evaluate("timelineState.timeRedraw()"))
    print("redraw ms:", [round(r, 1) for r in redraws])
    assert max(redraws) < REDRAW_MS
    assert browser.evaluate("timelineState.stateAt(0, 'q4000', 53330)") == "decode"
    ARTIFACTS.mkdir(exist_ok=True)
    browser.screenshot(ARTIFACTS / "timeline_100k_steps.png")
    assert browser.errors() == []

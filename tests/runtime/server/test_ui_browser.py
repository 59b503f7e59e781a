"""``/ui`` in a real browser: ``arbor serve`` (the tiny random Llama, an API key, the test
programs) in a subprocess, headless Chromium driven by selenium.

The browser logs in with the key, waits for the live gauges, runs ``fan_out`` (a prefix,
then a fork into three branches) from the form, and checks that the run's events stream
in, its trace timeline appears (three branch lanes, cached prefixes shaded), and the
gauges moved (finished requests, cached tokens, TTFT samples, the runs table). The screenshot is saved
as ``benchmarks/results/ui_browser.png`` (not committed).

Needs Debian's ``chromium`` and ``chromium-driver`` (``make setup`` installs them when it
runs as root with apt-get) and ``selenium`` (the ``dev`` extra); skips, saying what is
missing, only when no browser or driver can be found.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import API_KEY, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
PROGRAMS_FILE = Path(__file__).parent / "ui_programs_fixture.py"
SCREENSHOT = ROOT / "benchmarks" / "results" / "ui_browser.png"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> tuple[str, str]:
    """(browser binary, chromedriver), or skip saying what is missing (selenium itself is
    in the dev extra: its absence is a set-up failure, not a skip)."""
    browser = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("no headless browser: install Debian's chromium and chromium-driver "
                    "(make setup does so as root with apt-get)")
    return browser, driver


@pytest.fixture(scope="module")
def arbor_serve(tiny_llama_dir: Path) -> Iterator[str]:
    """``arbor serve`` in a subprocess; yields its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", str(tiny_llama_dir), "--port", str(port),
           "--api-key", API_KEY, "--programs", str(PROGRAMS_FILE), "--num-threads", "1", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"arbor serve exited: {proc.stdout.read() if proc.stdout else ''}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("arbor serve did not come up in 120 s")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture()
def browser() -> Iterator[Any]:
    binary, driver_path = find_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1700"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: Any, condition: Any, timeout: float = 60, what: str = "") -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition, message=what)


def text(driver: Any, element_id: str) -> str:
    return css_text(driver, "#" + element_id)


def css_text(driver: Any, selector: str) -> str:
    """The text of the first element matching ``selector``, read in one script call (the
    page re-renders its tables every second, so element handles go stale)."""
    found = driver.execute_script("const e = document.querySelector(arguments[0]); return e && e.textContent;",
                                  selector)
    return "" if found is None else str(found)


def test_ui_runs_a_program_from_the_form_and_shows_its_timeline(arbor_serve: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(arbor_serve + "/ui")
    browser.find_element(By.ID, "key").send_keys(API_KEY)  # the login page: the key is set
    browser.find_element(By.ID, "login-submit").click()
    wait_for(browser, lambda d: text(d, "status").startswith("live"), what="live figures never arrived")
    wait_for(browser, lambda d: text(d, "g-kv-total") not in ("", "–"), what="KV gauge empty")
    finished_before = int(text(browser, "g-finished"))
    cached_before = int(text(browser, "g-cached-tokens"))
    assert int(text(browser, "g-kv-total")) > 0 and text(browser, "g-running") == "0"
    assert "tiny" in text(browser, "model") or text(browser, "model")

    wait_for(browser, lambda d: len(Select(d.find_element(By.ID, "program-select")).options) == 1,
             what="program list not loaded")
    Select(browser.find_element(By.ID, "program-select")).select_by_value("fan_out")
    topic = wait_for(browser, lambda d: d.find_element(By.ID, "arg-topic"), what="no field for 'topic'")
    topic.send_keys("lighthouses")
    assert browser.find_element(By.ID, "arg-n").get_attribute("value") == "3"  # the schema's default
    browser.find_element(By.ID, "run-button").click()

    events = wait_for(browser, lambda d: [li.text for li in d.find_elements(By.CSS_SELECTOR, "#events li")
                                         if "result" in li.text] and d.find_elements(By.CSS_SELECTOR, "#events li"),
                      what="the run's result event never arrived")
    assert sum(" gen #" in e.text for e in events) == 4  # one event per generation, streamed
    bars = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#timeline svg g.node-gen"),
                    what="the timeline never appeared")
    assert len(bars) == 4 and len(browser.find_elements(By.CSS_SELECTOR, "#timeline svg g.node-fork")) == 1
    lanes = browser.execute_script("return [...document.querySelectorAll('#timeline svg text')]"
                                   ".map(t => t.textContent).filter(t => t.startsWith('branch'));")
    assert lanes == ["branch 1", "branch 2", "branch 3"]
    cached = browser.execute_script("return [...document.querySelectorAll('#timeline svg rect.cached')]"
                                    ".map(r => parseFloat(r.getAttribute('width')));")
    assert len(cached) == 4 and sum(w > 0 for w in cached) >= 3  # the branches reuse the shared prefix

    # The gauges moved: finished requests, cached prompt tokens, and the run is listed.
    wait_for(browser, lambda d: int(text(d, "g-finished")) >= finished_before + 4, what="finished count stuck")
    assert int(text(browser, "g-cached-tokens")) > cached_before
    ttft_count = '#lat-table tr[data-metric="ttft"][data-window="60s"] td:nth-child(3)'
    wait_for(browser, lambda d: int(css_text(d, ttft_count) or 0) >= 4, what="no TTFT samples")  # its 4 gens
    wait_for(browser, lambda d: "fan_out" in css_text(d, "#runs-table tbody tr"), what="run not listed")
    assert "ok" in css_text(browser, "#runs-table tbody tr td:nth-child(3)")
    assert float(text(browser, "g-hit").rstrip("%")) > 0  # the branches hit the shared prefix

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    time.sleep(1.2)  # one more poll, so the screenshot shows settled gauges
    assert browser.save_screenshot(str(SCREENSHOT))

"""The router's ``/ui`` rollout page in a real browser (headless Chromium via selenium):
a router with an API key and a plan over two fake workers, a candidate that answers
differently, its shadow pairs failing the exact-match gate. The browser logs in and the
page shows both pools side by side (p50/p99 with their sample counts), the shadow
figures, the rolled-back state and the rollback event with its gate's figures.

Skips, saying so, only when Debian's ``chromium`` / ``chromium-driver`` are missing
(``find_browser`` of the server page's browser test).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import API_KEY, LiveServer, auth
from test_rollout_app import FAST_HEALTH, VersionedWorker
from test_ui_browser import css_text, find_browser, wait_for

from runtime.router.app import create_router_app
from runtime.router.pools import Pools
from runtime.router.rollout_plan import plan_from_dict

pytestmark = pytest.mark.slow


@pytest.fixture()
def browser() -> Iterator[Any]:
    binary, driver_path = find_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1200"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def cell(driver: Any, pool: str, metric: str, q: str = "") -> str:
    return css_text(driver, f'#panel-table td[data-pool="{pool}"][data-metric="{metric}"][data-q="{q}"]')


def test_the_rollout_page_shows_both_pools_shadow_and_the_rollback(browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    base, cand = VersionedWorker("base-v1"), VersionedWorker("cand-v2")
    cand.shift = 1  # its third and fourth tokens differ: every shadowed pair mismatches
    with LiveServer(base.app) as b, LiveServer(cand.app) as c:
        pools, urls = Pools.parse([f"baseline={b.url}", f"candidate={c.url}"])
        plan = plan_from_dict({
            "baseline": "baseline", "candidate": "candidate", "interval_s": 0.05,
            "steps": [{"weight": 50, "dwell_s": 3600}, {"weight": 100}], "shadow": {"share": 1.0},
            "gates": [{"metric": "shadow_exact_match", "min": 0.9, "min_samples": 3}]}, pools.names)
        app = create_router_app(urls, health=FAST_HEALTH, api_key=API_KEY, pools=pools, plan=plan)
        with LiveServer(app) as router:
            canary = router.server.config.app.state.canary  # type: ignore[union-attr]
            with httpx.Client(timeout=30, headers=auth()) as client:
                for i in range(40):
                    if canary.rollout.state == "rolled_back":
                        break
                    body = {"text": "hello", "sampling_params": {"temperature": 0.0, "top_logprobs": 2}}
                    assert client.post(router.url + "/generate", json=body,
                                       headers={"x-session-id": f"s{i}"}).status_code == 200
                    time.sleep(0.05)
                status = client.get(router.url + "/rollout").json()
            assert status["state"] == "rolled_back"
            n_base, n_cand = status["panel"]["baseline"]["requests"], status["panel"]["candidate"]["requests"]
            assert n_base > 0 and n_cand > 0

            browser.get(router.url + "/ui")
            browser.find_element(By.ID, "key").send_keys(API_KEY)  # the login page: the key is set
            browser.find_element(By.ID, "login-submit").click()
            wait_for(browser, lambda d: css_text(d, "#status").startswith("live"), what="the page never polled")
            wait_for(browser, lambda d: css_text(d, "#plan-state") == "rolled back", what="state not shown")
            assert css_text(browser, "#g-weights").startswith("baseline 100%")
            assert (css_text(browser, "#g-step"), css_text(browser, "#g-num-steps")) == ("1", "2")
            # side by side: both pools, p50/p99 with the samples behind each
            assert cell(browser, "baseline", "requests") == str(n_base)
            assert cell(browser, "candidate", "requests") == str(n_cand)
            for pool, n in (("baseline", n_base), ("candidate", n_cand)):
                for metric in ("ttft_s", "e2e_s"):
                    for q in ("p50", "p99"):
                        assert cell(browser, pool, metric, q).endswith(f"ms ({n})")
                assert cell(browser, pool, "itl_s", "p50") == "–"  # no streams: no ITL samples
                assert cell(browser, pool, "errors") == "0"
            assert cell(browser, "candidate", "versions") == "m@cand-v2"
            assert "cand-v2" in css_text(browser, '#pools-table tr[data-pool="candidate"]')
            # shadow figures
            pairs = status["shadow"]["pairs"]
            assert pairs >= 3 and css_text(browser, '#shadow-table tr[data-shadow="pairs"] td:nth-child(2)') == str(pairs)
            assert css_text(browser, '#shadow-table tr[data-shadow="exact_match"] td:nth-child(2)') == f"0.0% ({pairs})"
            assert css_text(browser, '#shadow-table tr[data-shadow="prefix_share"] td:nth-child(2)') == "50.0%"
            assert "(" in css_text(browser, '#shadow-table tr[data-shadow="mean_kl"] td:nth-child(2)')
            # the event log: the rollback first, with its gate, figures and time
            rollback = css_text(browser, "#events-table tbody tr:first-child")
            event = status["events"][-1]
            assert css_text(browser, "#events-table tbody tr:first-child td:nth-child(2)") == "rollback"
            assert (f"gate shadow_exact_match = 0.000 (min 0.900) over {event['detail']['samples']} samples"
                    in rollback)
            shown = css_text(browser, "#events-table tbody tr:first-child td:first-child")
            assert shown == browser.execute_script("return new Date(arguments[0] * 1000).toLocaleTimeString();",
                                                   event["t"])
            assert css_text(browser, "#events-table tbody tr:last-child td:nth-child(2)") == "start"
            assert browser.save_screenshot(str(tmp_path / "rollout_ui.png"))
            print(f"screenshot: {tmp_path / 'rollout_ui.png'}")

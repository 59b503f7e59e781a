"""The router's ``/ui`` rollout page over HTTP: behind the API key like every route (a
login cookie opens ``/ui`` paths only), its JSON equal to ``GET /rollout``, its static
files, and the page without a plan. (The page drawn in a real browser:
``test_rollout_ui_browser.py``.)"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_helpers import API_KEY, LiveServer, auth
from test_rollout_app import FAST_HEALTH, VersionedWorker

from runtime.router.app import create_router_app
from runtime.router.pools import Pools
from runtime.router.rollout_plan import plan_from_dict


@pytest.fixture()
def keyed_router() -> Iterator[tuple[str, VersionedWorker]]:
    """A router with a plan and ``--api-key`` over a baseline and a failing candidate."""
    base, cand = VersionedWorker("base-v1"), VersionedWorker("cand-v2")
    cand.status = 503
    with LiveServer(base.app) as b, LiveServer(cand.app) as c:
        pools, urls = Pools.parse([f"baseline={b.url}", f"candidate={c.url}"])
        plan = plan_from_dict({"baseline": "baseline", "candidate": "candidate", "min_samples": 3,
                               "steps": [{"weight": 50, "dwell_s": 3600}, {"weight": 100}], "interval_s": 0.05,
                               "gates": [{"metric": "error_rate", "max": 0.1}]}, pools.names)
        app = create_router_app(urls, health=FAST_HEALTH, api_key=API_KEY, pools=pools, plan=plan)
        with LiveServer(app) as router:
            yield router.url, cand


def test_ui_needs_the_key_and_its_json_is_the_rollout_status(keyed_router: tuple[str, VersionedWorker]) -> None:
    url, cand = keyed_router
    with httpx.Client(base_url=url, timeout=30) as anon:
        page = anon.get("/ui")
        assert page.status_code == 401 and 'name="key"' in page.text and "Arbor router" in page.text
        assert anon.get("/ui/api/rollout").status_code == 401
        assert anon.get("/ui/static/rollout.js").status_code == 401
        wrong = anon.post("/ui/login", data={"key": "nope"})
        assert wrong.status_code == 401 and "Wrong key" in wrong.text
        ok = anon.post("/ui/login", data={"key": API_KEY})
        assert ok.status_code == 303 and ok.headers["location"] == "/ui"
        assert API_KEY not in anon.cookies["arbor_ui"]
        page = anon.get("/ui")
        assert page.status_code == 200 and "<title>Arbor router — rollout</title>" in page.text
        for name, kind in (("rollout.js", "text/javascript"), ("rollout.css", "text/css"), ("ui.css", "text/css")):
            resp = anon.get(f"/ui/static/{name}")
            assert resp.status_code == 200 and resp.headers["content-type"].startswith(kind) and resp.text
        assert anon.get("/ui/static/../app.py").status_code == 404
        assert anon.get("/ui/static/index.html").status_code == 404
        # other /ui paths are not relayed: the cookie must not open the workers' own /ui
        for path in ("/ui/api/live", "/ui/api/programs", "/ui/app.py"):
            resp = anon.get(path)
            assert resp.status_code == 404 and "the router has no /ui/" in resp.text
        assert anon.post("/ui/api/programs/qa", json={}).status_code == 404
        assert httpx.get(url + "/rollout", headers=auth()).json()["panel"] == {}  # nothing was relayed
        # the cookie opens /ui only: the admin API and the relayed routes still need the header
        assert anon.get("/rollout").status_code == 401
        assert anon.post("/rollout/rollback").status_code == 401
        assert anon.post("/generate", json={"text": "hi"}).status_code == 401

        for i in range(12):  # the candidate's 503s are retried on the baseline; the gate rolls back
            body = {"text": "hello", "sampling_params": {"temperature": 0.0}}
            assert httpx.post(url + "/generate", json=body, headers={**auth(), "x-session-id": f"u{i}"},
                              timeout=30).status_code == 200
        page_json = anon.get("/ui/api/rollout").json()
    admin = httpx.get(url + "/rollout", headers=auth()).json()
    assert page_json["state"] == admin["state"] and page_json["events"] == admin["events"]
    assert page_json["panel"]["baseline"]["requests"] == admin["panel"]["baseline"]["requests"] == 12
    assert cand.seen > 0
    # what the page draws is all there: both pools' p50/p99 with samples, shadow, step, events
    for key in ("ttft_s", "itl_s", "e2e_s"):
        assert set(page_json["panel"]["baseline"][key]) == {"p50", "p99", "samples"}
    assert {"pairs", "exact_match", "mean_kl", "jobs"} <= set(page_json["shadow"])
    assert {"step", "num_steps", "weights", "baseline", "candidate", "gates"} <= set(page_json)


def test_ui_without_a_plan_says_so() -> None:
    worker = VersionedWorker("v")
    with LiveServer(worker.app) as w, LiveServer(create_router_app([w.url], health=FAST_HEALTH)) as router:
        page = httpx.get(router.url + "/ui")
        assert page.status_code == 200 and 'id="no-plan"' in page.text  # the page is open without a key
        resp = httpx.get(router.url + "/ui/api/rollout")
        assert resp.status_code == 404 and "no rollout plan" in resp.json()["error"]["message"]

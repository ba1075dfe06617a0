"""The plan visualizer in a real headless Chromium, plus `autopar diff` and `autopar explain`.

The browser is driven over the Chrome DevTools Protocol on a pipe
(``--remote-debugging-pipe``: NUL-separated JSON on fds 3 and 4), so the test
needs nothing but the ``chromium`` binary (Debian package ``chromium``); it is
skipped, saying so, where that is not installed.
Set AUTOPAR_DOCS_SCREENSHOT=1 to also write docs/img/viz.png for the README.
"""
from __future__ import annotations

import base64
import copy
import fcntl
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import autopar
from autopar.errors import AutoparError, PlanError
from autopar.cost_models.graph_costs import kept_outputs
from autopar.explain import capture_plan_model, explain, explain_main, explain_node
from autopar.plan import Plan
from autopar.report import fmt_s
from autopar.plandiff import diff_main, diff_plans, format_diff, layout
from autopar.runtime import load_factory
from autopar.viz import render_html, viz_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless browser test needs Chromium: apt-get install -y chromium (CI installs it)")


# --------------------------------------------------------------------------- plans

def _compile(factory: str, mesh, **kw) -> Plan:
    source = f"{ROOT}/examples/{factory}"
    model, inputs, loss_fn = load_factory(source)
    return autopar.compile(model, inputs, mesh=mesh, cluster="dgx-a100", loss_fn=loss_fn, source=source, **kw)


@pytest.fixture(scope="session")  # built once per xdist worker, which interleaves modules
def gpt_plan() -> Plan:
    return _compile("gpt.py:demo", (2, 2))


@pytest.fixture(scope="session")  # built once per xdist worker, which interleaves modules
def mlp_plans() -> tuple:
    return _compile("mlp.py:small", 4), _compile("mlp.py:small", (2, 2))


def with_pipeline(plan: Plan, schedule: str = "1f1b", microbatches: int = 4, virtual: int = 1,
                  per_chunk: bool = False) -> Plan:
    """``plan`` with a plausible two-stage pipeline section (what a pipelined compile would add).

    ``per_chunk`` lists one entry per model chunk (2 x ``virtual``, chunk c on the devices of stage c % 2),
    as autopar/pipeline/planfile.py writes interleaved plans; otherwise one entry per stage."""
    obj = copy.deepcopy(plan.to_json())
    step = plan.predicted["step_time_s"]
    mem = plan.predicted["peak_memory_bytes"]
    if per_chunk:
        layers = [["tok", "pos"], ["blocks.0"], ["blocks.1"], ["ln", "head"]]
        stages = [{"index": c, "layers": layers[c], "submesh": [2], "devices": [[0, 1], [2, 3]][c % 2],
                   "time_s": step / microbatches / 2, "memory_bytes": 0.5 * mem} for c in range(4)]
    else:
        stages = [
            {"index": 0, "layers": ["tok", "pos", "blocks.0"], "submesh": [2], "devices": [0, 1],
             "time_s": step / microbatches, "memory_bytes": 0.55 * mem},
            {"index": 1, "layers": ["blocks.1", "ln", "head"], "submesh": [2], "devices": [2, 3],
             "time_s": 1.1 * step / microbatches, "memory_bytes": 0.5 * mem},
        ]
    obj["pipeline"] = {"schedule": schedule, "microbatches": microbatches, "virtual_stages": virtual,
                       "stages": stages}
    obj["predicted"]["bubble_s"] = step / microbatches
    return Plan.from_json(obj)


# --------------------------------------------------------------------------- a small CDP client

class Browser:
    """Headless Chromium over the DevTools protocol on a pipe."""

    def __init__(self, exe: str, profile: str):
        to_chrome_r, self._out = os.pipe()
        self._in, from_chrome_w = os.pipe()
        # Chromium reads commands on fd 3 and writes replies on fd 4; a tiny trampoline moves the pipe ends
        # there and execs the browser (copies at fd >= 10 first, so that neither lands on 3 or 4 by chance)
        r, w = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
        for fd in (to_chrome_r, from_chrome_w):
            os.close(fd)
        args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--no-default-browser-check", "--mute-audio", "--remote-debugging-pipe",
                f"--user-data-dir={profile}", "about:blank"]
        trampoline = (f"import os, sys; os.dup2({r}, 3); os.dup2({w}, 4); os.close({r}); os.close({w}); "
                      "os.set_inheritable(3, True); os.set_inheritable(4, True); os.execv(sys.argv[1], sys.argv[1:])")
        self.proc = subprocess.Popen([sys.executable, "-c", trampoline, *args], pass_fds=(r, w),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(r)
        os.close(w)
        self._id = 0
        self._replies: dict = {}
        self._cond = threading.Condition()
        self.events: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        buf = b""
        while True:
            try:
                chunk = os.read(self._in, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._cond:
                        self._replies[msg["id"]] = msg
                        self._cond.notify_all()
                else:
                    self.events.put(msg)
        with self._cond:
            self._cond.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise RuntimeError(f"Chromium did not answer {method} (exit status {self.proc.poll()})")
                self._cond.wait(min(left, 0.5))
            reply = self._replies.pop(self._id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def new_page(self, width: int = 1400, height: int = 1000) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        return Page(self, session, width, height)

    def close(self):
        try:
            self.send("Browser.close", timeout=5)
        except RuntimeError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._out)


class Page:
    def __init__(self, browser: Browser, session: str, width: int, height: int):
        self.b, self.s = browser, session
        self.errors: list[str] = []
        self.requests: list[str] = []
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def send(self, method, params=None):
        return self.b.send(method, params, self.s)

    def _drain(self, until: str | None = None, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ev = self.b.events.get(timeout=0.05 if until is None else max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                if until is None:
                    return
                raise TimeoutError(f"no {until} within {timeout} s")
            if ev.get("sessionId") != self.s:
                continue
            method, p = ev["method"], ev.get("params", {})
            if method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
                self.errors.append("console: " + " ".join(str(a.get("value", a.get("description")))
                                                         for a in p["args"]))
            elif method == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                self.errors.append("exception: " + d.get("exception", {}).get("description", d.get("text", "")))
            elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
                self.errors.append("log: " + p["entry"]["text"])
            elif method == "Network.requestWillBeSent":
                self.requests.append(p["request"]["url"])
            if until is not None and method == until:
                return

    def goto(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})
        self._drain(until="Page.loadEventFired")
        deadline = time.monotonic() + 30
        while not self.eval("document.body && document.body.getAttribute('data-ready') === '1'"):
            self._drain()
            if self.errors or time.monotonic() > deadline:
                raise AssertionError(f"page did not finish rendering: {self.errors}")
            time.sleep(0.05)
        self._drain()

    def eval(self, expression: str):
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def count(self, selector: str) -> int:
        return self.eval(f"document.querySelectorAll({json.dumps(selector)}).length")

    def center(self, selector: str) -> tuple[float, float]:
        box = self.eval(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            if (!e) return null; e.scrollIntoView({{block: 'center', inline: 'center'}});
            const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()""")
        assert box is not None, f"no element {selector}"
        return box[0], box[1]

    def mouse(self, kind: str, x: float, y: float, **kw) -> None:
        self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, **kw})

    def hover(self, selector: str) -> None:
        x, y = self.center(selector)
        self.mouse("mouseMoved", x, y)

    def click(self, selector: str) -> None:
        x, y = self.center(selector)
        self.mouse("mouseMoved", x, y)
        self.mouse("mousePressed", x, y, button="left", clickCount=1)
        self.mouse("mouseReleased", x, y, button="left", clickCount=1)

    def screenshot(self, path, full: bool = False) -> bytes:
        params = {"format": "png"}
        if full:
            params["captureBeyondViewport"] = True
        png = base64.b64decode(self.send("Page.captureScreenshot", params)["data"])
        with open(path, "wb") as f:
            f.write(png)
        return png


@pytest.fixture(scope="session")  # built once per xdist worker, which interleaves modules
def browser():
    if CHROMIUM is None:
        pytest.skip("headless browser test needs Chromium: apt-get install -y chromium (CI installs it)")
    profile = tempfile.mkdtemp(prefix="autopar-chromium-")
    b = Browser(CHROMIUM, profile)
    try:
        b.send("Browser.getVersion", timeout=60)
        yield b
    finally:
        b.close()
        shutil.rmtree(profile, ignore_errors=True)


def open_page(browser, tmp_path, plans, name: str, **kw) -> Page:
    path = render_html(plans, str(tmp_path / name), **kw)
    page = browser.new_page()
    page.goto("file://" + path)
    assert page.errors == [], page.errors
    outside = [u for u in page.requests if not u.startswith(("file:", "data:", "about:"))]
    assert outside == [], f"the page fetched from the network: {outside}"
    return page


def tooltip(page) -> tuple[bool, str]:
    return page.eval("[!document.getElementById('tooltip').hidden, document.getElementById('tooltip').textContent]")


# --------------------------------------------------------------------------- browser tests

@needs_chromium
def test_gpt_plan_page_renders_and_responds(browser, gpt_plan, tmp_path):
    page = open_page(browser, tmp_path, [gpt_plan], "gpt.html")
    # every part of the page is drawn
    assert page.count("#graph svg") == 1
    assert page.count("#graph .node") > 10
    assert page.count("#graph .module-group") > 3
    assert page.count("#memory-chart .mem-seg") >= 4
    assert page.eval("[...document.querySelectorAll('#memory-chart .mem-seg')].map(e => e.dataset.kind)")[:4] == \
        ["parameters", "gradients", "optimizer", "activations"]
    assert page.count("#comm-chart .comm-seg") >= 2
    assert page.count("#param-table tbody tr") == len(gpt_plan.parameters)
    assert page.count("#mesh-view .device[data-rank]:not(.idle)") == 4
    assert page.count("#mesh-view .axis-link") == 2  # rank 0's group on x and on y
    assert page.count("#breakdown .seg") >= 2
    assert page.count("#schedule") == 0  # no pipeline in this plan

    # expand / collapse a module group by clicking its title
    attn = '.module-group[data-path="blocks.0.attn"]'
    assert page.count(attn + ".collapsed") == 1
    assert page.count('.node[data-name="scaled_dot_product_attention"]') == 0
    page.click(attn + " .toggle")
    assert page.count(attn + ".expanded") == 1
    assert page.count('.node[data-name="scaled_dot_product_attention"]') == 1
    page.click(attn + ".expanded .toggle")
    assert page.count(attn + ".collapsed") == 1
    assert page.count('.node[data-name="scaled_dot_product_attention"]') == 0

    # hovering a node shows its strategy, costs and memory; leaving hides it
    page.click("button.expand-all")
    node = gpt_plan.node("linear")
    page.hover('.node[data-name="linear"]')
    shown, text = tooltip(page)
    assert shown and node.strategy in text and "compute" in text and "memory" in text, text
    page.mouse("mouseMoved", 2, 2)
    assert tooltip(page)[0] is False
    # hovering a collapsed group summarises it
    page.click("button.collapse-all")
    page.hover('.module-group.collapsed[data-path="blocks.1"]')
    shown, text = tooltip(page)
    assert shown and "blocks.1" in text and "ops" in text, text
    # colouring by the other mesh axis redraws without errors
    page.eval("(() => { const s = document.getElementById('color-axis'); s.value = '1'; "
              "s.dispatchEvent(new Event('change')); })()")
    assert page.count("#graph .node") > 5
    page._drain()
    assert page.errors == [], page.errors

    png = page.screenshot(tmp_path / "viz.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    if os.environ.get("AUTOPAR_DOCS_SCREENSHOT"):
        obj = gpt_plan.to_json()
        obj["model"]["source"] = "examples/gpt.py:demo"  # as the README's compile command names it
        page = open_page(browser, tmp_path, [Plan.from_json(obj)], "readme.html")
        page.click('.module-group[data-path="blocks.0.attn"] .toggle')
        page.mouse("mouseMoved", 2, 2)
        page.eval("window.scrollTo(0, 0); document.querySelector('.graph-wrap').scrollTop = 0")
        os.makedirs(os.path.join(ROOT, "docs", "img"), exist_ok=True)
        page.screenshot(os.path.join(ROOT, "docs", "img", "viz.png"))


def _stage_order(page, stage: int) -> str:
    return page.eval(f"""[...document.querySelectorAll('#schedule .sched-op[data-stage="{stage}"]')]
        .sort((a, b) => parseFloat(a.dataset.start) - parseFloat(b.dataset.start))
        .map(e => e.dataset.type).join('')""")


def _no_overlap(page) -> bool:
    return page.eval("""(() => { const by = {};
        for (const e of document.querySelectorAll('#schedule .sched-op rect')) {
          const s = e.parentNode.dataset.stage; (by[s] = by[s] || []).push([+e.getAttribute('x'), +e.getAttribute('width')]); }
        return Object.values(by).every(xs => { xs.sort((a, b) => a[0] - b[0]);
          return xs.every((x, i) => i === 0 || xs[i - 1][0] + xs[i - 1][1] <= x[0] + 1e-6); }); })()""")


@needs_chromium
@pytest.mark.parametrize("schedule, virtual, per_chunk, order0, order1", [
    ("1f1b", 1, False, "FFBFBFBB", "FBFBFBFB"),   # stage 0: one warmup forward, steady 1F1B, one cooldown backward
    ("gpipe", 1, False, "FFFFBBBB", "FFFFBBBB"),  # all forwards, then all backwards
    ("interleaved-1f1b", 2, False, None, None),
    # stage 0 warms up with 2(p-1) + (v-1)p = 4 forwards (Megatron-LM), then F B pairs, then the backwards
    ("interleaved-1f1b", 2, True, "FFFFFBFBFBFBBBBB", None),
])
def test_pipelined_plan_page_draws_the_schedule(browser, gpt_plan, tmp_path, schedule, virtual, per_chunk,
                                                order0, order1):
    plan = with_pipeline(gpt_plan, schedule, microbatches=4, virtual=virtual, per_chunk=per_chunk)
    page = open_page(browser, tmp_path, [plan], f"pipe-{schedule}-{per_chunk}.html")
    assert page.count("#schedule .sched-op") == 2 * 4 * 2 * virtual  # stages x microbatches x (F, B) x chunks
    assert page.count("#schedule .warn") == 0
    assert _no_overlap(page)
    if order0:
        assert _stage_order(page, 0) == order0
    if order1:
        assert _stage_order(page, 1) == order1
    # the last stage runs a microbatch's backward only after its forward
    first_b = page.eval("""Math.min(...[...document.querySelectorAll('#schedule .sched-op[data-stage="1"][data-type="B"]')]
                            .map(e => +e.dataset.start))""")
    first_f = page.eval("""Math.min(...[...document.querySelectorAll('#schedule .sched-op[data-stage="1"][data-type="F"]')]
                            .map(e => +e.dataset.start))""")
    assert first_b > first_f
    assert page.count("#memory-chart .mem-row") == 3  # peak breakdown + one row per stage
    group = "document.querySelector('.module-group[data-path=\"%s\"]').textContent"
    assert "stage 0" in page.eval(group % "tok")
    assert "stage 1" in page.eval(group % "head")
    page.hover("#schedule .sched-op")
    shown, text = tooltip(page)
    assert shown and "microbatch" in text
    page._drain()
    assert page.errors == [], page.errors
    page.screenshot(tmp_path / f"pipe-{schedule}-{per_chunk}.png")


@needs_chromium
def test_two_plans_side_by_side(browser, gpt_plan, tmp_path):
    other = _compile("gpt.py:demo", 4)
    page = open_page(browser, tmp_path, [gpt_plan, other], "cmp.html", labels=["2x2", "4"])
    assert page.count("#compare") == 1
    assert page.count("#plan-0 #graph .node") > 0 and page.count("#plan-1 #graph-1 .node") > 0
    assert page.count("#memory-chart-1 .mem-seg") >= 4
    text = page.eval("document.getElementById('compare').textContent")
    assert "step time" in text and "2x2" in text
    # panels sit next to each other
    x0, x1 = page.eval("[document.getElementById('plan-0').getBoundingClientRect().x, "
                       "document.getElementById('plan-1').getBoundingClientRect().x]")
    assert x1 > x0 + 300
    page.screenshot(tmp_path / "cmp.png")


def test_offloaded_plan_page_says_what_lives_on_the_host(browser, tmp_path):
    """A plan that keeps optimizer state in host memory (tests/test_offload.py's
    budget): the memory card states the host memory it takes, and the
    parameter table marks each offloaded parameter."""
    source = f"{ROOT}/examples/gpt.py:small"
    model, inputs, loss_fn = load_factory(source)
    plan = autopar.compile(model, inputs, mesh=4, cluster=f"{ROOT}/tests/fixtures/hostnet.json", loss_fn=loss_fn,
                           source=source, memory=8e5)
    offloaded = [k for k, p in plan.parameters.items() if p.get("offload")]
    assert offloaded
    page = open_page(browser, tmp_path, [plan], "offload.html")
    text = page.eval("document.querySelector('#memory-chart .host-memory').textContent")
    assert "of offloaded optimizer state" in text and f"({len(offloaded)} parameters)" in text
    marked = page.eval("[...document.querySelectorAll('#param-table td.offload')]"
                       ".map(td => td.parentElement.dataset.fqn)")
    assert sorted(marked) == sorted(offloaded)


@needs_chromium
def test_dynamic_plan_page_draws_step_time_against_the_symbol(browser, tmp_path):
    """A plan compiled for batch 4..24 (step 4) under a memory budget that binds
    (tests/test_dynamic.py's): one line per piece over its sizes, each
    hoverable with its plan and, from the second on, why it starts there;
    the page embeds the pieces' curves, not their whole plans."""
    source = f"{ROOT}/examples/gpt.py:small"
    model, inputs, loss_fn = load_factory(source)
    plan = autopar.compile(model, inputs, mesh=4, cluster="cpu", loss_fn=loss_fn, source=source, memory=8e6,
                           dynamic={"batch": (4, 24, 4)})
    pieces = plan.dynamic["pieces"]
    assert len(pieces) >= 2
    page = open_page(browser, tmp_path, [plan], "dynamic.html")
    assert page.count("#sizes-chart .size-piece") == len(pieces)
    xs = page.eval("[...document.querySelectorAll('#sizes-chart .size-piece')].map(g => g.dataset.piece)")
    assert sorted(map(int, xs)) == list(range(len(pieces)))
    page.hover("#sizes-chart .size-piece[data-piece='1'] polyline")
    shown, text = tooltip(page)
    assert shown and pieces[1]["where"] in text and "the plan below would take" in text
    embedded = page.eval("JSON.parse(document.getElementById('autopar-data').textContent).plans[0].dynamic.pieces")
    assert all("plan" not in p for p in embedded)


# --------------------------------------------------------------------------- page without a browser

def test_viz_cli_writes_one_self_contained_file(gpt_plan, tmp_path, capsys):
    a = tmp_path / "a.json"
    gpt_plan.save(str(a))
    out = tmp_path / "out" / "plan.html"
    assert viz_main([str(a), "-o", str(out)]) == 0
    page = out.read_text()
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    assert '"schema":"autopar.plan/2"' in page
    assert viz_main([str(tmp_path / "missing.json"), "-o", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_plan_text_cannot_break_the_page(gpt_plan, tmp_path):
    obj = gpt_plan.to_json()
    obj["warnings"] = ["</script><script>alert(1)</script>"]
    obj["predicted"]["mfu"] = float("inf")  # not JSON: written as null
    page = open(render_html([Plan.from_json(obj)], str(tmp_path / "x.html"))).read()
    assert page.count("</script>") == 2  # the data block's and the code's
    data = page.split('id="autopar-data">', 1)[1].split("</script>", 1)[0]
    assert '"mfu":null' in data and "Infinity" not in data and "NaN" not in data


# --------------------------------------------------------------------------- diff

def test_layout_is_mesh_independent():
    assert layout("S(0)S(0)", (2, 2)) == layout("S(0)", (4,))
    assert layout("S(0)R", (2, 2)) != layout("S(0)", (4,))
    assert layout("PR", (2, 2)) == (((), 2, 2))


def test_diff_of_one_model_on_two_meshes_reports_placements(mlp_plans):
    a, b = mlp_plans
    d = diff_plans(a, b)
    assert d["same_model"] and not d["same_mesh"]
    changed = {p["fqn"]: p for p in d["parameters"]}
    assert changed, "plans on a 4-mesh and a 2x2 mesh must write different placements"
    for fqn, p in changed.items():
        assert p["a"] == a.parameters[fqn]["placements"] and p["b"] == b.parameters[fqn]["placements"]
        assert len(p["a"]) == 1 and len(p["b"]) == 2
    assert d["predicted"]["step_time_s"]["delta"] == pytest.approx(
        b.predicted["step_time_s"] - a.predicted["step_time_s"])
    text = format_diff(d, all_rows=True)
    for fqn in changed:
        assert fqn in text
    assert "where the step-time difference comes from" in text or not d["sources"]


def test_diff_finds_a_moved_parameter_and_prices_it(mlp_plans):
    a, _ = mlp_plans
    fqn = "layers.0.weight"
    pin = ["R"] if a.parameters[fqn]["placements"] != ["R"] else ["S(0)"]
    model, inputs, loss = load_factory(f"{ROOT}/examples/mlp.py:small")
    b = autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss, parameter_placements={fqn: pin})
    d = diff_plans(a, b)
    moved = [p for p in d["parameters"] if p["layout_changed"]]
    assert fqn in [p["fqn"] for p in moved]
    assert d["predicted"]["step_time_s"]["delta"] >= 0  # the solver's own choice was no worse
    assert sum(s["delta_s"] for s in d["sources"]) == pytest.approx(d["predicted"]["step_time_s"]["delta"], abs=1e-9)
    text = format_diff(d)
    for c in d["parameter_classes"]:  # a class of one is named by its parameter, not as if every layer moved
        label = c["fqns"][0] if c["count"] == 1 else f"{c['class']} (x{c['count']})"
        assert f"\n  {label} " in text, label
    assert any(fqn in c["fqns"] for c in d["parameter_classes"] if c["layout_changed"])


def test_diff_of_a_plan_with_itself_is_empty(mlp_plans, tmp_path, capsys):
    a, _ = mlp_plans
    d = diff_plans(a, a)
    assert d["parameters"] == [] and d["nodes"] == [] and d["sources"] == []
    # every class ties at 0: the rows come in name order, not the order of a string set
    rows = [r["class"] for r in d["by_layer_class"]]
    assert rows == sorted(rows) and len(rows) > 2
    a.save(str(tmp_path / "a.json"))
    assert diff_main([str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert "0 of" in capsys.readouterr().out
    assert diff_main([str(tmp_path / "a.json"), str(tmp_path / "nope.json")]) == 2


# --------------------------------------------------------------------------- explain

def test_explain_lists_candidates_cheapest_first_with_the_chosen_marked(mlp_plans):
    plan, _ = mlp_plans
    for target in ("layers.0.weight", next(n.name for n in plan.nodes if n.op == "linear")):
        e = explain_node(plan, target)
        assert e.candidates[0].chosen, [(c.strategy, c.total_s, c.chosen) for c in e.candidates]
        assert sum(c.chosen for c in e.candidates) == 1
        assert all(isinstance(c.total_s, float) and c.total_s >= 0 for c in e.candidates)
        assert [c.total_s for c in e.candidates] == sorted(c.total_s for c in e.candidates)
        assert e.chosen.strategy == plan.node(e.node).strategy
    text = explain(plan, "layers.0.weight")
    assert "* " in text and "next best" in text or "only candidate" in text


def test_explain_says_where_a_parameters_gradient_sync_runs(gpt_plan):
    """A parameter whose gradient is reduced gets a line with the step's
    gradient-sync total and how much of it the plan leaves exposed; on a
    cluster that does not overlap them (gloo CPU ranks), that they wait for
    backward's end."""
    synced = next(c["tensor"] for c in gpt_plan.collectives if c["gradient_sync"])
    pred = gpt_plan.predicted
    text = explain(gpt_plan, synced)
    total, exposed = fmt_s(pred["grad_sync_s"]), pred["grad_sync_exposed_s"]
    assert f"gradient sync: under the backward still to come; the step's {total} of them " in text
    assert ("all hidden" in text) == (exposed == 0)
    plain = Plan.from_json(dict(copy.deepcopy(gpt_plan.to_json()),
                                cluster=dict(gpt_plan.cluster, overlap_grad_sync=False)))
    assert "gradient sync: after backward (this cluster does not overlap them)" in explain(plain, synced)
    assert "gradient sync:" not in explain(gpt_plan, "linear")


def test_explain_says_a_zero3_parameters_forward_gather_is_prefetched():
    """A ZeRO-3 parameter (pinned "S(0) regather") is explained as the ZeRO-3 candidate it is (the plan keeps
    the flag in its parameters, not in the node's strategy), with a line with the step's prefetched forward gathers and
    how much of them the plan leaves exposed; on a cluster that does not overlap collectives, that they are
    priced whole; a replicated parameter gets none."""
    pins = {f"layers.{i}.{w}": ["S(0)", "regather"] for i in range(2) for w in ("weight", "bias")}
    plan = _compile("mlp.py:small", 4, parameter_placements=pins)
    pred = plan.predicted
    assert 0 < pred["prefetched_gather_exposed_s"] < pred["prefetched_gather_s"]
    assert str(explain_node(plan, "layers.1.weight").chosen.strategy) == "() -> S(0) regather"  # from parameters
    text = explain(plan, "layers.1.weight")
    assert (f"forward gather (ZeRO-3): started where the module before it is gathered, under the compute in "
            f"between; the step's {fmt_s(pred['prefetched_gather_s'])} of them "
            f"{fmt_s(pred['prefetched_gather_exposed_s'])} exposed") in text, text
    plain = Plan.from_json(dict(copy.deepcopy(plan.to_json()), cluster=dict(plan.cluster, overlap_grad_sync=False)))
    assert "does not overlap collectives with compute: priced whole" in explain(plain, "layers.1.weight")
    assert "forward gather" not in explain(_compile("mlp.py:small", 4), "layers.1.weight")


def test_explain_prices_the_chosen_strategy_as_the_plan_does(gpt_plan):
    e = explain_node(gpt_plan, "linear")
    assert e.runner_up.total_s >= e.chosen.total_s
    # A reshard that several consumers want is run once (the plan lists it
    # under its first consumer): every node's outgoing collectives in explain
    # are exactly the plan's on edges from that node, each shared one once.
    graph = capture_plan_model(gpt_plan)
    read = kept_outputs(graph)[1]
    shared = 0
    for node in gpt_plan.nodes:
        chosen = explain_node(gpt_plan, node.name, graph=graph).chosen
        if node.op not in ("param", "buffer"):  # a parameter's compute is its optimizer update here
            assert chosen.compute_s == pytest.approx(node.compute_s), node.name
        # the plan counts a tensor kept for several consumers at its first
        # consumer; explain at none of them (it is kept whatever this node
        # chooses), and a producer's own tensor at the producer
        if all(t.paid for t in chosen.transfers) and node.name not in read \
                and not read.intersection(node.inputs):
            assert chosen.memory_bytes == pytest.approx(node.memory_bytes), node.name
        listed = [c for c in gpt_plan.collectives if c["producer"] == node.name]
        assert chosen.comm_out_s == pytest.approx(sum(c["seconds"] for c in listed), abs=1e-12), node.name
        shared += sum(1 for t in chosen.transfers if t.direction == "out" and t.shared_with)
    assert shared > 0, "the demo plan has reshards shared by two consumers (the residual adds' outputs)"


def test_explain_does_not_charge_a_reshard_another_consumer_runs_anyway(gpt_plan):
    """An input reshard that another planned consumer of the producer wants
    too is run by the plan anyway: it costs this node nothing."""
    graph = capture_plan_model(gpt_plan)
    free = []
    for node in gpt_plan.nodes:
        for t in explain_node(gpt_plan, node.name, graph=graph).chosen.transfers:
            if t.direction == "in" and not t.paid:
                assert t.shared_with and t.neighbour in gpt_plan.node(node.name).inputs
                free.append(t)
    assert free, "the demo plan has consumers sharing an input reshard"
    assert "which the plan runs anyway: not counted" in str(free[0])


def test_explain_prices_a_pipelined_plans_nodes_as_their_stage_did():
    """A pipelined plan's nodes were solved per stage, one microbatch on the
    submesh without the pp axis; explain prices them so (it refused them,
    and before that blamed a changed model): every node's chosen candidate is
    its planned strategy, at the plan's compute and the plan's collectives on
    its edges, all but the sends between stages, which no node chooses."""
    fastnet = os.path.join(ROOT, "tests", "fixtures", "fastnet.json")
    source = f"{ROOT}/examples/gpt.py:small"
    model, inputs, loss_fn = load_factory(source)
    plan = autopar.compile(model, inputs, mesh="pp=2,tp=2", cluster=fastnet, loss_fn=loss_fn, microbatches=4,
                           source=source)
    assert plan.pipeline and any("S(" in n.strategy for n in plan.nodes), "the stages split something over tp"
    graph = capture_plan_model(plan)  # the microbatch's graph, checked against the plan's fingerprint
    for node in plan.nodes:
        e = explain_node(plan, node.name, graph=graph)
        assert e.stage == "tp=2" and e.chosen.compute_s == pytest.approx(node.compute_s), node.name
        listed = [c for c in plan.collectives if c["producer"] == node.name and c["kind"] != "send_recv"]
        assert e.chosen.comm_out_s == pytest.approx(sum(c["seconds"] for c in listed), abs=1e-15), node.name
    text = explain(plan, "blocks.0.attn.q.weight", graph=graph)
    assert "pipelined: priced as its stage's ILP priced it, one microbatch on the submesh tp=2" in text
    assert "gradient sync: under the backward" not in text  # a stage syncs once a step, after the microbatches


def test_explain_unknown_target_suggests_close_names(mlp_plans, tmp_path, capsys):
    plan, _ = mlp_plans
    with pytest.raises(AutoparError, match="did you mean .*layers.0.weight"):
        explain(plan, "layers.0.wieght")
    plan.save(str(tmp_path / "p.json"))
    assert explain_main([str(tmp_path / "p.json"), "nonsense_node_name"]) == 2
    assert "no node or parameter" in capsys.readouterr().err


def test_explain_needs_the_plans_model(mlp_plans):
    plan, _ = mlp_plans
    obj = plan.to_json()
    obj["model"]["source"] = None
    with pytest.raises(PlanError, match="does not name its model"):
        explain(Plan.from_json(obj), "layers.0.weight")

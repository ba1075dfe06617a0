"""``autopar viz``: a plan (or two, side by side) as one self-contained HTML page.

The page embeds the plan JSON and draws everything from it with inline
JavaScript (SVG and DOM, no libraries, no network; the template, style sheet
and script live in autopar/viz_assets/ and are inlined): the model graph grouped
and collapsible by module path, coloured by output placement per mesh axis,
with hover details; the parameter placement table; the device mesh over the
cluster; memory per device against capacity; communication by phase and mesh
axis; the pipeline schedule as a Gantt chart when the plan has stages; and the
predicted step-time breakdown and MFU. With two plans, a comparison
(``autopar.plandiff``) heads the page and nodes whose strategy differs are
outlined in both graphs.

Stable hooks for tests and scripts: ``#tooltip``; per plan panel
``#plan-<i>`` holding ``#graph``, ``#param-table``, ``#mesh-view``,
``#memory-chart``, ``#comm-chart``, ``#schedule``, ``#breakdown`` and, for a
plan compiled for a range of sizes, ``#sizes-chart`` (predicted step time
against the symbol, one line per piece, its boundaries marked;
``.size-piece[data-piece]``) (ids of the second panel end in ``-1``); graph elements ``.node[data-name]`` and
``.module-group[data-path]`` (``.expanded`` / ``.collapsed``) with a
``.toggle``; schedule cells ``.sched-op[data-stage][data-type][data-mb]``.
"""
from __future__ import annotations

import argparse
import html
from importlib import resources
import json
import math
import os
import sys

from autopar.errors import AutoparError
from autopar.outputs import check_file, write_text
from autopar.plan import Plan


def page_data(plans: list[Plan], labels: list[str]) -> dict:
    """What the page's script reads: the plans as JSON, their labels, and the diff of two. A dynamic
    plan's pieces come as their predicted step over the sizes (``sizes``), without their whole plans."""
    data = {"plans": [dict(_embedded(p), label=label) for p, label in zip(plans, labels)], "diff": None}
    if len(plans) == 2:
        from autopar.plandiff import diff_plans
        data["diff"] = diff_plans(plans[0], plans[1])
    return data


def _embedded(plan: Plan) -> dict:
    obj = plan.to_json()
    if plan.dynamic:
        from autopar.dynamic.explain import curve_points
        obj["sizes"] = curve_points(plan)
        obj["dynamic"] = {**plan.dynamic, "pieces": [{k: v for k, v in p.items() if k != "plan"}
                                                      for p in plan.dynamic["pieces"]]}
    return obj


def _finite(obj):
    """JSON has no inf/NaN (a browser's JSON.parse rejects them): write null instead."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def render_html(plans: list[Plan], path: str, *, labels: list[str] | None = None, title: str | None = None) -> str:
    """Write the visualizer page for one plan, or two side by side, to ``path``; returns ``path``."""
    plans = list(plans)
    if not 1 <= len(plans) <= 2:
        raise AutoparError(f"the visualizer shows one plan or compares two; got {len(plans)}")
    labels = list(labels) if labels else (["plan"] if len(plans) == 1 else ["A", "B"])
    if len(labels) != len(plans):
        raise AutoparError(f"{len(labels)} labels for {len(plans)} plans")
    blob = json.dumps(_finite(page_data(plans, labels)), separators=(",", ":"), allow_nan=False, default=str)
    # inside <script> only "</" can end the element early; "<\/" is the same JSON string
    blob = blob.replace("</", "<\\/").replace("<!--", "<\\!--")
    title = title or "autopar plan: " + " vs ".join(
        f"{p.model.get('source') or 'model'} on {'x'.join(map(str, p.mesh.shape))}" for p in plans)
    page = (_asset("page.html").replace("@TITLE@", html.escape(title)).replace("@CSS@", _asset("style.css"))
            .replace("@DATA@", blob).replace("@JS@", _asset("app.js")))
    write_text(path, page)
    return path


def is_page(text: str) -> bool:
    """Whether ``text`` (an existing file) is a page this visualizer wrote."""
    return text.startswith("<!DOCTYPE html>") and '<header id="page-header">' in text and '<main id="app">' in text


def _asset(name: str) -> str:
    """The page's template, style sheet or script (autopar/viz_assets/), inlined into every page."""
    return (resources.files("autopar") / "viz_assets" / name).read_text(encoding="utf-8")


def viz_main(argv=None) -> int:
    """``autopar viz a.json [b.json] -o plan.html``."""
    ap = argparse.ArgumentParser(prog="autopar viz",
                                 description="Write a self-contained HTML page showing a plan, or two side by side")
    ap.add_argument("plans", nargs="+", metavar="PLAN", help="one plan.json, or two to compare")
    ap.add_argument("-o", "--output", default="plan.html", help="HTML file to write (default plan.html)")
    ap.add_argument("--title", help="page title")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if len(args.plans) > 2:
            raise AutoparError(f"give one plan, or two to compare; got {len(args.plans)}")
        check_file(args.output, "viz -o", is_page, "a page autopar viz wrote")
        plans = [Plan.load(p) for p in args.plans]
        labels = [os.path.basename(p) for p in args.plans]
        if len(set(labels)) < len(labels):
            labels = list(args.plans)
        render_html(plans, args.output, labels=labels, title=args.title)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"autopar: error: cannot write {args.output}: {e.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({os.path.getsize(args.output) / 1024:.0f} KiB); open it in a browser")
    return 0


"use strict";
(function () {
const DATA = JSON.parse(document.getElementById("autopar-data").textContent);
const SVGNS = "http://www.w3.org/2000/svg";
const PHASES = ["forward", "backward", "recompute", "optimizer"];
const KIND_COLORS = {all_reduce: "#4e79a7", all_gather: "#59a14f", reduce_scatter: "#f28e2b",
                     all_to_all: "#b07aa1", send_recv: "#76b7b2"};
const MEM_KINDS = [["parameters", "#4e79a7"], ["gradients", "#f28e2b"], ["optimizer", "#e15759"],
                   ["activations", "#59a14f"], ["inputs", "#b07aa1"]];
const SHARD_COLORS = ["#9ecae9", "#a1d99b", "#d4b9da", "#fdd49e", "#c7e9c0", "#bcbddc", "#fcbba1"];
const AXIS_COLORS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00"];
const STAGE_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"];

// ---------------------------------------------------------------- helpers
function el(tag, attrs, parent, text) {
  const e = document.createElement(tag);
  for (const k in (attrs || {})) e.setAttribute(k, attrs[k]);
  if (text !== undefined && text !== null) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function sv(tag, attrs, parent, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const k in (attrs || {})) e.setAttribute(k, attrs[k]);
  if (text !== undefined && text !== null) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function fmtS(s) {
  if (s === null || s === undefined || isNaN(s)) return "-";
  const a = Math.abs(s);
  if (a >= 1) return s.toFixed(3) + " s";
  if (a >= 1e-3) return (s * 1e3).toFixed(3) + " ms";
  return (s * 1e6).toFixed(1) + " us";
}
function fmtB(n) {
  if (n === null || n === undefined || isNaN(n)) return "-";
  const a = Math.abs(n);
  if (a >= 2 ** 30) return (n / 2 ** 30).toFixed(2) + " GiB";
  if (a >= 2 ** 20) return (n / 2 ** 20).toFixed(2) + " MiB";
  if (a >= 2 ** 10) return (n / 2 ** 10).toFixed(2) + " KiB";
  return n.toFixed(0) + " B";
}
function fmtPct(x) { return x > 0 && x < 0.001 ? "<0.1%" : (100 * x).toFixed(1) + "%"; }
function clip(s, n) { s = String(s); return s.length > n ? s.slice(0, n - 1) + "\u2026" : s; }
function parseSpec(spec) { return String(spec || "").match(/S\(\d+\)|P\([a-z]+\)|P|R/g) || []; }
function placementColor(p) {
  if (!p || p === "R") return "#e8eaed";
  if (p[0] === "P") return "#fdae6b";
  const d = parseInt(p.slice(2), 10);
  return SHARD_COLORS[d % SHARD_COLORS.length];
}
function sum(xs) { let t = 0; for (const x of xs) t += x; return t; }
function card(parent, title, hint) {
  const c = el("div", {class: "card"}, parent);
  const h = el("h2", {}, c, title);
  if (hint) el("span", {class: "hint"}, h, hint);
  return c;
}

// ---------------------------------------------------------------- tooltip
const TIP = document.getElementById("tooltip");
function showTip(evt, title, rows) {
  TIP.textContent = "";
  el("div", {class: "t"}, TIP, title);
  const t = el("table", {}, TIP);
  for (const [k, v, mono] of rows) {
    const tr = el("tr", {}, t);
    el("td", {class: "k"}, tr, k);
    el("td", mono ? {class: "mono"} : {}, tr, v);
  }
  TIP.hidden = false;
  moveTip(evt);
}
function moveTip(evt) {
  if (TIP.hidden) return;
  const pad = 14, w = TIP.offsetWidth, h = TIP.offsetHeight;
  let x = evt.clientX + pad, y = evt.clientY + pad;
  if (x + w > window.innerWidth - 4) x = Math.max(4, evt.clientX - w - pad);
  if (y + h > window.innerHeight - 4) y = Math.max(4, evt.clientY - h - pad);
  TIP.style.left = x + "px";
  TIP.style.top = y + "px";
}
function hideTip() { TIP.hidden = true; }
function hoverable(node, fill) {
  node.addEventListener("mouseenter", (e) => { const [t, rows] = fill(); showTip(e, t, rows); });
  node.addEventListener("mousemove", moveTip);
  node.addEventListener("mouseleave", hideTip);
}

// ---------------------------------------------------------------- plan indexes
function indexPlan(plan) {
  const byNode = {}, byEdge = {};
  for (const c of plan.collectives) {
    (byNode[c.node] = byNode[c.node] || []).push(c);
    const k = c.producer + "\u2192" + c.node;
    (byEdge[k] = byEdge[k] || []).push(c);
  }
  const axes = plan.mesh.axis_names;
  return {byNode, byEdge, axes};
}
function commLines(cs) {
  return cs.map((c) => [c.phase, c.kind + " on " + c.mesh_axes.join(",") + " " + fmtB(c.bytes) + " " +
                        fmtS(c.seconds) + (c.gradient_sync ? " (gradient sync)" : ""), true]);
}

// ---------------------------------------------------------------- model graph
function splitPath(loc) {
  const out = [];
  for (const seg of String(loc || "").split(".")) {
    if (!seg) continue;
    if (/^\d+$/.test(seg) && out.length) out[out.length - 1] += "." + seg; else out.push(seg);
  }
  return out;
}
function moduleOf(n) {
  if (n.op === "param" || n.op === "buffer") {
    const i = n.location.lastIndexOf(".");
    return i < 0 ? "" : n.location.slice(0, i);
  }
  if (n.op === "input" || n.op === "output") return "";
  return n.location || "";
}
function buildTree(plan) {
  const root = {path: "", label: "model", depth: 0, children: [], nodes: [], parent: null, first: Infinity, all: []};
  const groups = {"": root};
  // placeholders (parameters, inputs) sit just before their first consumer, not at the top of the program
  const firstUse = {};
  plan.nodes.forEach((n, i) => { for (const src of n.inputs) if (!(src in firstUse)) firstUse[src] = i; });
  plan.nodes.forEach((n, i) => {
    const placeholder = ["param", "input", "buffer", "constant"].includes(n.op);
    n._index = placeholder && firstUse[n.name] !== undefined ? firstUse[n.name] - 0.5 : i;
    let g = root, path = "";
    for (const seg of splitPath(moduleOf(n))) {
      path = path ? path + "." + seg : seg;
      if (!groups[path]) {
        groups[path] = {path, label: seg, depth: g.depth + 1, children: [], nodes: [], parent: g, first: Infinity,
                        all: []};
        g.children.push(groups[path]);
      }
      g = groups[path];
    }
    g.nodes.push(n);
    n._group = g;
    for (let a = g; a; a = a.parent) { a.all.push(n); a.first = Math.min(a.first, n._index); }
  });
  return {root, groups};
}

const NW = 156, NH = 38, GW = 176, GH = 46, PAD = 10, HEAD = 24, HGAP = 14, VGAP = 26;

function Graph(plan, idx, container, controls, diffNames) {
  const tree = buildTree(plan);
  const ix = indexPlan(plan);
  const byName = {};
  for (const n of plan.nodes) byName[n.name] = n;
  const expanded = new Set([""]);
  const state = {axis: 0, showParams: true};
  // default: top-level modules open, except repeated layers after the first of their kind
  const seen = new Set();
  for (const g of tree.root.children) {
    const kind = g.path.replace(/\.\d+$/, "");
    if (kind !== g.path && seen.has(kind)) continue;
    seen.add(kind);
    expanded.add(g.path);
  }
  const stageOf = stageLookup(plan);

  function visible(n) { return state.showParams || n.op !== "param"; }
  function rep(n) {                       // the box that shows node n: itself or its outermost collapsed group
    let chain = [];
    for (let g = n._group; g; g = g.parent) chain.push(g);
    chain.reverse();
    for (const g of chain) if (!expanded.has(g.path)) return g;
    return n;
  }
  function groupVisible(g) { return g.all.some(visible); }

  function layout(g) {
    const items = [];
    for (const c of g.children) if (groupVisible(c)) items.push({kind: "group", g: c, first: c.first});
    for (const n of g.nodes) if (visible(n)) items.push({kind: "node", n: n, first: n._index});
    items.sort((a, b) => a.first - b.first || (a.kind === "group") - (b.kind === "group"));
    const itemOf = {};
    items.forEach((it, i) => {
      it.order = i;
      if (it.kind === "node") itemOf[it.n.name] = it;
      else for (const m of it.g.all) itemOf[m.name] = it;
      if (it.kind === "group" && expanded.has(it.g.path)) { const sz = layout(it.g); it.w = sz.w; it.h = sz.h; }
      else if (it.kind === "group") { it.w = GW; it.h = GH; }
      else { it.w = NW; it.h = NH; }
      it.layer = 0;
    });
    for (const it of items) {
      const members = it.kind === "node" ? [it.n] : it.g.all;
      for (const m of members) {
        if (!visible(m)) continue;
        for (const src of m.inputs) {
          const p = itemOf[src];
          if (p && p !== it && p.order < it.order && visible(byName[src])) it.layer = Math.max(it.layer, p.layer + 1);
        }
      }
    }
    const rows = [];
    for (const it of items) (rows[it.layer] = rows[it.layer] || []).push(it);
    let y = (g.parent ? HEAD : 4) + PAD, width = 0;
    const rowInfo = [];
    for (const row of rows) {
      if (!row) continue;
      const rw = sum(row.map((it) => it.w)) + HGAP * (row.length - 1);
      const rh = Math.max(...row.map((it) => it.h));
      rowInfo.push({row, rw, rh, y});
      width = Math.max(width, rw);
      y += rh + VGAP;
    }
    const w = Math.max(width + 2 * PAD, GW + 2 * PAD), h = y - VGAP + PAD;
    for (const {row, rw, rh, y: ry} of rowInfo) {
      let x = (w - rw) / 2;
      for (const it of row) { it.x = x; it.y = ry + (rh - it.h) / 2; x += it.w + HGAP; }
    }
    g._items = items;
    g._w = w; g._h = h;
    return {w, h};
  }
  function place(g, ox, oy) {
    g._abs = {x: ox, y: oy, w: g._w, h: g._h};
    for (const it of g._items) {
      const ax = ox + it.x, ay = oy + it.y;
      if (it.kind === "node") it.n._abs = {x: ax, y: ay, w: it.w, h: it.h};
      else if (expanded.has(it.g.path)) place(it.g, ax, ay);
      else it.g._abs = {x: ax, y: ay, w: it.w, h: it.h};
    }
  }

  function groupStats(g) {
    const ops = g.all.filter((n) => n.op !== "param" && n.op !== "buffer");
    const comm = [];
    for (const n of g.all) for (const c of (ix.byNode[n.name] || [])) comm.push(c);
    return {ops: ops.length, params: g.all.length - ops.length, compute: sum(g.all.map((n) => n.compute_s)),
            comm: sum(comm.map((c) => c.seconds)), commList: comm, memory: sum(g.all.map((n) => n.memory_bytes))};
  }

  function render() {
    hideTip();
    const size = layout(tree.root);
    place(tree.root, 0, 0);
    container.textContent = "";
    const svg = sv("svg", {width: size.w, height: size.h, viewBox: `0 0 ${size.w} ${size.h}`, class: "graph-svg"},
                   container);
    // layers, bottom to top: group frames, edges, group titles, boxes (so an edge never covers a title)
    const gFrames = sv("g", {class: "frames"}, svg);
    const gEdges = sv("g", {class: "edges"}, svg);
    const gHeads = sv("g", {class: "heads"}, svg);
    const gBoxes = sv("g", {class: "boxes"}, svg);
    drawGroup(tree.root, {frames: gFrames, heads: gHeads, boxes: gBoxes});
    // edges between the visible boxes
    const drawn = {};
    for (const n of plan.nodes) {
      if (!visible(n)) continue;
      const rn = rep(n);
      for (const src of n.inputs) {
        const s = byName[src];
        if (!s || !visible(s)) continue;
        const rs = rep(s);
        if (rs === rn) continue;
        const key = (rs.path !== undefined ? "g:" + rs.path : rs.name) + "|" + (rn.path !== undefined ? "g:" + rn.path : rn.name);
        const cs = ix.byEdge[src + "\u2192" + n.name] || [];
        if (drawn[key]) { drawn[key].cs.push(...cs); continue; }
        drawn[key] = {rs, rn, cs: cs.slice(), label: src + " \u2192 " + n.name};
      }
    }
    for (const k in drawn) {
      const {rs, rn, cs, label} = drawn[k];
      const a = rs._abs, b = rn._abs;
      if (!a || !b) continue;
      const x1 = a.x + a.w / 2, y1 = a.y + a.h, x2 = b.x + b.w / 2, y2 = b.y;
      const dy = Math.max(30, Math.abs(y2 - y1) / 2);
      const path = sv("path", {d: `M${x1},${y1} C${x1},${y1 + dy} ${x2},${y2 - dy} ${x2},${y2}`,
                              class: "edge" + (cs.length ? " comm" : "")}, gEdges);
      if (cs.length) {
        hoverable(path, () => [label, [["collectives", String(cs.length)]].concat(commLines(cs))]);
      }
    }
  }

  function drawGroup(g, layers) {
    if (g.parent) {
      const a = g._abs;
      const st = stageOf(g.path);
      sv("rect", {class: "frame", "data-path": g.path, x: a.x, y: a.y, width: a.w, height: a.h, rx: 6,
                  fill: g.depth % 2 ? "#f6f8fa" : "#ffffff",
                  stroke: st !== null ? STAGE_COLORS[st % STAGE_COLORS.length] : "#8c959f",
                  "stroke-width": st !== null ? 2 : 1}, layers.frames);
      const grp = sv("g", {class: "module-group expanded", "data-path": g.path}, layers.heads);
      const tg = sv("g", {class: "toggle", role: "button", "aria-expanded": "true"}, grp);
      sv("rect", {x: a.x, y: a.y, width: a.w, height: HEAD, fill: "transparent"}, tg);
      sv("text", {class: "title", x: a.x + 8, y: a.y + 16}, tg,
         "\u25be " + g.path + (st !== null ? "   [stage " + st + "]" : ""));
      tg.addEventListener("click", (e) => { e.stopPropagation(); expanded.delete(g.path); render(); });
    }
    for (const it of g._items) {
      if (it.kind === "node") drawNode(it.n, layers.boxes);
      else if (expanded.has(it.g.path)) drawGroup(it.g, layers);
      else drawCollapsed(it.g, layers.boxes);
    }
  }

  function drawCollapsed(g, parent) {
    const a = g._abs, s = groupStats(g), st = stageOf(g.path);
    const grp = sv("g", {class: "module-group collapsed", "data-path": g.path}, parent);
    sv("rect", {class: "box", x: a.x, y: a.y, width: a.w, height: a.h, rx: 6,
                stroke: st !== null ? STAGE_COLORS[st % STAGE_COLORS.length] : "#57606a"}, grp);
    const tg = sv("g", {class: "toggle", role: "button", "aria-expanded": "false"}, grp);
    sv("rect", {x: a.x, y: a.y, width: a.w, height: a.h, fill: "transparent"}, tg);
    sv("text", {class: "title", x: a.x + 8, y: a.y + 17}, tg,
       clip("\u25b8 " + g.label, st !== null ? 16 : 26) + (st !== null ? "  [stage " + st + "]" : ""));
    sv("text", {class: "meta", x: a.x + 8, y: a.y + 33}, tg,
       clip(`${s.ops} ops \u00b7 ${fmtS(s.compute)}` + (s.comm ? ` \u00b7 comm ${fmtS(s.comm)}` : ""), 32));
    tg.addEventListener("click", (e) => { e.stopPropagation(); expanded.add(g.path); render(); });
    hoverable(grp, () => {
      const strategies = {};
      for (const n of g.all) if (n.op !== "param") strategies[n.strategy] = (strategies[n.strategy] || 0) + 1;
      const top = Object.entries(strategies).sort((x, y) => y[1] - x[1]).slice(0, 4)
        .map(([k, v]) => [v + "\u00d7", k, true]);
      return [g.path + "  (collapsed; click to expand)", [
        ["nodes", `${s.ops} ops, ${s.params} parameters`],
        ["compute", fmtS(s.compute) + " (fwd+bwd)"],
        ["communication", fmtS(s.comm) + ` in ${s.commList.length} collectives`],
        ["memory", fmtB(s.memory) + " per device"],
        ...(st !== null ? [["pipeline", "stage " + st]] : []),
        ...top]];
    });
  }

  function drawNode(n, parent) {
    const a = n._abs;
    const spec = parseSpec(n.output_spec);
    const cls = ["node"];
    if (n.op === "param") cls.push("param");
    if (n.op === "input" || n.op === "output") cls.push("io");
    if (diffNames && diffNames.has(n.name)) cls.push("diff");
    if ((ix.byNode[n.name] || []).length) cls.push("has-comm");
    const g = sv("g", {class: cls.join(" "), "data-name": n.name, "data-op": n.op}, parent);
    const fill = state.axis < spec.length ? placementColor(spec[state.axis]) : "#ffffff";
    sv("rect", {class: "box", x: a.x, y: a.y, width: a.w, height: a.h, rx: 4, fill}, g);
    // one stripe per mesh axis along the bottom: the output placement on that axis
    const sw = (a.w - 8) / Math.max(1, spec.length);
    spec.forEach((p, i) => {
      sv("rect", {class: "stripe", x: a.x + 4 + i * sw, y: a.y + a.h - 7, width: sw - 2, height: 4,
                  fill: placementColor(p), stroke: "#57606a", "stroke-width": 0.5}, g);
    });
    const title = n.op === "param" || n.op === "buffer" ? n.location.split(".").slice(-2).join(".") :
      n.op === "input" ? (n.location || n.name) : n.op;
    sv("text", {class: "op", x: a.x + 6, y: a.y + 14}, g, clip(title, 24));
    sv("text", {class: "spec", x: a.x + 6, y: a.y + 27}, g, clip("\u2192 " + n.output_spec, 26));
    hoverable(g, () => nodeTip(n));
  }

  function nodeTip(n) {
    const cs = ix.byNode[n.name] || [];
    const spec = parseSpec(n.output_spec);
    const rows = [
      ["op", n.op], ["location", n.location || "(top level)"],
      ["strategy", n.strategy, true],
      ["output", spec.map((p, i) => `${ix.axes[i]}: ${p}`).join("   "), true],
      ["compute", fmtS(n.compute_s) + " (fwd+bwd)"],
      ["communication", cs.length ? `${fmtS(sum(cs.map((c) => c.seconds)))} in ${cs.length} collectives`
                                  : "none on its inputs"],
      ["memory", fmtB(n.memory_bytes) + " per device"],
      ["candidates", String(n.candidates)]];
    if (n.op === "param" && plan.parameters[n.location]) {
      const p = plan.parameters[n.location];
      rows.push(["shape", p.shape.join("\u00d7") + " \u2192 local " + p.local_shape.join("\u00d7")]);
    }
    if (diffNames && diffNames.has(n.name)) rows.push(["compare", "strategy differs in the other plan"]);
    return [n.name, rows.concat(commLines(cs))];
  }

  // controls
  const sel = el("select", {class: "color-axis", id: "color-axis" + (idx ? "-" + idx : "")}, null);
  ix.axes.forEach((a, i) => el("option", {value: String(i)}, sel, "colour by axis " + a));
  el("option", {value: "-1"}, sel, "stripes only");
  sel.addEventListener("change", () => { state.axis = parseInt(sel.value, 10); render(); });
  const lab = el("label", {}, controls, "");
  lab.appendChild(sel);
  const bAll = el("button", {type: "button", class: "expand-all"}, controls, "expand all");
  bAll.addEventListener("click", () => { for (const p in tree.groups) expanded.add(p); render(); });
  const bNone = el("button", {type: "button", class: "collapse-all"}, controls, "collapse all");
  bNone.addEventListener("click", () => { expanded.clear(); expanded.add(""); render(); });
  const pl = el("label", {}, controls, "");
  const cb = el("input", {type: "checkbox", class: "show-params", checked: "checked"}, pl);
  pl.appendChild(document.createTextNode(" parameters"));
  cb.addEventListener("change", () => { state.showParams = cb.checked; render(); });
  render();
  return {render, expanded, tree};
}

// The pipeline's physical stages. A plan lists either one entry per stage (its time_s covering all of its
// virtual_stages chunks), or one entry per model chunk (p x v entries; chunk c runs on the devices of stage c % p).
function pipelineStages(pipe) {
  if (!pipe || !pipe.stages || !pipe.stages.length) return null;
  const v = Math.max(1, pipe.virtual_stages || 1);
  const entries = pipe.stages.slice().sort((a, b) => a.index - b.index);
  const p = entries.length / v;
  const key = (e) => (e.devices || []).join(",");
  const perChunk = v > 1 && Number.isInteger(p) && p >= 1 && entries.every((e, c) => key(e) === key(entries[c % p]));
  const stages = [];
  if (perChunk) {
    for (let s = 0; s < p; s++) {
      const chunks = [];
      for (let c = 0; c < v; c++) chunks.push(entries[c * p + s]);
      stages.push({index: s, devices: entries[s].devices || [], memory_bytes: entries[s].memory_bytes || 0,
                   layers: [].concat(...chunks.map((e) => e.layers || [])),
                   chunks: chunks.map((e) => ({time_s: e.time_s || 0, forward_s: e.forward_s, backward_s: e.backward_s,
                                               layers: e.layers || [], entry: e.index}))});
    }
  } else {
    entries.forEach((e, s) => {
      const chunks = [];
      for (let c = 0; c < v; c++) {
        chunks.push({time_s: (e.time_s || 0) / v, forward_s: e.forward_s !== undefined ? e.forward_s / v : undefined,
                     backward_s: e.backward_s !== undefined ? e.backward_s / v : undefined, layers: e.layers || [],
                     entry: e.index});
      }
      stages.push({index: s, devices: e.devices || [], memory_bytes: e.memory_bytes || 0, layers: e.layers || [],
                   chunks});
    });
  }
  return {stages, v, m: Math.max(1, pipe.microbatches || 1), kind: String(pipe.schedule || "1f1b").toLowerCase()};
}

function stageLookup(plan) {
  const ps = pipelineStages(plan.pipeline);
  if (!ps) return () => null;
  return (path) => {
    if (!path) return null;
    for (const s of ps.stages) {
      for (const c of s.chunks) {
        for (const l of c.layers) if (path === l || path.startsWith(l + ".")) return s.index;
      }
    }
    return null;
  };
}

function placementLegend(parent, plan) {
  const lg = el("div", {class: "legend"}, parent);
  const used = new Set();
  for (const n of plan.nodes) for (const p of parseSpec(n.output_spec)) used.add(p.startsWith("P") ? "P" : p);
  const order = Array.from(used).sort();
  for (const p of order) {
    const s = el("span", {}, lg);
    el("span", {class: "sw", style: "background:" + placementColor(p)}, s);
    s.appendChild(document.createTextNode(p === "R" ? "R replicated" : p === "P" ? "P partial sum" :
                                          p + " split on dim " + p.slice(2, -1)));
  }
  const e = el("span", {}, lg);
  el("span", {class: "sw", style: "background:#cf222e;height:3px;border:0"}, e);
  e.appendChild(document.createTextNode("edge with resharding"));
  el("span", {}, lg, "stripes: output placement on each mesh axis (" + plan.mesh.axis_names.join(", ") + ")");
  return lg;
}

// ---------------------------------------------------------------- breakdown
function drawBreakdown(parent, plan) {
  const p = plan.predicted;
  const k = el("div", {class: "kpis"}, parent);
  const kpi = (l, v) => { const d = el("div", {class: "kpi"}, k); el("div", {class: "v"}, d, v); el("div", {class: "l"}, d, l); };
  kpi("step time", fmtS(p.step_time_s));
  kpi("MFU", fmtPct(p.mfu || 0));
  kpi("compute", fmtS(p.compute_s));
  kpi("communication", fmtS(p.comm_s));
  kpi("bubble", fmtS(p.bubble_s || 0));
  kpi("peak memory / device", fmtB(p.peak_memory_bytes));
  const bar = el("div", {class: "breakdown-bar"}, parent);
  const parts = [["compute", p.compute_s, "#4e79a7"], ["communication", p.comm_s, "#e15759"],
                 ["bubble", p.bubble_s || 0, "#8c959f"], ["optimizer", p.optimizer_s || 0, "#59a14f"]];
  const total = Math.max(1e-30, sum(parts.map((x) => x[1])));
  for (const [name, v, c] of parts) {
    if (!(v > 0)) continue;
    const r = el("div", {class: "seg", "data-part": name, style: `flex-grow:${v / total};background:${c}`}, bar,
                 v / total > 0.12 ? `${name} ${fmtPct(v / total)}` : "");
    hoverable(r, () => [name, [["time", fmtS(v)], ["share of step", fmtPct(v / total)]]]);
  }
  el("div", {class: "muted"}, parent,
     `step ${fmtS(p.step_time_s)} = compute ${fmtS(p.compute_s)} + communication ${fmtS(p.comm_s)} + ` +
     `bubble ${fmtS(p.bubble_s || 0)}` + (p.optimizer_s ? ` + optimizer ${fmtS(p.optimizer_s)}` : "") +
     `; MFU = model FLOPs / (step time × devices × peak FLOP/s)`);
  const sol = plan.solver || {};
  el("div", {class: "muted"}, parent,
     `solver ${sol.backend || ""} ${sol.status || ""}: ${sol.variables} variables, ${sol.constraints} constraints, ` +
     `${(sol.wall_s || 0).toFixed(2)} s`);
}

// ---------------------------------------------------------------- sizes (a dynamic plan)
function drawSizes(parent, view) {
  // predicted step time against the symbol: one polyline per piece, a dashed line where a piece starts
  const W = 760, H = 300, L = 64, R = 12, T = 12, B = 40;
  const pieces = view.pieces;
  const xs = [].concat(...pieces.map((p) => p.x)), ys = [].concat(...pieces.map((p) => p.step_s));
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y1 = Math.max(...ys) * 1.05;
  const sx = (x) => L + (W - L - R) * (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0));
  const sy = (y) => T + (H - T - B) * (1 - y / y1);
  const svg = sv("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "sizes"}, parent);
  sv("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#8c959f"}, svg);
  sv("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#8c959f"}, svg);
  for (let k = 0; k <= 4; k++) {
    const y = y1 * k / 4;
    sv("text", {x: L - 6, y: sy(y) + 4, "text-anchor": "end", class: "axis-label"}, svg, fmtS(y));
    const x = x0 + (x1 - x0) * k / 4;
    sv("text", {x: sx(x), y: H - B + 16, "text-anchor": "middle", class: "axis-label"}, svg, String(Math.round(x)));
  }
  sv("text", {x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", class: "axis-label"}, svg, view.symbol);
  const lattices = [...new Set(pieces.map((p) => p.lattice))];
  pieces.forEach((p, i) => {
    const color = STAGE_COLORS[i % STAGE_COLORS.length];
    const dash = ["", "6 3", "2 3", "8 3 2 3"][lattices.indexOf(p.lattice) % 4];
    const g = sv("g", {class: "size-piece", "data-piece": p.piece}, svg);
    sv("line", {x1: sx(p.x[0]), y1: T, x2: sx(p.x[0]), y2: H - B, stroke: color, "stroke-dasharray": "3 3",
                "stroke-opacity": 0.5}, g);
    sv("polyline", {points: p.x.map((x, k) => `${sx(x)},${sy(p.step_s[k])}`).join(" "), fill: "none",
                    stroke: color, "stroke-width": 2, "stroke-dasharray": dash}, g);
    for (let k = 0; k < p.x.length; k++) sv("circle", {cx: sx(p.x[k]), cy: sy(p.step_s[k]), r: 2, fill: color}, g);
    hoverable(g, () => [`piece ${p.piece}: ${p.where}`, [
      ["step", `${fmtS(p.step_s[0])} .. ${fmtS(p.step_s[p.step_s.length - 1])}`], ["plan", p.summary, true],
      ...(p.why ? [["why", p.why, true]] : [])]]);
  });
  const legend = el("div", {class: "muted"}, parent);
  legend.textContent = `${pieces.length} pieces; line style by the sizes that divide alike (${lattices.join("; ")})` +
    "; a dashed vertical line where a piece starts; hover a piece for its plan and why it starts there";
}

// ---------------------------------------------------------------- parameters
function drawParams(parent, plan) {
  const ctl = el("div", {class: "controls"}, parent);
  const inp = el("input", {type: "search", class: "param-filter", placeholder: "filter parameters"}, ctl);
  const wrap = el("div", {class: "table-wrap"}, parent);
  const t = el("table", {class: "params"}, wrap);
  const hr = el("tr", {}, el("thead", {}, t));
  for (const h of ["parameter", ...plan.mesh.axis_names.map((a) => "on " + a), "shape", "local shape", "dtype",
                   "optimizer state"]) el("th", {}, hr, h);
  const tb = el("tbody", {}, t);
  for (const fqn of Object.keys(plan.parameters)) {
    const p = plan.parameters[fqn];
    const tr = el("tr", {"data-fqn": fqn}, tb);
    el("td", {class: "mono"}, tr, fqn);
    for (const pl of p.placements) {
      const td = el("td", {}, tr);
      el("span", {class: "chip mono", style: "background:" + placementColor(pl)}, td, pl);
    }
    el("td", {class: "mono"}, tr, p.shape.join("\u00d7"));
    el("td", {class: "mono"}, tr, (p.local_shape || []).join("\u00d7"));
    el("td", {class: "mono"}, tr, String(p.dtype || "").replace("torch.", ""));
    el("td", {class: p.offload ? "offload" : "muted"}, tr, p.offload ? "host (offloaded)" : "device");
  }
  inp.addEventListener("input", () => {
    const q = inp.value.trim().toLowerCase();
    for (const tr of tb.children) tr.hidden = q && !tr.getAttribute("data-fqn").toLowerCase().includes(q);
  });
}

// ---------------------------------------------------------------- mesh over cluster
function coords(rank, shape) {
  const c = new Array(shape.length);
  for (let a = shape.length - 1; a >= 0; a--) { c[a] = rank % shape[a]; rank = Math.floor(rank / shape[a]); }
  return c;
}
function rankOf(c, shape) { let r = 0; for (let a = 0; a < shape.length; a++) r = r * shape[a] + c[a]; return r; }

function drawMesh(parent, plan) {
  const shape = plan.mesh.shape, names = plan.mesh.axis_names, cl = plan.cluster || {};
  const world = shape.reduce((a, b) => a * b, 1);
  const dpn = cl.devices_per_node || world;
  const nNodes = Math.ceil(world / dpn);
  const showNodes = Math.min(nNodes, 8);
  const perRow = Math.min(dpn, 8);
  const DS = 44, DG = 10, NP = 12, ARC = 10 + 8 * shape.length;  // room under each device row for the arcs
  const nodeW = perRow * (DS + DG) - DG + 2 * NP, nodeRows = Math.ceil(dpn / perRow);
  const nodeH = nodeRows * (DS + DG + ARC) - DG + 2 * NP + 10;
  const nodesPerLine = Math.max(1, Math.min(showNodes, Math.floor(900 / (nodeW + 16)) || 1));
  const lines = Math.ceil(showNodes / nodesPerLine);
  const W = nodesPerLine * (nodeW + 16) + 10, H = lines * (nodeH + 16) + 10;
  const stageOfRank = {};
  const ps = pipelineStages(plan.pipeline);
  if (ps) for (const s of ps.stages) for (const r of s.devices) stageOfRank[r] = s.index;
  const svg = sv("svg", {width: Math.min(W, 900), viewBox: `0 0 ${W} ${H}`, class: "mesh-svg"}, parent);
  const pos = {};
  for (let k = 0; k < showNodes; k++) {
    const nx = 5 + (k % nodesPerLine) * (nodeW + 16), ny = 5 + Math.floor(k / nodesPerLine) * (nodeH + 16);
    const ng = sv("g", {class: "cluster-node", "data-node": k}, svg);
    sv("rect", {x: nx, y: ny, width: nodeW, height: nodeH, rx: 8, fill: "#f6f8fa", stroke: "#57606a"}, ng);
    sv("text", {x: nx + NP, y: ny + 14, "font-size": 11, "font-weight": 600}, ng, `node ${k}  (${cl.name || "cluster"})`);
    for (let j = 0; j < dpn; j++) {
      const r = k * dpn + j;
      const dx = nx + NP + (j % perRow) * (DS + DG), dy = ny + 22 + Math.floor(j / perRow) * (DS + DG + ARC);
      const used = r < world;
      const st = stageOfRank[r];
      const dg = sv("g", {class: "device" + (used ? "" : " idle"), "data-rank": used ? r : ""}, ng);
      sv("rect", {x: dx, y: dy, width: DS, height: DS, rx: 4,
                  fill: used ? (st !== undefined ? STAGE_COLORS[st % STAGE_COLORS.length] + "55" : "#ddf4ff") : "#ffffff",
                  stroke: used ? "#0969da" : "#afb8c1", "stroke-dasharray": used ? "" : "3 2"}, dg);
      if (used) {
        const c = coords(r, shape);
        pos[r] = [dx + DS / 2, dy + DS];
        sv("text", {x: dx + DS / 2, y: dy + 16, "text-anchor": "middle", "font-size": 12, "font-weight": 600}, dg, "r" + r);
        sv("text", {x: dx + DS / 2, y: dy + 30, "text-anchor": "middle", "font-size": 9, fill: "#57606a"}, dg,
           "(" + c.join(",") + ")");
        hoverable(dg, () => ["rank " + r, [["mesh coordinate", names.map((n, a) => `${n}=${c[a]}`).join(", ")],
                                           ["node", String(k) + ", local device " + j],
                                           ...(st !== undefined ? [["pipeline", "stage " + st]] : []),
                                           ["device", (cl.device || {}).name || "-"]]]);
      }
    }
  }
  if (nNodes > showNodes) sv("text", {x: 5, y: H - 2, "font-size": 11, fill: "#656d76"}, svg, `\u2026 and ${nNodes - showNodes} more nodes`);
  // the group of rank 0 along each axis: which devices one collective on that axis spans
  shape.forEach((size, a) => {
    if (size < 2) return;
    const c0 = coords(0, shape), pts = [];
    for (let i = 0; i < size; i++) { const c = c0.slice(); c[a] = i; const r = rankOf(c, shape); if (pos[r]) pts.push(pos[r]); }
    const off = (a - (shape.length - 1) / 2) * 6;
    for (let i = 0; i + 1 < pts.length; i++) {
      const [x1, y1] = pts[i], [x2, y2] = pts[i + 1];
      const mx = (x1 + x2) / 2, my = Math.max(y1, y2) + 2 * (6 + 7 * (shape.length - 1 - a));
      sv("path", {d: `M${x1 + off},${y1} Q${mx},${my} ${x2 + off},${y2}`, fill: "none",
                  stroke: AXIS_COLORS[a % AXIS_COLORS.length], "stroke-width": 2.5, opacity: 0.85,
                  class: "axis-link", "data-axis": names[a]}, svg);
    }
  });
  const t = el("table", {class: "params"}, parent);
  const hr = el("tr", {}, el("thead", {}, t));
  for (const h of ["axis", "size", "stride", "placement on cluster", "link"]) el("th", {}, hr, h);
  const tb = el("tbody", {}, t);
  const topo = plan.mesh.topology || [];
  shape.forEach((size, a) => {
    const tp = topo[a] || {};
    const stride = shape.slice(a + 1).reduce((x, y) => x * y, 1);
    const intra = tp.intra_node || size, inter = tp.inter_node || 1;
    const lvl = tp.level || "-";
    const link = lvl === "intra-node" ? cl.intra_node : lvl === "inter-node" ? cl.inter_node : null;
    const linkText = link ? `${(link.bandwidth / 1e9).toFixed(0)} GB/s, ${(link.latency * 1e6).toFixed(1)} us`
      : (cl.intra_node && cl.inter_node ? `${(cl.intra_node.bandwidth / 1e9).toFixed(0)} GB/s inside, ` +
         `${(cl.inter_node.bandwidth / 1e9).toFixed(0)} GB/s between nodes` : "-");
    const tr = el("tr", {"data-axis": names[a]}, tb);
    const td = el("td", {}, tr);
    el("span", {class: "sw", style: `display:inline-block;width:10px;height:10px;margin-right:4px;background:${AXIS_COLORS[a % AXIS_COLORS.length]}`}, td);
    td.appendChild(document.createTextNode(names[a]));
    el("td", {}, tr, String(size));
    el("td", {}, tr, String(stride));
    el("td", {}, tr, `${lvl}: ${intra} per node \u00d7 ${inter} node${inter > 1 ? "s" : ""}`);
    el("td", {}, tr, linkText);
  });
  el("div", {class: "muted"}, parent, `${world} devices on ${nNodes} node${nNodes > 1 ? "s" : ""} of ${dpn}; ` +
     "coloured arcs: the devices of rank 0's group on each axis (ranks are row-major, the last axis innermost)");
}

// ---------------------------------------------------------------- memory
function drawMemory(parent, plan) {
  const p = plan.predicted, m = p.memory || {}, cap = p.memory_capacity_bytes || 0;
  const world = plan.mesh.shape.reduce((a, b) => a * b, 1);
  const rows = [];
  const pipe = pipelineStages(plan.pipeline);
  if (pipe) {
    for (const s of pipe.stages) {
      const devs = s.devices || [];
      rows.push({label: `stage ${s.index}` + (devs.length ? ` (ranks ${rangeText(devs)})` : ""),
                 parts: [["stage total", s.memory_bytes || 0, "#8c959f"]],
                 total: s.memory_bytes || 0});
    }
  }
  const kinds = MEM_KINDS.concat(Object.keys(m).filter((k) => !MEM_KINDS.some(([n]) => n === k))
    .map((k, i) => [k, ["#9c755f", "#76b7b2", "#edc948"][i % 3]]));
  const parts = kinds.map(([k, c]) => [k, m[k] || 0, c]);
  // the kinds add up to more than the peak when they are not all live at once (activations are freed as
  // gradients appear); the bar shows every kind and a black tick marks the predicted peak
  const held = sum(parts.map((x) => x[1]));
  rows.unshift({label: pipe ? "peak device, by kind" : `each device (ranks 0\u2013${world - 1})`, parts,
                total: p.peak_memory_bytes || held, held});
  const maxUse = Math.max(...rows.map((r) => Math.max(r.total, r.held || 0)), 1);
  const scaleToCap = cap > 0 && maxUse / cap > 0.1;
  const full = scaleToCap ? Math.max(cap, maxUse) : maxUse * 1.05;
  const W = 660, LW = 150, BW = W - LW - 220, RH = 24;
  const H = rows.length * (RH + 12) + 34;
  const svg = sv("svg", {width: "100%", viewBox: `0 0 ${W} ${H}`, class: "memory-svg"}, parent);
  rows.forEach((r, i) => {
    const y = 6 + i * (RH + 12);
    const g = sv("g", {class: "mem-row", "data-row": i}, svg);
    sv("text", {x: 0, y: y + 17, "font-size": 11}, g, clip(r.label, 32));
    sv("rect", {x: LW, y, width: BW, height: RH, fill: "#f6f8fa", stroke: "#d0d7de"}, g);
    let x = LW;
    for (const [k, v, c] of r.parts) {
      const w = (BW * v) / full;
      if (w <= 0) continue;
      const seg = sv("rect", {x, y, width: Math.max(w, 0.5), height: RH, fill: c, class: "mem-seg", "data-kind": k}, g);
      hoverable(seg, () => [r.label + ": " + k, [["bytes", fmtB(v)], ["of used", fmtPct(v / Math.max(r.total, 1))],
                                                  ["of capacity", cap ? fmtPct(v / cap) : "-"]]]);
      x += w;
    }
    sv("text", {x: LW + BW + 6, y: y + 16, "font-size": 11, fill: "#24292f"}, g,
       (r.held !== undefined ? "peak " : "") + fmtB(r.total) + (cap ? ` (${fmtPct(r.total / cap)} of ${fmtB(cap)})` : ""));
    if (r.held !== undefined && Math.abs(r.held - r.total) > 1e-6 * r.held) {
      const px = LW + (BW * r.total) / full;
      const tick = sv("line", {x1: px, x2: px, y1: y - 4, y2: y + RH + 4, stroke: "#24292f", "stroke-width": 2.5,
                               class: "peak"}, g);
      hoverable(tick, () => ["predicted peak", [["peak", fmtB(r.total)], ["all kinds together", fmtB(r.held)],
                                                ["why less", "activations are freed as gradients appear"]]]);
    }
    if (cap && cap <= full) {
      const cx = LW + (BW * cap) / full;
      sv("line", {x1: cx, x2: cx, y1: y - 3, y2: y + RH + 3, stroke: "#cf222e", "stroke-width": 2, class: "capacity"}, g);
    }
  });
  const ly = H - 12;
  let lx = 0;
  for (const [k, c] of kinds) {
    sv("rect", {x: lx, y: ly - 9, width: 10, height: 10, fill: c}, svg);
    sv("text", {x: lx + 13, y: ly, "font-size": 11}, svg, k);
    lx += 16 + k.length * 7;
  }
  if (pipe) {
    sv("rect", {x: lx, y: ly - 9, width: 10, height: 10, fill: "#8c959f"}, svg);
    sv("text", {x: lx + 13, y: ly, "font-size": 11}, svg, "stage total");
  }
  el("div", {class: "muted"}, parent, scaleToCap ? "red line: device capacity" :
     `scaled to usage: the device's ${fmtB(cap)} lie far off the scale`);
  if (p.host_memory_bytes) {
    const n = Object.values(plan.parameters).filter((q) => q.offload).length;
    el("div", {class: "host-memory"}, parent, `host memory: ${fmtB(p.host_memory_bytes)} per device of offloaded ` +
       `optimizer state (${n} parameters)` + (p.host_capacity_bytes ? `, of a ${fmtB(p.host_capacity_bytes)} share ` +
       "of its node's host memory" : ""));
  }
}
function rangeText(rs) {
  if (!rs.length) return "";
  const sorted = rs.slice().sort((a, b) => a - b);
  const contiguous = sorted.every((r, i) => i === 0 || r === sorted[i - 1] + 1);
  return contiguous && sorted.length > 2 ? `${sorted[0]}\u2013${sorted[sorted.length - 1]}` : sorted.join(",");
}

// ---------------------------------------------------------------- communication
function drawComm(parent, plan) {
  const agg = {};
  for (const c of plan.collectives) {
    const key = c.phase + "|" + c.mesh_axes.join(",");
    const row = agg[key] = agg[key] || {phase: c.phase, axis: c.mesh_axes.join(","), kinds: {}, total: 0};
    const k = row.kinds[c.kind] = row.kinds[c.kind] || {n: 0, bytes: 0, s: 0};
    k.n += 1; k.bytes += c.bytes; k.s += c.seconds; row.total += c.seconds;
  }
  const rows = Object.values(agg).sort((a, b) =>
    PHASES.indexOf(a.phase) - PHASES.indexOf(b.phase) || a.axis.localeCompare(b.axis));
  if (!rows.length) { el("div", {class: "muted comm-empty"}, parent, "no communication: every edge keeps its placement"); }
  const W = 640, LW = 150, BW = W - LW - 110, RH = 22;
  const H = Math.max(rows.length, 1) * (RH + 8) + 30;
  const svg = sv("svg", {width: "100%", viewBox: `0 0 ${W} ${H}`, class: "comm-svg"}, parent);
  const maxT = Math.max(...rows.map((r) => r.total), 1e-30);
  const topo = {};
  for (const t of (plan.mesh.topology || [])) topo[t.name] = t.level;
  rows.forEach((r, i) => {
    const y = 4 + i * (RH + 8);
    const g = sv("g", {class: "comm-row", "data-phase": r.phase, "data-axis": r.axis}, svg);
    sv("text", {x: 0, y: y + 15, "font-size": 11}, g, `${r.phase} \u00b7 ${r.axis}` + (topo[r.axis] ? ` (${topo[r.axis]})` : ""));
    let x = LW;
    for (const kind of Object.keys(r.kinds).sort()) {
      const k = r.kinds[kind], w = (BW * k.s) / maxT;
      const seg = sv("rect", {x, y, width: Math.max(w, 1), height: RH, fill: KIND_COLORS[kind] || "#999", class: "comm-seg",
                              "data-kind": kind}, g);
      hoverable(seg, () => [`${r.phase} ${kind} on ${r.axis}`, [["collectives", String(k.n)], ["bytes", fmtB(k.bytes)],
                                                                 ["time", fmtS(k.s)]]]);
      x += w;
    }
    sv("text", {x: x + 5, y: y + 15, "font-size": 11}, g, fmtS(r.total));
  });
  let lx = 0;
  const used = new Set(plan.collectives.map((c) => c.kind));
  for (const kind of Object.keys(KIND_COLORS)) {
    if (!used.has(kind)) continue;
    sv("rect", {x: lx, y: H - 19, width: 10, height: 10, fill: KIND_COLORS[kind]}, svg);
    sv("text", {x: lx + 13, y: H - 10, "font-size": 11}, svg, kind);
    lx += 24 + kind.length * 6.5;
  }
  const grad = plan.collectives.filter((c) => c.gradient_sync);
  el("div", {class: "muted"}, parent, `${plan.collectives.length} logical collectives, ` +
     `${fmtB(sum(plan.collectives.map((c) => c.bytes)))}; gradient sync ${grad.length} (${fmtS(sum(grad.map((c) => c.seconds)))})`);
}

// ---------------------------------------------------------------- pipeline schedule
function scheduleOrder(kind, S, m, v) {
  // per stage: the ordered list of {type, mb, chunk} it runs
  const orders = [];
  for (let s = 0; s < S; s++) {
    const ops = [];
    if (kind === "gpipe") {
      for (let c = 0; c < v; c++) for (let i = 0; i < m; i++) ops.push({type: "F", mb: i, chunk: c});
      for (let c = v - 1; c >= 0; c--) for (let i = 0; i < m; i++) ops.push({type: "B", mb: i, chunk: c});
    } else {
      // 1F1B (v = 1) and interleaved 1F1B (Narayanan et al. 2021): warmup forwards, steady one-forward-one-backward,
      // cooldown backwards; with v chunks a stage cycles through its chunks in groups of S microbatches
      const total = m * v;
      const warm = v === 1 ? Math.min(S - s - 1, m) : Math.min((S - s - 1) * 2 + (v - 1) * S, total);
      const fwd = (k) => ({type: "F", chunk: Math.floor(k / S) % v, mb: Math.floor(k / (S * v)) * S + (k % S)});
      const bwd = (k) => ({type: "B", chunk: v - 1 - (Math.floor(k / S) % v), mb: Math.floor(k / (S * v)) * S + (k % S)});
      const f = [], b = [];
      for (let k = 0; k < total; k++) { f.push(v === 1 ? {type: "F", chunk: 0, mb: k} : fwd(k));
                                        b.push(v === 1 ? {type: "B", chunk: 0, mb: k} : bwd(k)); }
      for (let k = 0; k < warm; k++) ops.push(f[k]);
      for (let k = 0; k < total - warm; k++) { ops.push(f[warm + k]); ops.push(b[k]); }
      for (let k = total - warm; k < total; k++) ops.push(b[k]);
    }
    orders.push(ops.filter((o) => o.mb < m));
  }
  return orders;
}
function simulateSchedule(pipe) {
  const {stages, v, m, kind} = pipelineStages(pipe);
  const S = stages.length;
  const orders = scheduleOrder(kind === "gpipe" ? "gpipe" : "1f1b", S, m, v);
  // a chunk's time_s is its forward + backward per microbatch; backward ~ 2x forward unless given
  const dur = stages.map((s) => s.chunks.map((c) => {
    const f = c.forward_s !== undefined ? c.forward_s : c.time_s / 3;
    return {F: f, B: c.backward_s !== undefined ? c.backward_s : c.time_s - f};
  }));
  const key = (type, vs, mb) => type + ":" + vs + ":" + mb;
  const end = {}, ptr = new Array(S).fill(0), free = new Array(S).fill(0), ops = [];
  let progress = true, left = sum(orders.map((o) => o.length));
  while (left > 0 && progress) {
    progress = false;
    for (let s = 0; s < S; s++) {
      while (ptr[s] < orders[s].length) {
        const o = orders[s][ptr[s]];
        const vs = o.chunk * S + s;                     // virtual stage: model chunk o.chunk on stage s
        let dep = null;
        if (o.type === "F" && vs > 0) dep = key("F", vs - 1, o.mb);
        if (o.type === "B") dep = vs < S * v - 1 ? key("B", vs + 1, o.mb) : key("F", vs, o.mb);
        if (dep !== null && !(dep in end)) break;
        const start = Math.max(free[s], dep !== null ? end[dep] : 0);
        const stop = start + dur[s][o.chunk][o.type];
        end[key(o.type, vs, o.mb)] = stop;
        free[s] = stop;
        ops.push({stage: s, type: o.type, mb: o.mb, chunk: o.chunk, start, stop});
        ptr[s]++; left--; progress = true;
      }
    }
  }
  const makespan = Math.max(0, ...ops.map((o) => o.stop));
  const busy = sum(ops.map((o) => o.stop - o.start));
  return {ops, makespan, S, m, v, kind, stages, complete: left === 0,
          bubble: makespan > 0 ? 1 - busy / (S * makespan) : 0};
}
function drawSchedule(parent, plan) {
  const pipe = plan.pipeline;
  const sim = simulateSchedule(pipe);
  el("div", {class: "schedule-summary"}, parent,
     `${sim.kind} \u00b7 ${sim.S} stages \u00b7 ${sim.m} microbatches` + (sim.v > 1 ? ` \u00b7 ${sim.v} chunks per stage` : "") +
     ` \u00b7 simulated from the stage times: ${fmtS(sim.makespan)} per step, idle (bubble) ${fmtPct(sim.bubble)} of stage time` +
     (plan.predicted.bubble_s !== undefined ? ` \u00b7 predicted bubble ${fmtS(plan.predicted.bubble_s)}` : ""));
  if (!sim.complete) el("div", {class: "warn"}, parent, "the schedule's order has a dependency it cannot meet; drawn up to there");
  const W = 900, LW = 120, TW = W - LW - 10, RH = 24;
  const H = sim.S * (RH + 6) + 30;
  const svg = sv("svg", {width: "100%", viewBox: `0 0 ${W} ${H}`, class: "schedule-svg"}, parent);
  const X = (t) => LW + (TW * t) / Math.max(sim.makespan, 1e-30);
  sim.stages.forEach((s, i) => {
    const y = 4 + i * (RH + 6);
    const devs = s.devices || [];
    sv("text", {x: 0, y: y + 16, "font-size": 11}, svg, `stage ${s.index}` + (devs.length ? ` (r${rangeText(devs)})` : ""));
    sv("rect", {x: LW, y, width: TW, height: RH, fill: "#f6f8fa", stroke: "#eaeef2"}, svg);
  });
  for (const o of sim.ops) {
    const y = 4 + o.stage * (RH + 6), x = X(o.start), w = Math.max(X(o.stop) - x, 0.5);
    const shade = o.chunk % 2 ? 0.65 : 1;
    const fill = o.type === "F" ? `rgba(78,121,167,${shade})` : `rgba(89,161,79,${shade})`;
    const g = sv("g", {class: "sched-op", "data-stage": String(sim.stages[o.stage].index), "data-type": o.type,
                       "data-mb": String(o.mb), "data-chunk": String(o.chunk), "data-start": String(o.start)}, svg);
    sv("rect", {x, y, width: w, height: RH, fill, stroke: "#fff", "stroke-width": 0.5}, g);
    if (w > 14) sv("text", {x: x + w / 2, y: y + 16, "text-anchor": "middle", "font-size": 10, fill: "#fff"}, g,
                   o.type + o.mb + (sim.v > 1 ? "." + o.chunk : ""));
    hoverable(g, () => [`${o.type === "F" ? "forward" : "backward"} of microbatch ${o.mb}` + (sim.v > 1 ? `, chunk ${o.chunk}` : ""),
                        [["stage", String(sim.stages[o.stage].index)], ["start", fmtS(o.start)], ["duration", fmtS(o.stop - o.start)],
                         ["layers", clip(sim.stages[o.stage].chunks[o.chunk].layers.join(", "), 120)]]]);
  }
  for (let i = 0; i <= 4; i++) {
    const t = (sim.makespan * i) / 4, x = X(t);
    sv("line", {x1: x, x2: x, y1: H - 24, y2: H - 20, stroke: "#57606a"}, svg);
    sv("text", {x, y: H - 8, "font-size": 10, "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle", fill: "#57606a"}, svg, fmtS(t));
  }
  el("div", {class: "muted"}, parent, "blue: forward, green: backward (F3 = forward of microbatch 3); " +
     "a stage's time splits 1:2 between forward and backward unless the plan gives forward_s/backward_s");
}

// ---------------------------------------------------------------- comparison
function drawCompare(parent, d, labels) {
  const c = card(parent, "comparison", `${labels[0]} \u2192 ${labels[1]} (differences are ${labels[1]} \u2212 ${labels[0]})`);
  c.id = "compare";
  const cols = el("div", {class: "cmp-cols"}, c);
  const t = el("table", {class: "cmp"}, el("div", {}, cols));
  const hr = el("tr", {}, t);
  for (const h of ["", labels[0], labels[1], "difference"]) el("th", {}, hr, h);
  const P = d.predicted;
  const rows = [["step time", "step_time_s", fmtS], ["compute", "compute_s", fmtS], ["communication", "comm_s", fmtS],
                ["bubble", "bubble_s", fmtS], ["peak memory", "peak_memory_bytes", fmtB]];
  for (const [name, k, f] of rows) {
    const v = P[k], tr = el("tr", {}, t);
    el("td", {}, tr, name); el("td", {}, tr, f(v.a)); el("td", {}, tr, f(v.b));
    el("td", {class: v.delta > 0 ? "bad" : v.delta < 0 ? "good" : ""}, tr, (v.delta > 0 ? "+" : "") + f(v.delta));
  }
  const mf = el("tr", {}, t);
  el("td", {}, mf, "MFU"); el("td", {}, mf, fmtPct(P.mfu.a)); el("td", {}, mf, fmtPct(P.mfu.b));
  el("td", {}, mf, ((P.mfu.b - P.mfu.a) * 100).toFixed(1) + " pt");
  const src = el("div", {}, cols);
  el("div", {class: "plan-sub"}, src, "where the step-time difference comes from");
  const ts = el("table", {class: "cmp"}, src);
  for (const s of d.sources.slice(0, 8)) {
    const tr = el("tr", {}, ts);
    el("td", {}, tr, s.what);
    el("td", {class: s.delta_s > 0 ? "bad" : "good"}, tr, (s.delta_s > 0 ? "+" : "") + fmtS(s.delta_s));
  }
  if (!d.sources.length) el("div", {class: "muted"}, src, "no difference in predicted time");
  const pc = el("div", {}, cols);
  const moved = d.parameters.filter((p) => p.layout_changed);
  el("div", {class: "plan-sub"}, pc, `parameters: ${d.parameters.length} of ${d.parameter_count} placements differ, ` +
     `${moved.length} change the local shard; nodes: ${d.nodes.length} of ${d.node_count} strategies differ, ` +
     `${d.nodes.filter((n) => n.layout_changed).length} change a layout (outlined red in the graphs)`);
  const tp = el("table", {class: "cmp params-diff"}, pc);
  for (const p of (moved.length ? moved : d.parameters).slice(0, 12)) {
    const tr = el("tr", {}, tp);
    el("td", {class: "mono"}, tr, p.fqn); el("td", {class: "mono"}, tr, p.a.join(" ")); el("td", {class: "mono"}, tr, p.b.join(" "));
  }
}

// ---------------------------------------------------------------- page
function buildPanel(root, plan, idx, diffNames) {
  const sfx = idx === 0 ? "" : "-" + idx;
  const panel = el("section", {class: "plan-panel", id: "plan-" + idx}, root);
  el("div", {class: "plan-title"}, panel, `${plan.label}: ${plan.model.source || "model"}`);
  const topo = (plan.mesh.topology || []).map((t) => `${t.name}=${t.size} ${t.level}`).join(", ");
  el("div", {class: "plan-sub"}, panel,
     `mesh ${plan.mesh.shape.join("\u00d7")} (${topo || plan.mesh.axis_names.join(", ")}) on ${(plan.cluster || {}).name || "?"}` +
     ` \u00b7 ${plan.nodes.length} nodes \u00b7 ${Object.keys(plan.parameters).length} parameters` +
     (plan.pipeline ? ` \u00b7 pipeline ${plan.pipeline.schedule}` : "") +
     ` \u00b7 fingerprint ${plan.model.fingerprint || "-"}`);

  const b = card(panel, "predicted step time and MFU");
  const bd = el("div", {id: "breakdown" + sfx, class: "breakdown"}, b);
  drawBreakdown(bd, plan);

  for (const view of plan.sizes || []) {
    const c = card(panel, `predicted step time against ${view.symbol}`, "one line per piece of the plan, each " +
                   "piece's plan priced over its sizes");
    drawSizes(el("div", {id: "sizes-chart" + sfx, class: "sizes-chart"}, c), view);
  }

  const g = card(panel, "model graph", "grouped by module; click a group's title to expand or collapse; hover for details");
  const controls = el("div", {class: "controls"}, g);
  placementLegend(g, plan);
  const wrap = el("div", {class: "graph-wrap"}, g);
  const graph = el("div", {id: "graph" + sfx, class: "graph"}, wrap);
  Graph(plan, idx, graph, controls, diffNames);

  if (plan.pipeline && plan.pipeline.stages && plan.pipeline.stages.length) {
    const s = card(panel, "pipeline schedule");
    drawSchedule(el("div", {id: "schedule" + sfx, class: "schedule"}, s), plan);
  }

  const grid = el("div", {class: "grid2"}, panel);
  const mem = card(grid, "memory per device", "parameters, gradients, optimizer states, activations vs capacity");
  drawMemory(el("div", {id: "memory-chart" + sfx, class: "memory-chart"}, mem), plan);
  const comm = card(grid, "communication by phase and mesh axis", "logical collectives, one per tensor");
  drawComm(el("div", {id: "comm-chart" + sfx, class: "comm-chart"}, comm), plan);
  const mesh = card(grid, "device mesh on the cluster");
  drawMesh(el("div", {id: "mesh-view" + sfx, class: "mesh-view"}, mesh), plan);
  const par = card(grid, "parameter placements");
  drawParams(el("div", {id: "param-table" + sfx, class: "param-table"}, par), plan);

  if ((plan.warnings || []).length) {
    const w = card(panel, "warnings");
    for (const x of plan.warnings) el("div", {class: "warn"}, w, x);
  }
}

function main() {
  const app = document.getElementById("app");
  const plans = DATA.plans;
  let diffNames = null;
  if (DATA.diff) {
    drawCompare(app, DATA.diff, plans.map((p) => p.label));
    // across meshes every spec is written differently; outline only the nodes whose layout moved
    const d = DATA.diff;
    diffNames = new Set(d.nodes.filter((n) => d.same_mesh || n.layout_changed).map((n) => n.name));
  }
  const panels = el("div", {class: "panels n" + plans.length}, app);
  plans.forEach((p, i) => buildPanel(panels, p, i, diffNames));
  document.body.setAttribute("data-ready", "1");
}
main();
})();

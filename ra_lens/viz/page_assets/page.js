/* ra-lens circuit page: the component graph drawn by hand in SVG, a size control over the
   circuits the page carries, the faithfulness curve, and a head's attention pattern and RA.
   No library and no network: everything comes from the JSON block of the page (page.py). */
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("ra-lens-data").textContent);
  const G = D.graph;
  const H = G.n_heads, L = G.n_layers, GROUP = G.n_heads / G.n_kv_heads;
  const NW = G.writers.length, LOGITS = NW; // node index of logits: after every writer
  const NAMES = G.writers.concat(["logits"]);
  const INDEX = new Map(NAMES.map((n, i) => [n, i]));

  // --- geometry: input at the bottom, one row per layer, logits on top -------------------------
  const COL = 64, ROW = 58, BW = 52, BH = 18, LEFT = 40, LIFT = 24;
  const WIDTH = LEFT + COL * (H + 1.4), HEIGHT = ROW * (L + 2);
  const CX = LEFT + (COL * (H + 1)) / 2;
  const rowY = (layer) => HEIGHT - ROW * (layer + 1.5);
  // A head's query port is left of its box, key in the middle, value on the right.
  const PORT = { q: -0.32 * BW, k: 0, v: 0.32 * BW, mlp: 0, logits: 0 };

  const NODES = NAMES.map((name) => {
    let m;
    if (name === "input") return { name, kind: "input", layer: -1, x: CX, y: rowY(-1), w: BW * 1.5 };
    if (name === "logits") return { name, kind: "logits", layer: L, x: CX, y: rowY(L), w: BW * 1.5 };
    if ((m = /^a(\d+)\.h(\d+)$/.exec(name))) {
      const layer = +m[1], head = +m[2];
      return { name, kind: "head", layer, head, x: LEFT + COL * (head + 0.5), y: rowY(layer), w: BW };
    }
    m = /^m(\d+)$/.exec(name);
    const layer = +m[1]; // the MLP reads the heads of its own layer: a little higher than them
    return { name, kind: "mlp", layer, x: LEFT + COL * (H + 0.55), y: rowY(layer) - LIFT, w: BW };
  });

  // Each reader: its kind and the nodes that own it (a key/value head's readers belong to every
  // query head of its group).
  const READERS = G.readers.map((name) => {
    if (name === "logits") return { kind: "logits", owners: [LOGITS] };
    let m = /^m(\d+)$/.exec(name);
    if (m) return { kind: "mlp", owners: [INDEX.get(name)] };
    m = /^a(\d+)\.h(\d+)<([qkv])>$/.exec(name);
    const layer = +m[1], head = +m[2], kind = m[3];
    if (kind === "q") return { kind, owners: [INDEX.get(`a${layer}.h${head}`)] };
    const owners = [];
    for (let h = head * GROUP; h < (head + 1) * GROUP; h++) owners.push(INDEX.get(`a${layer}.h${h}`));
    return { kind, owners };
  });

  // --- edges and the circuits (stops of the size control) -----------------------------------
  const E = D.edges; // parallel arrays over the stored edges: w (writer), r (reader), s (score)
  const N_STORED = E.w.length;
  const ABS = E.s ? E.s.map(Math.abs) : new Array(N_STORED).fill(1);
  const MAX_ABS = ABS.reduce((a, b) => Math.max(a, b), 1e-30);
  const edgeName = (e) => `${G.writers[E.w[e]]}->${G.readers[E.r[e]]}`;
  // Each stop stores what it adds to and removes from the previous one; rebuild each drawn set,
  // weakest first so that the strongest edges are drawn on top.
  const DRAWN = [];
  {
    const current = new Set();
    for (const stop of D.stops) {
      stop.remove.forEach((e) => current.delete(e));
      stop.add.forEach((e) => current.add(e));
      DRAWN.push(Array.from(current).sort((a, b) => ABS[a] - ABS[b] || a - b));
    }
  }
  const FIRST_STOP = new Array(N_STORED).fill(-1); // the first stop that draws each edge
  DRAWN.forEach((edges, i) => edges.forEach((e) => { if (FIRST_STOP[e] < 0) FIRST_STOP[e] = i; }));

  // The size control walks one ranking's circuits (D.walks: ranking -> stop indices by size):
  // MIB's signed ranking (CPR's curve) or its |score| ranking (CMD's curve).
  const WALKS = D.walks;
  const RANKING = {
    signed: { name: "signed score", option: "signed score (CPR's curve)", colour: "#d62728", dash: "" },
    abs: { name: "|score|", option: "|score| (CMD's curve)", colour: "#1f77b4", dash: "5 3" },
    given: { name: "as given", option: "the circuit as given", colour: "#f0a000", dash: "" },
  };
  const firstWalk = WALKS[D.stops[D.start].ranking] ? D.stops[D.start].ranking : WALKS.abs ? "abs" : Object.keys(WALKS)[0];
  const state = { stop: D.start, walk: firstWalk, node: null, edge: null, pair: 0, zoom: 1, hidden: new Set() };

  const $ = (id) => document.getElementById(id);
  const esc = (t) => String(t).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const fmt = (x) => (x === null || x === undefined ? "n/a" : Math.abs(x) >= 1e-3 && Math.abs(x) < 1e4 ? x.toFixed(4) : x.toExponential(3));
  const pct = (f) => `${+(100 * f).toPrecision(3)} %`;
  const signClass = (s) => (s === null ? "" : s >= 0 ? "pos" : "neg");

  // Nodes of the drawn circuit: writers with an outgoing edge, logits when reached, and the
  // owners of a reader that no drawn node owns (an unpruned circuit).
  function circuitNodes(drawn) {
    const on = new Set();
    for (const e of drawn) {
      on.add(E.w[e]);
      if (READERS[E.r[e]].kind === "logits") on.add(LOGITS);
    }
    for (const e of drawn) {
      const owners = READERS[E.r[e]].owners;
      if (!owners.some((o) => on.has(o))) owners.forEach((o) => on.add(o));
    }
    return on;
  }

  const SVG_STYLE = `
    .edge { fill: none; stroke: #555; stroke-opacity: .6; }
    .edge.pos { stroke: #b2182b; } .edge.neg { stroke: #2166ac; }
    .edge.k { stroke-dasharray: 6 3; } .edge.v { stroke-dasharray: 1.5 2.5; }
    .node rect { fill: #fff; stroke: #bbb; stroke-width: 1; }
    .node.on rect { stroke: #333; } .node.head.on rect { fill: #dbe9f6; }
    .node.mlp.on rect { fill: #fdf1c7; } .node.input rect, .node.logits rect { fill: #e4e4e4; stroke: #333; }
    .node.off { opacity: .35; } .node { cursor: pointer; }
    .node text { font: 10px sans-serif; text-anchor: middle; fill: #222; pointer-events: none; }
    .layer { font: 10px sans-serif; fill: #999; }
    .focus .edge { stroke-opacity: .08; } .focus .edge.hl { stroke-opacity: 1; }
    .node.sel rect { stroke: #000; stroke-width: 2.5; }
    .edge.sel { stroke-opacity: 1; stroke: #f0a000; }
    .hide-q .edge.q, .hide-k .edge.k, .hide-v .edge.v, .hide-mlp .edge.mlp, .hide-logits .edge.logits { display: none; }`;

  // --- the graph ---------------------------------------------------------------------------
  function drawGraph() {
    const drawn = DRAWN[state.stop];
    const on = circuitNodes(drawn);
    const parts = [];
    for (let l = 0; l < L; l++) parts.push(`<text class="layer" x="4" y="${rowY(l) + 4}">L${l}</text>`);
    parts.push('<g class="edges">');
    for (const e of drawn) {
      const w = E.w[e], reader = READERS[E.r[e]], s = E.s ? E.s[e] : null;
      const width = E.s ? (0.4 + (3.6 * ABS[e]) / MAX_ABS).toFixed(2) : "1.2"; // no scores: one width
      const cls = `edge ${reader.kind} ${signClass(s)}`;
      const x0 = NODES[w].x, y0 = NODES[w].y - BH / 2;
      for (const t of reader.owners) {
        if (!on.has(t)) continue;
        const x1 = NODES[t].x + PORT[reader.kind], y1 = NODES[t].y + BH / 2, ym = (y0 + y1) / 2;
        parts.push(`<path class="${cls}" d="M${x0.toFixed(1)} ${y0}C${x0.toFixed(1)} ${ym} ${x1.toFixed(1)} ${ym} ${x1.toFixed(1)} ${y1}" stroke-width="${width}" data-e="${e}" data-w="${w}" data-t="${t}"/>`);
      }
    }
    parts.push('</g><g class="nodes">');
    NODES.forEach((n, i) => {
      const cls = `node ${n.kind} ${on.has(i) ? "on" : "off"}${state.node === i ? " sel" : ""}`;
      parts.push(`<g class="${cls}" data-name="${n.name}" data-n="${i}" transform="translate(${n.x.toFixed(1)},${n.y})"><rect x="${-n.w / 2}" y="${-BH / 2}" width="${n.w}" height="${BH}" rx="4"/><text y="3.5">${n.name}</text></g>`);
    });
    parts.push("</g>");
    const classes = Array.from(state.hidden).map((k) => `hide-${k}`);
    if (state.node !== null) classes.push("focus");
    $("graph").innerHTML = `<svg id="graph-svg" class="${classes.join(" ")}" viewBox="0 0 ${WIDTH} ${HEIGHT}" width="${WIDTH * state.zoom}" height="${HEIGHT * state.zoom}"><style>${SVG_STYLE}</style>${parts.join("")}</svg>`;
    markSelection();
    const stop = D.stops[state.stop];
    $("count-edges").textContent = stop.n_edges.toLocaleString("en");
    $("count-nodes").textContent = stop.n_nodes.toLocaleString("en");
    $("count-drawn").textContent = drawn.length < stop.n_edges ? ` (the ${drawn.length.toLocaleString("en")} largest |score| drawn)` : "";
    $("size-label").textContent = stop.label;
  }

  function markSelection() {
    const svg = $("graph-svg");
    svg.classList.toggle("focus", state.node !== null);
    if (state.node !== null) {
      svg.querySelectorAll(`[data-w="${state.node}"], [data-t="${state.node}"]`).forEach((p) => p.classList.add("hl"));
    }
    if (state.edge !== null) svg.querySelectorAll(`[data-e="${state.edge}"]`).forEach((p) => p.classList.add("sel"));
  }

  function setZoom(z) {
    state.zoom = Math.min(6, Math.max(0.2, z));
    const svg = $("graph-svg");
    svg.setAttribute("width", WIDTH * state.zoom);
    svg.setAttribute("height", HEIGHT * state.zoom);
  }
  // leave room for the vertical scroll bar, which appears once the graph is drawn
  const fitZoom = () => Math.min(1.5, Math.max(0.3, ($("graph-wrap").clientWidth - 20) / WIDTH));

  // A key/value reader of a grouped-query model is named by its key/value head, not a query head.
  function kvNote(r) {
    const m = /^a(\d+)\.h(\d+)<([kv])>$/.exec(G.readers[r]);
    if (!m || GROUP === 1) return "";
    const h = +m[2];
    return `${m[3] === "k" ? "key" : "value"} of key/value head ${h} of layer ${m[1]}, shared by query heads ${h * GROUP}-${(h + 1) * GROUP - 1}`;
  }

  // --- the faithfulness curves: both rankings, each with its own area -------------------------
  const areaText = (ranking) => {
    const c = D.curve && D.curve.rankings ? D.curve.rankings[ranking] : null;
    if (!c) return RANKING[ranking].name;
    return `${c.label}: ${c.area_name} ${c.area === null ? "n/a" : c.area.toFixed(3)}`;
  };
  const swatch = (ranking, dot) => `<svg width="26" height="10"><line x1="0" y1="5" x2="26" y2="5" stroke="${RANKING[ranking].colour}" stroke-width="1.8" stroke-dasharray="${RANKING[ranking].dash}"/>${dot ? `<circle cx="13" cy="5" r="3.5" fill="${RANKING[ranking].colour}"/>` : ""}</svg>`;

  function drawCurve() {
    const pts = D.stops.map((s, i) => ({ i, x: s.x, y: s.faithfulness, ranking: s.ranking })).filter((p) => p.x > 0 && p.y !== null);
    if (!pts.length) {
      $("curve-box").querySelector("h2").textContent = "Faithfulness";
      $("curve").innerHTML = '<p class="muted">No faithfulness measured for these circuits (pass curve= to EdgeScores.to_html).</p>';
      return;
    }
    const W = 400, Hh = 190, l = 40, r = 22, t = 10, b = 34;
    const lx = pts.map((p) => Math.log10(p.x));
    const x0 = Math.min(...lx), x1 = Math.max(...lx) + (Math.max(...lx) === x0 ? 1 : 0);
    const ys = pts.map((p) => p.y);
    const y0 = Math.min(0, ...ys), y1 = Math.max(1, ...ys);
    const X = (v) => l + ((Math.log10(v) - x0) / (x1 - x0)) * (W - l - r);
    const Y = (v) => t + ((y1 - v) / (y1 - y0)) * (Hh - t - b);
    const out = [`<svg width="${W}" height="${Hh}" viewBox="0 0 ${W} ${Hh}" style="font:10px sans-serif">`];
    for (const v of [0, 1]) out.push(`<line x1="${l}" x2="${W - r}" y1="${Y(v)}" y2="${Y(v)}" stroke="#bbb" stroke-dasharray="3 3"/><text x="${l - 4}" y="${Y(v) + 3}" text-anchor="end">${v}</text>`);
    for (let d = Math.ceil(x0); d <= Math.floor(x1); d++) {
      out.push(`<line x1="${X(10 ** d)}" x2="${X(10 ** d)}" y1="${Hh - b}" y2="${Hh - b + 4}" stroke="#444"/><text x="${X(10 ** d)}" y="${Hh - b + 14}" text-anchor="middle">${pct(10 ** d)}</text>`);
    }
    out.push(`<line x1="${l}" x2="${W - r}" y1="${Hh - b}" y2="${Hh - b}" stroke="#444"/><line x1="${l}" x2="${l}" y1="${t}" y2="${Hh - b}" stroke="#444"/>`);
    out.push(`<text x="${(l + W - r) / 2}" y="${Hh - 4}" text-anchor="middle">edges kept (share of ${G.n_edges_total.toLocaleString("en")} ${G.units} edges, log scale)</text>`);
    const legend = [];
    for (const ranking of ["signed", "abs"]) {
      const line = pts.filter((p) => p.ranking === ranking);
      if (!line.length) continue;
      const area = D.curve && D.curve.rankings ? D.curve.rankings[ranking].area : null;
      out.push(`<polyline class="curve ${ranking}" data-area="${area}" fill="none" stroke="${RANKING[ranking].colour}" stroke-width="1.5" stroke-dasharray="${RANKING[ranking].dash}" points="${line.map((p) => `${X(p.x).toFixed(1)},${Y(p.y).toFixed(1)}`).join(" ")}"/>`);
      legend.push(`<span class="${ranking}">${swatch(ranking, false)} ${esc(areaText(ranking))}</span>`);
    }
    // the current circuit's point last, so that it is drawn on top
    for (const p of pts.slice().sort((a, b) => (a.i === state.stop) - (b.i === state.stop))) {
      const cur = p.i === state.stop;
      const name = RANKING[p.ranking].name;
      out.push(`<circle class="pt ${p.ranking}${cur ? " current" : ""}" data-i="${p.i}" cx="${X(p.x).toFixed(1)}" cy="${Y(p.y).toFixed(1)}" r="${cur ? 6 : 3.5}" fill="${RANKING[p.ranking].colour}" stroke="${cur ? "#000" : "none"}" stroke-width="2"><title>${esc(D.stops[p.i].label)}, ${esc(name)}: faithfulness ${fmt(p.y)}</title></circle>`);
    }
    out.push("</svg>");
    if (pts.some((p) => p.ranking === "given")) legend.push(`<span>${swatch("given", true)} the chosen circuit</span>`);
    $("curve-box").querySelector("h2").textContent = "Faithfulness";
    const stop = D.stops[state.stop];
    const walking = WALKS.given ? "" : ` The size control walks the ${RANKING[state.walk].name} ranking.`;
    $("curve").innerHTML = `<p class="curve-legend">${legend.join("")}</p>` + out.join("") + `<p class="muted">This circuit (${esc(RANKING[stop.ranking].name)}): ${stop.faithfulness === null ? "faithfulness not measured" : `faithfulness ${fmt(stop.faithfulness)}`}. Click a point to open its circuit.${walking} CPR is the area under the signed ranking's curve (higher is better), CMD the area of |1 - faithfulness| of the |score| ranking's (lower is better), both over the share of edges kept.</p>`;
  }

  // --- the smallest measured circuit reaching a faithfulness --------------------------------
  function smallest(target) {
    const measured = D.stops.map((s, i) => ({ i, s })).filter(({ s }) => s.faithfulness !== null);
    const reached = measured.filter(({ s }) => s.faithfulness >= target);
    reached.sort((a, b) => a.s.n_units - b.s.n_units || b.s.faithfulness - a.s.faithfulness);
    return { measured, found: reached.length ? reached[0].i : null };
  }

  function showSmallest() {
    const target = parseFloat($("target").value);
    const button = $("open-smallest");
    button.hidden = true;
    if (!Number.isFinite(target)) {
      $("smallest").textContent = "enter a number, e.g. 0.8";
      return;
    }
    const { measured, found } = smallest(target);
    if (!measured.length) {
      $("smallest").textContent = "no faithfulness is measured on this page (pass curve= to EdgeScores.to_html).";
    } else if (found === null) {
      const best = measured.reduce((a, b) => (b.s.faithfulness > a.s.faithfulness ? b : a));
      $("smallest").textContent = `none of the ${measured.length} measured circuits reaches ${target}; the highest measured faithfulness is ${fmt(best.s.faithfulness)} (${best.s.label}, ${RANKING[best.s.ranking].name}).`;
    } else {
      const s = D.stops[found];
      $("smallest").innerHTML = `<b id="smallest-label">${esc(s.label)}</b>, ${esc(RANKING[s.ranking].name)} ranking, faithfulness <b>${fmt(s.faithfulness)}</b> <span class="muted">(${s.n_units.toLocaleString("en")} of ${G.n_edges_total.toLocaleString("en")} ${esc(G.units)} edges; measured at the curve's sizes only, so a circuit between two of them may reach it with fewer edges)</span>`;
      button.hidden = false;
      button.dataset.i = found;
    }
  }

  // --- details: a node or an edge ------------------------------------------------------------
  function edgeRows(edges, limit) {
    const rows = edges.slice(0, limit).map((e) => {
      const s = E.s ? E.s[e] : null;
      return `<tr data-e="${e}"><td>${esc(edgeName(e))}</td><td class="num ${signClass(s)}">${fmt(s)}</td></tr>`;
    });
    const more = edges.length > limit ? `<tr><td class="muted" colspan="2">and ${edges.length - limit} more</td></tr>` : "";
    return edges.length ? `<table class="edges">${rows.join("")}${more}</table>` : '<p class="muted">none</p>';
  }

  function showNode(i) {
    const n = NODES[i];
    const drawn = DRAWN[state.stop];
    const on = circuitNodes(drawn);
    const byScore = (a, b) => ABS[b] - ABS[a];
    const into = (kinds) => drawn.filter((e) => kinds.includes(READERS[E.r[e]].kind) && READERS[E.r[e]].owners.includes(i)).sort(byScore);
    const out = drawn.filter((e) => E.w[e] === i).sort(byScore);
    const score = i < NW && D.node_scores ? D.node_scores[i] : null;
    const html = [`<h3>${esc(n.name)} <span class="muted">(${n.kind}${n.kind === "head" || n.kind === "mlp" ? `, layer ${n.layer}` : ""}; ${on.has(i) ? "in this circuit" : "not in this circuit"})</span></h3>`];
    if (i < NW) html.push(`<p>node score <b class="${signClass(score)}" id="node-score">${fmt(score)}</b> <span class="muted">(${esc(D.node_score_note)})</span></p>`);
    if (n.kind === "head") html.push(headMaps(n));
    if (n.kind === "head") {
      html.push(`<h4>Edges into its query and key in this circuit <span class="muted">(${esc(D.method)} scores)</span></h4>${edgeRows(into(["q", "k"]), 40)}`);
      html.push(`<h4>Edges into its value</h4>${edgeRows(into(["v"]), 20)}`);
    } else if (n.kind !== "input") {
      html.push(`<h4>Edges into it in this circuit</h4>${edgeRows(into(["mlp", "logits"]), 40)}`);
    }
    if (n.kind !== "logits") html.push(`<h4>Edges out of it in this circuit</h4>${edgeRows(out, 20)}`);
    $("details").innerHTML = html.join("");
  }

  function showEdge(e) {
    const s = E.s ? E.s[e] : null;
    const html = [`<h3>${esc(edgeName(e))}</h3>`, `<p>score <b class="${signClass(s)}" id="edge-score">${fmt(s)}</b> <span class="muted">(${esc(D.method)}, ${esc(D.direction)}; into a ${READERS[E.r[e]].kind === "mlp" || READERS[E.r[e]].kind === "logits" ? READERS[E.r[e]].kind : READERS[E.r[e]].kind + " input"})</span></p>`];
    const kv = kvNote(E.r[e]);
    if (kv) html.push(`<p class="kv-note">Its reader is the ${esc(kv)}.</p>`);
    html.push(`<p class="muted">Drawn from the circuit "${esc(D.stops[FIRST_STOP[e]].label)}" on.</p>`);
    if (D.per_pair) {
      const rows = D.per_pair.map((row, p) => `<tr><td>${esc(D.pairs[p] ? D.pairs[p].label : `pair ${p + 1}`)}</td><td class="num ${signClass(row[e])}">${fmt(row[e])}</td></tr>`);
      html.push(`<h4>Per pair</h4><table class="edges">${rows.join("")}</table>`);
    }
    html.push(`<p><span class="link" data-node="${E.w[e]}">${esc(G.writers[E.w[e]])}</span> &rarr; ${READERS[E.r[e]].owners.map((o) => `<span class="link" data-node="${o}">${esc(NAMES[o])}</span>`).join(", ")}</p>`);
    $("details").innerHTML = html.join("");
  }

  // Attention pattern (0..1) beside RA (signed, centred at zero), on the tokens of the pair.
  function decode(b64, signed) {
    const bin = atob(b64), bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    return signed ? new Int8Array(bytes.buffer) : bytes;
  }

  function headMaps(n) {
    if (!D.pairs.length) return '<p class="muted">No attention pattern or RA: pass model=, clean= and metric= to to_html.</p>';
    const maps = D.heads[n.name];
    if (!maps) return '<p class="muted">No pattern or RA stored for this head: the page stores them for the heads of its largest circuit.</p>';
    const pair = D.pairs[state.pair];
    const k = pair.tokens.length, scale = maps.scale[state.pair];
    const pattern = Array.from(decode(maps.pattern[state.pair], false), (v) => v / 255);
    const ra = Array.from(decode(maps.ra[state.pair], true), (v) => (v / 127) * scale);
    const note = `RA = dM/d(QK^T) of ${esc(D.metric)}: red where a larger attention score raises M, blue where it lowers it; colours span &plusmn;${fmt(scale)}`;
    return `<div class="maps">${heatmap("attention pattern", pattern, k, pair.tokens, (v) => shade(v, 1, "#3f007d"), "pattern")}${heatmap("RA", ra, k, pair.tokens, (v) => diverging(v, scale), "ra")}</div><p class="muted">${note}. Rows: queries, columns: keys.</p>`;
  }

  function shade(v, max, hex) {
    const t = Math.max(0, Math.min(1, v / max));
    const c = [1, 3, 5].map((j) => parseInt(hex.slice(j, j + 2), 16));
    return `rgb(${c.map((x) => Math.round(255 + (x - 255) * t)).join(",")})`;
  }
  const diverging = (v, scale) => (scale > 0 ? (v >= 0 ? shade(v, scale, "#b2182b") : shade(-v, scale, "#2166ac")) : "#fff");
  const tokenLabel = (t) => t.replace(/\n/g, "\\n").replace(/ /g, "\u00a0");

  function heatmap(title, values, k, tokens, colour, cls) {
    const cell = Math.max(5, Math.min(16, Math.floor(144 / k))), left = 54, top = 4, bottom = 52;
    const W = left + cell * k + 4, Hh = top + cell * k + bottom;
    const out = [`<svg class="heat ${cls}" width="${W}" height="${Hh}" style="font:9px sans-serif">`];
    for (let q = 0; q < k; q++) {
      out.push(`<text x="${left - 3}" y="${top + cell * q + cell / 2 + 3}" text-anchor="end">${esc(tokenLabel(tokens[q]).slice(0, 9))}</text>`);
      for (let j = 0; j <= q; j++) {
        const v = values[q * k + j];
        out.push(`<rect x="${left + cell * j}" y="${top + cell * q}" width="${cell}" height="${cell}" fill="${colour(v)}" data-q="${q}" data-k="${j}" data-v="${+v.toPrecision(4)}"><title>${esc(tokenLabel(tokens[q]))} \u2190 ${esc(tokenLabel(tokens[j]))}: ${fmt(v)}</title></rect>`);
      }
    }
    for (let j = 0; j < k; j++) {
      const x = left + cell * j + cell / 2 + 3, y = top + cell * k + 4;
      out.push(`<text transform="translate(${x},${y}) rotate(-60)" text-anchor="end">${esc(tokenLabel(tokens[j]).slice(0, 9))}</text>`);
    }
    out.push(`<rect x="${left}" y="${top}" width="${cell * k}" height="${cell * k}" fill="none" stroke="#ccc"/></svg>`);
    return `<figure><figcaption>${title}</figcaption>${out.join("")}</figure>`;
  }

  // --- selection, search, size, export --------------------------------------------------------
  function selectNode(i) {
    state.node = i;
    state.edge = null;
    drawGraph();
    showNode(i);
    status(`${NAMES[i]}`);
  }
  function selectEdge(e) {
    state.edge = e;
    state.node = null;
    drawGraph();
    showEdge(e);
  }
  // Open stop i, on `walk` or on the walk that holds it (the current one when both do).
  function setStop(i, walk) {
    if (walk && WALKS[walk] && WALKS[walk].includes(i)) state.walk = walk;
    else if (!WALKS[state.walk].includes(i)) state.walk = Object.keys(WALKS).find((w) => WALKS[w].includes(i));
    state.stop = i;
    $("ranking").value = state.walk;
    $("size").max = WALKS[state.walk].length - 1;
    $("size").disabled = WALKS[state.walk].length === 1;
    $("size").value = WALKS[state.walk].indexOf(i);
    drawGraph();
    drawCurve();
    if (state.node !== null) showNode(state.node);
    else if (state.edge !== null && DRAWN[i].includes(state.edge)) showEdge(state.edge);
  }
  function status(text) { $("status").textContent = text; }

  function find(name) {
    const i = INDEX.get(name.trim());
    if (i === undefined) {
      status(`no node named "${name}": nodes are input, a{layer}.h{head}, m{layer}, logits`);
      return;
    }
    selectNode(i);
    const g = $("graph-svg").querySelector(`[data-n="${i}"]`);
    if (g && g.scrollIntoView) g.scrollIntoView({ block: "center", inline: "center" });
  }

  function svgText() {
    const svg = $("graph-svg").cloneNode(true);
    svg.setAttribute("width", WIDTH);
    svg.setAttribute("height", HEIGHT);
    return new XMLSerializer().serializeToString(svg);
  }
  function download(blob, name) {
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = name;
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }
  const fileStem = () => `circuit-${D.stops[state.stop].n_edges}-edges`;
  // The drawing as a PNG: the SVG drawn onto a canvas `scale` times its size, on white.
  function pngBlob(scale) {
    return new Promise((resolve, reject) => {
      const img = new Image();
      const url = URL.createObjectURL(new Blob([svgText()], { type: "image/svg+xml" }));
      img.onload = () => {
        const canvas = document.createElement("canvas");
        canvas.width = WIDTH * scale;
        canvas.height = HEIGHT * scale;
        const ctx = canvas.getContext("2d");
        ctx.fillStyle = "#fff";
        ctx.fillRect(0, 0, canvas.width, canvas.height);
        ctx.drawImage(img, 0, 0, canvas.width, canvas.height);
        URL.revokeObjectURL(url);
        canvas.toBlob(resolve, "image/png");
      };
      img.onerror = () => reject(new Error("the SVG could not be drawn onto a canvas"));
      img.src = url;
    });
  }

  // --- wiring ------------------------------------------------------------------------------
  $("summary").textContent = D.summary;
  $("ranking").innerHTML = Object.keys(WALKS).map((w) => `<option value="${w}">${esc(RANKING[w].option)}</option>`).join("");
  $("ranking").disabled = Object.keys(WALKS).length === 1;
  $("ranking").addEventListener("change", (ev) => {
    // the new ranking's circuit nearest in size to the current one
    const walk = ev.target.value, x = D.stops[state.stop].n_units;
    const near = WALKS[walk].reduce((a, b) => (Math.abs(D.stops[b].n_units - x) < Math.abs(D.stops[a].n_units - x) ? b : a));
    setStop(WALKS[walk].includes(state.stop) ? state.stop : near, walk);
  });
  $("size").addEventListener("input", (ev) => setStop(WALKS[state.walk][+ev.target.value]));
  $("target").value = D.target;
  $("target").addEventListener("input", showSmallest);
  $("open-smallest").addEventListener("click", (ev) => setStop(+ev.target.dataset.i));
  if (GROUP > 1) {
    const note = $("grouped-note");
    note.hidden = false;
    note.textContent = `Grouped-query model: ${G.n_heads} query heads share ${G.n_kv_heads} key/value heads per layer, so key and value readers are named by key/value head: a${L - 1}.h0<v> is the value of key/value head 0 of layer ${L - 1}, read by query heads 0-${GROUP - 1} (its edges are drawn to each of them).`;
    note.title = "MIB and EAP-IG count such an edge once per query head of the group (ungrouped edges)";
  }
  $("node-names").innerHTML = NAMES.map((n) => `<option value="${n}">`).join("");
  $("search").addEventListener("change", (ev) => find(ev.target.value));
  $("search").addEventListener("keydown", (ev) => { if (ev.key === "Enter") find(ev.target.value); });
  $("pair").innerHTML = D.pairs.map((p, i) => `<option value="${i}">${esc(p.label)}</option>`).join("");
  $("pair").disabled = D.pairs.length < 2;
  $("pair").addEventListener("change", (ev) => {
    state.pair = +ev.target.value;
    if (state.node !== null) showNode(state.node);
  });
  document.querySelectorAll(".filters input").forEach((box) => box.addEventListener("change", () => {
    if (box.checked) state.hidden.delete(box.dataset.kind);
    else state.hidden.add(box.dataset.kind);
    $("graph-svg").classList.toggle(`hide-${box.dataset.kind}`, !box.checked);
  }));
  $("zoom-in").addEventListener("click", () => setZoom(state.zoom * 1.25));
  $("zoom-out").addEventListener("click", () => setZoom(state.zoom / 1.25));
  $("zoom-fit").addEventListener("click", () => setZoom(fitZoom()));
  $("graph-wrap").addEventListener("wheel", (ev) => {
    if (!ev.ctrlKey) return; // plain wheel scrolls; ctrl + wheel zooms
    ev.preventDefault();
    setZoom(state.zoom * Math.exp(-ev.deltaY * 0.002));
  }, { passive: false });
  $("export-svg").addEventListener("click", () => download(new Blob([svgText()], { type: "image/svg+xml" }), `${fileStem()}.svg`));
  $("export-png").addEventListener("click", () => pngBlob(2).then((blob) => download(blob, `${fileStem()}.png`)));
  $("graph").addEventListener("click", (ev) => {
    const node = ev.target.closest(".node"), edge = ev.target.closest(".edge");
    if (node) selectNode(+node.dataset.n);
    else if (edge) selectEdge(+edge.dataset.e);
  });
  $("graph").addEventListener("mouseover", (ev) => {
    const node = ev.target.closest(".node"), edge = ev.target.closest(".edge");
    if (edge) {
      const e = +edge.dataset.e, kv = kvNote(E.r[e]);
      status(`${edgeName(e)}   score ${fmt(E.s ? E.s[e] : null)}${kv ? `   (reader: the ${kv})` : ""}`);
    }
    else if (node) {
      const i = +node.dataset.n;
      status(`${NAMES[i]}${i < NW && D.node_scores ? `   node score ${fmt(D.node_scores[i])}` : ""}`);
    }
  });
  $("details").addEventListener("click", (ev) => {
    const row = ev.target.closest("tr[data-e]"), link = ev.target.closest("[data-node]");
    if (row) selectEdge(+row.dataset.e);
    else if (link) selectNode(+link.dataset.node);
  });
  $("curve").addEventListener("click", (ev) => {
    const pt = ev.target.closest(".pt");
    if (pt) setStop(+pt.dataset.i);
  });

  state.zoom = fitZoom();
  setStop(D.start, state.walk);
  showSmallest();
  // For tests and the benchmark: when the first drawing reached the screen, and the page's API.
  requestAnimationFrame(() => setTimeout(() => { window.raLensFirstPaint = performance.now(); }, 0));
  window.raLens = {
    setStop,
    selectNode: (name) => INDEX.has(name) && (selectNode(INDEX.get(name)), true),
    svgText,
    pngBlob,
    drawn: () => DRAWN[state.stop].length,
    stops: D.stops.length,
    current: () => ({ stop: state.stop, walk: state.walk }),
    smallest: (target) => smallest(target).found,
  };
})();

"""The site's one stylesheet and one script, written once into ``OUT/assets/`` (no CDN, no network).

Why two shared files rather than inlining them in every page: a 19 200-atom site would
otherwise carry 19 200 copies; relative ``<link>`` / ``<script src>`` load from disk
(``file://``) as well as over ``python -m http.server``. The pages hold their data in
attributes and one JSON block, and the script draws from it: heatmaps on a ``<canvas>`` over
each thumbnail (no extra image files), the sortable, searchable index table.
"""

CSS = """
:root { --fg: #1d1f23; --muted: #666b73; --line: #dde0e5; --accent: #c2410c; --bg: #fafafa; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg); background: var(--bg);
       margin: 0 auto; max-width: 1280px; padding: 16px 24px 48px; }
a { color: #1d4ed8; text-decoration: none; } a:hover { text-decoration: underline; }
header { display: flex; flex-wrap: wrap; align-items: baseline; gap: 6px 18px; border-bottom: 1px solid var(--line);
         padding-bottom: 8px; margin-bottom: 12px; }
header h1 { font-size: 22px; margin: 0 12px 0 0; }
nav a { margin-right: 10px; }
.muted { color: var(--muted); }
.stats { display: flex; flex-wrap: wrap; gap: 8px 28px; margin: 8px 0 14px; }
.stats b { display: block; font-size: 18px; }
.row { display: flex; flex-wrap: wrap; gap: 24px; align-items: flex-start; }
.atom-image img { width: 112px; height: 112px; image-rendering: pixelated; border: 1px solid var(--line); }
.nearest ol { margin: 4px 0; padding-left: 28px; columns: 2; column-gap: 40px; min-width: 300px; }
h2 { font-size: 16px; margin: 16px 0 8px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(190px, 1fr)); gap: 14px; }
figure.card { margin: 0; background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 8px; }
.frame { position: relative; width: 100%; aspect-ratio: 1 / 1; background: #eee; }
.frame img { position: absolute; inset: 0; width: 100%; height: 100%; object-fit: fill; }
.frame img.pixels, img.pixels { image-rendering: pixelated; }
.frame canvas { position: absolute; inset: 0; width: 100%; height: 100%; }
body.no-heat .frame canvas { display: none; }
.frame.changed p { margin: 0; padding: 8px; }
.prefix { display: flex; gap: 4px; margin-top: 6px; min-height: 20px; }
.prefix .tok { font-size: 11px; padding: 1px 5px; border: 1px solid var(--line); border-radius: 3px; }
.prefix .tok.top { outline: 2px solid var(--accent); }
figcaption { margin-top: 6px; font-size: 12px; overflow-wrap: anywhere; }  /* long ids wrap; numbers are never split */
figcaption .value { font-weight: 600; font-size: 14px; }
.value, .num { white-space: nowrap; }
.controls { display: flex; gap: 16px; align-items: center; margin: 8px 0; }
.controls input { font-size: 14px; padding: 4px 8px; width: 160px; }
table { border-collapse: collapse; width: 100%; background: #fff; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 8px; text-align: right; }
th { position: sticky; top: 0; background: #f0f1f3; cursor: pointer; user-select: none; }
th.sorted-asc::after { content: " \\25B2"; } th.sorted-desc::after { content: " \\25BC"; }
td.id, th.id { text-align: left; }
td img { width: 40px; height: 40px; vertical-align: middle; object-fit: cover; }
.legend { display: inline-block; width: 120px; height: 10px; vertical-align: middle;
          background: linear-gradient(to right, rgba(255,80,0,0), rgba(255,80,0,.7)); border: 1px solid var(--line); }
"""

JS = r"""
"use strict";
const LEVEL_MAX = 250, NOT_STORED = 255;

function heatColour(level) {
  const a = 0.7 * level / LEVEL_MAX;
  return "rgba(255,80,0," + a.toFixed(3) + ")";
}

function decode(b64) {
  const s = atob(b64), out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}

function drawCard(card, layout) {
  const levels = decode(card.dataset.heat), top = Number(card.dataset.top);
  const canvas = card.querySelector("canvas");
  if (canvas && layout.grid[0] > 0) {
    const [gh, gw] = layout.grid, cell = 16, ctx = canvas.getContext("2d");
    canvas.width = gw * cell; canvas.height = gh * cell;
    for (let r = 0; r < gh; r++) for (let c = 0; c < gw; c++) {
      const level = levels[layout.n_prefix + r * gw + c];
      if (level === NOT_STORED) {            // the extraction stored no token here
        ctx.fillStyle = "rgba(40,40,40,0.55)";
      } else {
        ctx.fillStyle = heatColour(level);
      }
      ctx.fillRect(c * cell, r * cell, cell, cell);
    }
    if (top >= layout.n_prefix) {
      const p = top - layout.n_prefix, r = Math.floor(p / gw), c = p % gw;
      ctx.strokeStyle = "#1d4ed8"; ctx.lineWidth = 2;
      ctx.strokeRect(c * cell + 1, r * cell + 1, cell - 2, cell - 2);
    }
  }
  card.querySelectorAll(".prefix .tok").forEach(tok => {
    const i = Number(tok.dataset.i), level = levels[i];
    tok.style.background = level === NOT_STORED ? "#ccc" : heatColour(level);
    if (level === NOT_STORED) tok.title = "not stored by the extraction";
    if (i === top) tok.classList.add("top");
  });
}

function atomPage() {
  const layout = JSON.parse(document.getElementById("layout").textContent);
  document.querySelectorAll("figure.card[data-heat]").forEach(card => drawCard(card, layout));
  const toggle = document.getElementById("show-heat");
  if (toggle) toggle.addEventListener("change", () => document.body.classList.toggle("no-heat", !toggle.checked));
  document.addEventListener("keydown", e => {
    if (e.target.tagName === "INPUT") return;
    const link = document.querySelector(e.key === "ArrowLeft" ? "a.prev" : e.key === "ArrowRight" ? "a.next" : null);
    if (link) location.href = link.href;
  });
}

function fmt(v, digits) { return v === null ? "–" : Number(v).toPrecision(digits); }

function indexPage() {
  const data = JSON.parse(document.getElementById("atom-data").textContent);
  const cols = data.columns, rows = data.rows, tbody = document.querySelector("#atoms tbody");
  const search = document.getElementById("search"), count = document.getElementById("count");
  const hooks = window.siteIndexHooks || null;  // assets/labels.js: label cells and filter
  let key = data.sort || "id", desc = key !== "id";  // labelled data: by the excess over chance, largest first
  function render() {
    const q = search.value.trim();
    let shown = q === "" ? rows.slice() : rows.filter(r => String(r[0]).startsWith(q));
    if (hooks) shown = shown.filter(r => hooks.filter(r, cols));
    const k = cols.indexOf(key);
    shown.sort((a, b) => {
      const x = a[k], y = b[k];
      if (x === y) return a[0] - b[0];
      if (x === null) return 1; if (y === null) return -1;
      return desc ? y - x : x - y;
    });
    const html = [];
    shown.forEach((r, i) => {
      const lazy = i >= 100 ? ' loading="lazy"' : "";
      const img = r[cols.indexOf("thumb")];
      const cells = ['<td class="id">' + (r[cols.indexOf("page")] ? '<a href="' + r[cols.indexOf("page")] + '">#' + r[0] + "</a>" : "#" + r[0]) + "</td>"];
      if (data.atom_images) cells.push('<td><img class="pixels" alt="atom ' + r[0] + '" src="' + data.atom_images + r[0] + '.png"' + lazy + "></td>");
      cells.push("<td>" + (img ? '<img class="' + data.thumb_class + '" alt="" src="' + img + '"' + lazy + ">" : "") + "</td>");
      cells.push("<td>" + fmt(r[cols.indexOf("frequency")], 3) + "</td>");
      cells.push("<td>" + fmt(r[cols.indexOf("mean_value")], 3) + "</td>");
      cells.push("<td>" + fmt(r[cols.indexOf("max_value")], 3) + "</td>");
      const near = r[cols.indexOf("nearest")];
      cells.push("<td>" + fmt(r[cols.indexOf("max_cosine")], 3) + (near === null ? "" : ' <span class="muted">#' + near + "</span>") + "</td>");
      if (data.has_steps) cells.push("<td>" + fmt(r[cols.indexOf("mean_step")], 3) + "</td>");
      if (data.replicas) {  // features --replicas: found in j of N seeds, the partners' |cos| as its tooltip
        const cos = r[cols.indexOf("replica_cosine")].map(c => fmt(c, 3)).join(", ");
        cells.push('<td title="partner |cos| per replica: ' + cos + '">' + r[cols.indexOf("found_in")] + " of " + data.replicas + "</td>");
      }
      if (hooks) cells.push(...hooks.cells(r, cols));
      const cls = hooks && hooks.rowClass ? hooks.rowClass(r, cols) : "";
      html.push('<tr data-id="' + r[0] + '"' + (cls ? ' class="' + cls + '"' : "") + ">" + cells.join("") + "</tr>");
    });
    tbody.innerHTML = html.join("");
    count.textContent = shown.length + " of " + rows.length + " atoms";
    document.querySelectorAll("th[data-key]").forEach(th => {
      th.classList.toggle("sorted-asc", th.dataset.key === key && !desc);
      th.classList.toggle("sorted-desc", th.dataset.key === key && desc);
    });
  }
  document.querySelectorAll("th[data-key]").forEach(th => th.addEventListener("click", () => {
    if (key === th.dataset.key) desc = !desc; else { key = th.dataset.key; desc = key !== "id"; }
    render();
  }));
  window.renderIndex = render;
  search.addEventListener("input", render);
  search.addEventListener("keydown", e => {
    if (e.key !== "Enter") return;
    const row = rows.find(r => String(r[0]) === search.value.trim());
    if (row && row[cols.indexOf("page")]) location.href = row[cols.indexOf("page")];
  });
  render();
}

document.addEventListener("DOMContentLoaded", () => {
  if (document.getElementById("atom-data")) indexPage(); else atomPage();
});
"""

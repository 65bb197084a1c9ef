"""The label parts' stylesheet and script, written once as ``OUT/assets/labels.css|js`` (no CDN, no network).

The script plugs into the index table of ``assets/site.js`` through ``window.siteIndexHooks``
(four cells per row, a row class for the verdict against chance, the top-label filter) and draws
the scatter of selectivity against the labelled images an atom fires on, with the curve
``E[S | n]``, on a ``<canvas>`` from the index's JSON block, so the figure
costs no file per atom and opens offline.
"""

LABELS_CSS = """
td.label { text-align: left; }
.labels .formula { font-size: 12px; max-width: 1000px; }
.lbars { max-width: 720px; margin: 6px 0; }
.lbar-row { display: grid; grid-template-columns: 260px 1fr; align-items: center; gap: 8px; margin: 3px 0; }
svg.lbar { width: 100%; height: 16px; background: #f0f1f3; border: 1px solid var(--line); }
.legend-labels { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12px; margin-top: 4px; }
.legend-labels i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: middle; }
figure.scatter { margin: 8px 0; }
figure.scatter canvas { border: 1px solid var(--line); background: #fff; max-width: 100%; }
article.label-atom { border-top: 1px solid var(--line); padding: 6px 0 10px; }
article.label-atom h3 { font-size: 15px; margin: 4px 0; }
.thumbs img { width: 64px; height: 64px; object-fit: cover; margin: 2px; border: 2px solid transparent; }
.thumbs img.pixels { image-rendering: pixelated; }
.thumbs img.mine { border-color: var(--accent); }
tr.few td { color: var(--muted); opacity: 0.55; }
.tag.tie { background: #eef2ff; color: #3730a3; }
td { white-space: nowrap; }
tr.few td img { filter: grayscale(1); }
.tag { font-size: 11px; padding: 0 4px; border-radius: 3px; margin-left: 4px; white-space: nowrap; }
.tag.chance { background: #fde2e1; color: #8a1c14; }
.tag.few { background: #eceef1; color: var(--muted); }
p.chance.beats b { color: #166534; } p.chance.null b { color: #8a1c14; } p.chance.few { color: var(--muted); }
"""

LABELS_JS = r"""
"use strict";
(function () {
  let data = null;
  const select = () => document.getElementById("label-filter");
  const ESC = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"};
  function esc(s) { return String(s).replace(/[&<>"]/g, c => ESC[c]); }
  // one notation for every p-value, as the atom pages write them: 1.1e-4, 1.0e0
  function pValue(p) { return p === null ? "–" : p.toExponential(1).replace("e+", "e"); }
  window.labelsPValue = pValue;
  window.siteIndexHooks = {
    cells(r, cols) {
      if (!data || !data.labels) return [];
      const s = r[cols.indexOf("selectivity")], label = r[cols.indexOf("top_label")], q = r[cols.indexOf("top_share")];
      const excess = r[cols.indexOf("excess")], p = r[cols.indexOf("p_adjusted")], verdict = r[cols.indexOf("verdict")];
      const tied = r[cols.indexOf("top_ties")];
      const range = (lo, hi) => lo === null ? "" : ' <span class="muted">[' + lo.toFixed(2) + ", " + hi.toFixed(2)
        + "]</span>";
      const name = label === null ? "–" : esc(data.labels[label])  // the label pages are linked above the table
        + (tied ? ' <span class="tag tie" title="other labels share the top q; the lowest id is shown">+' + tied
                  + " tied</span>" : "");
      const tag = verdict === 1 ? '<span class="tag chance" title="does not beat chance at the FDR">chance</span>'
        : verdict === 0 ? '<span class="tag few" title="too few images to say">few</span>' : "";
      const cells = ["<td>" + (s === null ? "–" : s.toFixed(3)) + range(r[cols.indexOf("selectivity_low")],
                                                                  r[cols.indexOf("selectivity_high")]) + "</td>",
              "<td>" + (excess === null ? "–" : excess.toFixed(3)) + "</td>",
              "<td>" + pValue(p) + tag + "</td>",
              '<td class="label">' + name + (q === null ? "" : ' <span class="muted">' + q.toFixed(3) + "</span>"
              + range(r[cols.indexOf("top_share_low")], r[cols.indexOf("top_share_high")])) + "</td>"];
      if (data.weighted) {  // S_w, weighted by activation, and its interval
        const sw = r[cols.indexOf("weighted_selectivity")];
        const lo = r[cols.indexOf("weighted_selectivity_low")], hi = r[cols.indexOf("weighted_selectivity_high")];
        const swRange = range(lo, hi);
        cells.push("<td>" + (sw === null ? "–" : sw.toFixed(3)) + swRange + "</td>");
      }
      return cells;
    },
    rowClass(r, cols) {
      const verdict = r[cols.indexOf("verdict")];
      return verdict === 0 ? "few" : verdict === 1 ? "chance" : verdict === 2 ? "beats" : "";
    },
    filter(r, cols) {
      const el = select();
      return !el || el.value === "" || String(r[cols.indexOf("top_label")]) === el.value;
    },
  };

  function scatter() {
    const canvas = document.getElementById("scatter");
    if (!canvas || !data || !data.labels) return;
    const cols = data.columns, fi = cols.indexOf("n_labelled"), si = cols.indexOf("selectivity");
    const li = cols.indexOf("top_label"), pi = cols.indexOf("page");
    const points = data.rows.filter(r => r[fi] > 0 && r[si] !== null);
    const ctx = canvas.getContext("2d"), W = canvas.width, H = canvas.height, m = {l: 60, r: 12, t: 10, b: 34};
    ctx.clearRect(0, 0, W, H);
    const xs = points.map(r => Math.log10(r[fi]));
    const x0 = 0, x1 = Math.max(Math.ceil(Math.max(...xs, 0)), 1);
    const X = v => m.l + (v - x0) / Math.max(x1 - x0, 1e-9) * (W - m.l - m.r);
    const Y = v => H - m.b - v * (H - m.t - m.b);
    ctx.strokeStyle = "#999"; ctx.fillStyle = "#333"; ctx.font = "11px sans-serif"; ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(m.l, m.t); ctx.lineTo(m.l, H - m.b); ctx.lineTo(W - m.r, H - m.b); ctx.stroke();
    for (let d = x0; d <= x1; d++) {
      const t = String(10 ** d);
      ctx.fillText(t, Math.min(X(d) - 3 * t.length, W - m.r - 6 * t.length), H - m.b + 14);
    }
    [0, 0.5, 1].forEach(v => ctx.fillText(v.toFixed(1), m.l - 24, Y(v) + 4));
    ctx.fillText("labelled images it fires on, n (log scale)", W / 2 - 110, H - 4);
    const curve = (data.chance_curve || []).filter(c => c[0] >= 1);
    if (curve.length) {  // E[S | n]: what n random images score
      ctx.strokeStyle = "#555"; ctx.lineWidth = 1.5; ctx.beginPath();
      curve.forEach((c, i) => {
        const px = X(Math.log10(c[0])), py = Y(c[1]);
        if (i) ctx.lineTo(px, py); else ctx.moveTo(px, py);
      });
      ctx.stroke(); ctx.lineWidth = 1; ctx.fillStyle = "#555";
      ctx.fillText("E[S | n]", X(Math.log10(curve[curve.length - 1][0])) - 44, Y(curve[curve.length - 1][1]) - 6);
    }
    ctx.save(); ctx.translate(14, H / 2 + 30); ctx.rotate(-Math.PI / 2);
    ctx.fillText("selectivity S", 0, 0); ctx.restore();
    const chosen = select() ? select().value : "";
    const hits = [];
    points.forEach((r, i) => {
      const px = X(xs[i]), py = Y(r[si]), label = r[li];
      const on = chosen === "" || String(label) === chosen;
      ctx.globalAlpha = on ? 0.8 : 0.12;
      ctx.fillStyle = label === null ? "#888" : data.colours[label];  // the label's colour on every page
      ctx.beginPath(); ctx.arc(px, py, on && chosen !== "" ? 3.5 : 2.5, 0, 2 * Math.PI); ctx.fill();
      if (on && r[pi]) hits.push([px, py, r[pi]]);
    });
    ctx.globalAlpha = 1;
    canvas.onclick = e => {
      const box = canvas.getBoundingClientRect(), sx = W / box.width, sy = H / box.height;
      const x = (e.clientX - box.left) * sx, y = (e.clientY - box.top) * sy;
      let best = null, bestD = 64;
      hits.forEach(h => { const d = (h[0] - x) ** 2 + (h[1] - y) ** 2; if (d < bestD) { bestD = d; best = h; } });
      if (best) location.href = best[2];
    };
  }

  document.addEventListener("DOMContentLoaded", () => {
    const block = document.getElementById("atom-data");
    if (!block) return;
    data = JSON.parse(block.textContent);
    const el = select();
    if (el) el.addEventListener("change", () => { if (window.renderIndex) window.renderIndex(); scatter(); });
    scatter();
  });
})();
"""

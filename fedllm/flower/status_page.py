"""The operator's live page of a run (``fedllm flower status RUN_DIR --serve``): one read-only HTML page that asks
``/status.json`` every second and renders it — the connected SuperNodes, the round, each round's clients (arrived,
late, dropped), bytes, losses, ε spent and the ETA (:func:`fedllm.runs.live_status.run_status`: an allow-list, no
secrets). Served on 127.0.0.1 unless told otherwise; only GET, nothing on the page can change the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedllm.runs.live_status import run_status

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fedllm run status</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 2em; color: #222 }
table { border-collapse: collapse; margin-top: 1em } td, th { padding: 2px 10px; border-bottom: 1px solid #ddd;
text-align: right } th { background: #f4f4f4 } .late { color: #b26b00 } .dropped { color: #b00020 }
</style></head>
<body>
<h1>Run <span id="run">…</span> <small id="strategy"></small></h1>
<p>Round <b id="round">0</b> of <b id="rounds">?</b> · <span id="state">loading</span> · ETA <span id="eta">-</span>
 · SuperNodes connected: <b id="nodes">-</b> (clients served: <span id="serving">-</span>)
 · ε spent: <span id="epsilon">-</span> · bytes up <span id="up">0</span> MiB, down <span id="down">0</span> MiB</p>
<table><thead><tr><th>round</th><th>clients</th><th>late</th><th>dropped</th><th>loss</th><th>up MiB</th>
<th>down MiB</th><th>seconds</th></tr></thead><tbody id="history"></tbody></table>
<p><small>Updated <span id="updated">never</span>; read-only.</small></p>
<script>
const $ = (id) => document.getElementById(id);
const mib = (b) => (b / 1048576).toFixed(3);
const list = (xs) => xs.length ? xs.join(", ") : "-";
function cell(text, cls) { const td = document.createElement("td"); td.textContent = text;
  if (cls) td.className = cls; return td; }
function render(s) {
  $("run").textContent = s.run; $("strategy").textContent = s.strategy;
  $("round").textContent = s.round; $("rounds").textContent = s.rounds; $("state").textContent = s.state;
  $("eta").textContent = s.eta_s === null ? "-" : Math.round(s.eta_s) + " s";
  $("nodes").textContent = s.nodes === null ? "-" : s.nodes.connected;
  $("serving").textContent = s.nodes === null ? "-" : s.nodes.serving + " of " + s.num_clients;
  $("epsilon").textContent = s.epsilon === null ? "-" : s.epsilon.toPrecision(3);
  $("up").textContent = mib(s.bytes_up); $("down").textContent = mib(s.bytes_down);
  const body = $("history"); body.replaceChildren();
  for (const r of s.history) {
    const tr = document.createElement("tr");
    tr.append(cell(r.round), cell(list(r.clients)), cell(list(r.late), "late"), cell(list(r.dropped), "dropped"),
              cell(r.loss === null ? "-" : r.loss.toFixed(4)), cell(mib(r.bytes_up)), cell(mib(r.bytes_down)),
              cell(r.seconds === null ? "-" : r.seconds.toFixed(1)));
    body.append(tr);
  }
  $("updated").textContent = new Date().toLocaleTimeString();
}
async function refresh() {
  try { const r = await fetch("status.json", {cache: "no-store"}); if (r.ok) render(await r.json()); }
  finally { setTimeout(refresh, 1000); }
}
refresh();
</script></body></html>
"""


def build_app(run_dir: str | Path) -> Any:
    """The page's FastAPI app: ``GET /`` (the page) and ``GET /status.json`` (the run's status)."""
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    headers = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
               "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"}

    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        return HTMLResponse(PAGE, headers=headers)

    @app.get("/status.json")
    def status() -> JSONResponse:
        return JSONResponse(run_status(run_dir), headers=headers)

    return app


def serve_status(run_dir: str | Path, sock: Any) -> None:
    """Serve the page on the listening socket ``sock`` until interrupted."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    print(f"fedllm: status of {run_dir} at http://{host}:{port}/ (read-only; Ctrl-C stops)", flush=True)
    uvicorn.Server(uvicorn.Config(build_app(run_dir), log_level="warning")).run(sockets=[sock])

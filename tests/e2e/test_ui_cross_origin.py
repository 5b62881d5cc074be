"""Another page on the studio's host, in the browser where an admin is logged in: the browser
sends it the UI's SameSite=Strict cookie (another port is the same site), so what stops it is
the studio refusing requests from other origins (app/same_origin.py). The page tries what an
attacker's would: the UI's event queue and the API with the cookie, and reading the answers."""

from __future__ import annotations

import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

from ui_helpers import login

ATTACK = """async (studio) => {
  const out = {};
  const body = JSON.stringify({data: [null], fn_index: 0, trigger_id: null,
                               session_hash: "crossorigin1"});
  try {
    const r = await fetch(studio + "/ui/gradio_api/queue/join", {method: "POST",
      credentials: "include", headers: {"Content-Type": "application/json"}, body});
    out.join = "answered " + r.status + " " + await r.text();
  } catch (e) { out.join = "refused: " + e.name; }
  try {  // a simple request: no preflight, the cookie sent
    const r = await fetch(studio + "/ui/config", {credentials: "include"});
    out.config = "answered " + r.status;
  } catch (e) { out.config = "refused: " + e.name; }
  return out;
}"""


def test_a_page_on_another_port_cannot_use_the_logged_in_ui(server, browser, tmp_path):
    (tmp_path / "index.html").write_text("<html><body>another page</body></html>")
    handler = partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    other = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(60_000)
        login(page, server, server.admin_token)  # the session cookie is now in this browser
        page.goto(f"http://127.0.0.1:{other.server_address[1]}/index.html")
        out = page.evaluate(ATTACK, server.base)
        # the event queue: its preflight is a 403 with no CORS answer, so the browser never
        # sends the event; the simple GET reaches the studio and is a 403 it cannot read
        assert out["join"] == "refused: TypeError", out
        assert out["config"] == "refused: TypeError", out
    finally:
        context.close()
        other.shutdown()

"""What miles-lp adds inside the SGLang server process: its introspection endpoints and its CPU linear method.

SGLang 0.5.23 has no plugin point for either, so ``install()`` does the least invasive thing, in this one place:

* it wraps ``ModelRunner.load_model`` so that, once SGLang built its model, the scheduler process (TP rank 0) serves
  ``SGLangIntrospection`` of that very model on a loopback port of its own (``MILES_LP_SGLANG_INTROSPECT_PORT``),
  through ``miles-lp serve``'s handler (the same ``/miles_lp/*`` JSON and safetensors answers, the same API key);
* ``linear.register()`` gives SGLang's CPU platform the MXFP8 linear method it lacks (``linear``: why, and how);
* ``add_routes(app)`` adds ``/miles_lp/{path}`` to SGLang's FastAPI app in the HTTP process, forwarding each
  request to that port: a client talks to one URL, SGLang's own routes untouched;

``install()`` runs at the import of ``miles_lp.rollout.sglang_cpu.serve``, the module the server is started as:
SGLang starts its scheduler with multiprocessing's spawn, which imports that module again in the child, so the
wrap is in place there before SGLang loads the model. Nothing here unpickles anything: the introspection answers
are JSON or safetensors, and weights reach SGLang only through its ``/update_weights_from_disk``.
"""

from __future__ import annotations

import logging
import os

from miles_lp.rollout.sglang_cpu.launch import ENV_KEY  # the introspection key the launcher hands over

ENV_PORT = "MILES_LP_SGLANG_INTROSPECT_PORT"
FAULT_PATH = "/miles_lp/inject_fault"

logger = logging.getLogger("miles_lp.sglang_cpu")
_started: list = []


def install() -> None:
    """Wrap SGLang's ``ModelRunner.load_model`` (once per process); register the CPU linear method."""
    from sglang.srt.model_executor import model_runner as mr

    from miles_lp.rollout.sglang_cpu import linear

    linear.register()
    orig = mr.ModelRunner.load_model
    if getattr(orig, "_miles_lp", False):
        return

    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if int(getattr(self, "tp_rank", 0)) == 0 and os.environ.get(ENV_PORT):
            _serve(self)
        return out

    load_model._miles_lp = True
    mr.ModelRunner.load_model = load_model


def _serve(runner) -> None:
    """The introspection server of ``runner.model`` on loopback (once: a reload keeps the model object)."""
    if _started:
        return
    from miles_lp.rollout.server import RequestHandler, serve_in_thread
    from miles_lp.rollout.sglang_cpu.introspect import SGLangIntrospection

    class _WithFaults(RequestHandler):
        def do_POST(self):
            from miles_lp.rollout.server import POST

            self._dispatch({**POST, FAULT_PATH: _WithFaults.fault})

        def fault(self, q):
            d = self._json()
            self._send(200, self.server.engine.inject(str(d.get("kind")), str(d.get("name"))))

    srv = serve_in_thread(SGLangIntrospection(runner), "127.0.0.1", int(os.environ[ENV_PORT]),
                          os.environ.get(ENV_KEY) or None)
    srv.RequestHandlerClass = _WithFaults
    _started.append(srv)
    logger.info("miles-lp introspection of the SGLang model on %s", srv.url)


def add_routes(app) -> None:
    """``/miles_lp/{path}`` on SGLang's FastAPI ``app``, forwarded to the scheduler's introspection port."""
    import asyncio
    import urllib.error
    import urllib.request

    from fastapi import Request
    from fastapi.responses import Response

    port = int(os.environ[ENV_PORT])

    def forward(method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, str]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/miles_lp/{path}", data=body if method == "POST"
                                     else None, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return r.status, r.read(), r.headers.get("Content-Type", "application/json")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), exc.headers.get("Content-Type", "application/json")
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            msg = f'{{"error": {{"message": "the model is not loaded yet ({type(exc).__name__})"}}}}'
            return 503, msg.encode(), "application/json"

    async def route(path: str, request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        code, data, ctype = await asyncio.to_thread(forward, request.method, path, await request.body(), headers)
        return Response(content=data, status_code=code, media_type=ctype)

    # this module's annotations are strings (``from __future__ import annotations``) that FastAPI cannot resolve in
    # this function's scope: the real classes, so it passes the request instead of reading a query field
    route.__annotations__ = {"path": str, "request": Request}
    app.add_api_route("/miles_lp/{path:path}", route, methods=["GET", "POST"])


def prepare_env() -> None:
    """In the HTTP process, before SGLang spawns its scheduler: the introspection port and key it inherits."""
    if not os.environ.get(ENV_PORT):
        from miles_lp.ports import free_port

        os.environ[ENV_PORT] = str(free_port())
    if not os.environ.get(ENV_KEY):
        from miles_lp.rollout.server import api_key_from_env

        key = api_key_from_env()
        if key:
            os.environ[ENV_KEY] = key


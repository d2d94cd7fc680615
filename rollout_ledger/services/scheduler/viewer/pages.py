"""The viewer's static page under ``/viewer``: one HTML shell, its script and stylesheet, with strict headers.

The shell holds no data (every datum comes from ``/v1/viewer`` with a read token), so it is served without a
token. Trajectory text is hostile input: the Content-Security-Policy allows only this origin's script and styles,
no inline script, no framing, and the script writes ledger text escaped or as ``textContent``.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

VIEWER_PATH = "/viewer"
STATIC_DIR = Path(__file__).parent / "static"
SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class _ViewerFiles(StaticFiles):
    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def mount_viewer(app: FastAPI) -> None:
    """Serve the viewer at ``/viewer/`` (``/viewer`` redirects there)."""
    app.mount(VIEWER_PATH, _ViewerFiles(directory=STATIC_DIR, html=True), name="viewer")


def viewer_url(base_url: str, fragment: str = "/batches") -> str:
    """The viewer's address for a page, e.g. ``viewer_url(url, f"/batch/{batch_id}")``."""
    return f"{base_url.rstrip('/')}{VIEWER_PATH}/#{fragment}"

"""The chat page: ``GET /`` answers static/index.html, ``/static/...`` its script, styles and icon.

Plain files shipped in the package (no build step). The page talks only to this server, which its
Content-Security-Policy enforces: no CDN, no web fonts, no other origin. Neither route needs an API
key (the page holds no secret); the page sends the key the user types with each /v1 request.
"""

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")

# Everything from this origin only; no inline script or style; the page may not be framed.
CSP = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
       "form-action 'none'; frame-ancestors 'none'")


def add_chat_page(app: FastAPI) -> None:
    """Serve the chat page at / and its assets at /static/ (both left out of the OpenAPI document)."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8",
                            headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

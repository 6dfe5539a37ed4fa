"""Command: api (the HTTP search service over a store's aliases; it follows them as they move)."""

from __future__ import annotations

import os
from typing import Optional

import typer

from imgest.cli import _fail, _user_errors, app


@app.command()
def api(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (put a proxy in front for other hosts)"),
    port: int = typer.Option(8000, help="Port to listen on"),
    alias: Optional[list[str]] = typer.Option(None, help="Alias to serve; repeat for several (the first is the "
                                                         "default of a request). Default: serving, and captions "
                                                         "where the store has a caption retriever"),
    follow_every: float = typer.Option(5.0, help="Seconds between checks of the alias records"),
    device: str = typer.Option("auto", help="Where to embed the queries"),
    shadow_share: float = typer.Option(0.0, help="During a migration window, this share of the queries serving "
                                                 "answers is also run on the candidate (shadow), off the request "
                                                 "path; overlap@k and both latencies go to the store for `imgest "
                                                 "migrate status` and `promote --min-shadow-agreement`"),
    route: Optional[str] = typer.Option(None, help="A routing table from imgest eval --compare --out (routing.json): "
                                                   "a request's query_class chooses the retriever; its aliases are "
                                                   "served too"),
) -> None:
    """Serve search over HTTP (the page at /, POST /search, GET /aliases, /healthz, /metrics), following the
    aliases as they move. IMGEST_API_TOKEN, when set, is the bearer token every request but / and /healthz must
    carry."""
    try:
        if not 0.0 <= shadow_share <= 1.0:
            raise ValueError(f"--shadow-share must be between 0 and 1, got {shadow_share}")
        from imgest.tasks.search.combined import read_route
        from imgest.tasks.search.following import FollowingSearcher
        from imgest.tasks.search.service import create_app

        table = read_route(route) if route else None
        if not alias:  # text queries to an image-only serving model go to the caption retriever: serve it too
            from imgest.storage import open_location
            from imgest.tasks.migration.aliases import read_alias
            from imgest.tasks.search.combined import CAPTIONS

            has_captions = read_alias(open_location(store, must_exist=True, what="store"), CAPTIONS) is not None
            alias = ["serving", *([CAPTIONS] if has_captions else [])]
        follower = FollowingSearcher(store, tuple(dict.fromkeys(alias)), device=device, route=table)
        follower.refresh()
        if not follower.ready():
            raise RuntimeError("; ".join(f"{name}: {s['error']}" for name, s in follower.status().items()
                                         if s["error"]))
        shadow = None
        if shadow_share > 0:
            from imgest.tasks.search.shadow import ShadowTraffic

            shadow = ShadowTraffic(store, shadow_share, device=device, check_every_s=follow_every)
    except (*_user_errors(), RuntimeError, ValueError) as exc:
        _fail(exc)
    import uvicorn

    follower.follow(every=follow_every)
    if shadow is not None:
        shadow.start()
    typer.echo(f"imgest api: serving {', '.join(follower.aliases)} of {follower.store.url} on http://{host}:{port}",
               err=True)
    try:
        uvicorn.run(create_app(follower, token=os.environ.get("IMGEST_API_TOKEN") or None, shadow=shadow), host=host,
                    port=port, log_level="warning")
    finally:
        follower.close()
        if shadow is not None:
            shadow.close()  # the rows measured since the last part are written

"""Command: api (the HTTP search service over a store's aliases; it follows them as they move)."""

from __future__ import annotations

import ipaddress
import os
from typing import Optional

import typer

from imgest.cli.app import app, fail
from imgest.errors import USER_ERRORS

TOKEN_VARIABLE = "IMGEST_API_TOKEN"


def is_loopback(host: str) -> bool:
    """Whether `host` is an address only this machine reaches: 127.0.0.0/8, ::1 (also as ::ffff:127.x.x.x), or
    localhost. Another name may resolve to anything, so it is not."""
    name = host.strip().strip("[]").rstrip(".").lower()
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def refuse_open_service(host: str, no_token: bool) -> None:
    """The service shows every item's thumbnail and metadata to whoever reaches it: beyond loopback it needs
    the token, or --no-token said on purpose."""
    if not no_token and not os.environ.get(TOKEN_VARIABLE) and not is_loopback(host):
        raise ValueError(f"--host {host} is reachable from other machines and {TOKEN_VARIABLE} is not set: anyone "
                         f"who reaches the service would see every item's thumbnail and metadata; set "
                         f"{TOKEN_VARIABLE} (clients send Authorization: Bearer <token>), or pass --no-token on a "
                         "trusted network")


@app.command()
def api(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    host: str = typer.Option("127.0.0.1", help="Address to listen on; beyond loopback it needs IMGEST_API_TOKEN "
                                               "or --no-token (put a proxy in front for other hosts)"),
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
    no_token: bool = typer.Option(False, "--no-token", help="Listen beyond loopback without IMGEST_API_TOKEN, on a "
                                                            "trusted network only: whoever reaches the port sees "
                                                            "every item's thumbnail and metadata"),
) -> None:
    """Serve search over HTTP (the page at /, POST /search, GET /aliases, /healthz, /metrics), following the
    aliases as they move. IMGEST_API_TOKEN, when set, is the bearer token every request but / and /healthz must
    carry; a --host other than loopback is refused without it (or --no-token)."""
    try:
        refuse_open_service(host, no_token)
        if not 0.0 <= shadow_share <= 1.0:
            raise ValueError(f"--shadow-share must be between 0 and 1, got {shadow_share}")
        from imgest.retrieval.combined import read_route
        from imgest.retrieval.following import FollowingSearcher
        from imgest.tasks.search.service import create_app

        table = read_route(route) if route else None
        if not alias:  # text queries to an image-only serving model go to the caption retriever: serve it too
            from imgest.retrieval.combined import CAPTIONS
            from imgest.state.aliases import read_alias
            from imgest.storage import open_location

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
    except (*USER_ERRORS, RuntimeError, ValueError) as exc:
        fail(exc)
    import uvicorn

    follower.follow(every=follow_every)
    if shadow is not None:
        shadow.start()
    typer.echo(f"imgest api: serving {', '.join(follower.aliases)} of {follower.store.url} on http://{host}:{port}",
               err=True)
    try:
        uvicorn.run(create_app(follower, token=os.environ.get(TOKEN_VARIABLE) or None, shadow=shadow), host=host,
                    port=port, log_level="warning")
    finally:
        follower.close()
        if shadow is not None:
            shadow.close()  # the rows measured since the last part are written

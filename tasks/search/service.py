"""The HTTP search service (`imgest api`): FastAPI over a FollowingSearcher, read-only.

  POST /search   JSON {"text" | "item_id" | "image_b64", "k", "alias": [..], "fuse": "rrf", "rrf_k", "where",
                 "group_by", "per_group", "query_class"}, or a multipart form with a file field `image` and the
                 same fields -> {"hits": [{"item_id", "score", "group", "metadata", "model", "version", "alias",
                 "query_encoded_by", "found_by"}], "took_ms", "how"}
  GET  /aliases  -> {alias: {"model", "version", "recall", "query_encoded_by", "loaded_at", "error"}}
  GET  /healthz  -> 200 when every alias is loaded, 503 before
  GET  /metrics  -> Prometheus text: requests and latency by route, alias and status; served versions; swaps
  GET  /         -> the search page (text box, image drop, metadata filters, alias chooser, thumbnail grid)
  GET  /columns  -> {"columns": [{"name", "type", "min", "max" | "values"}]}: what the page can filter on
  GET  /thumbnail?item_id=&alias=  -> a JPEG thumbnail, read by the service under the catalogue root, cached

Requests are bounded (body, image bytes, k, where length) and refused with 4xx and {"detail": one line}; a
request never names a URL the service fetches. With a token (IMGEST_API_TOKEN), every route but /healthz needs
`Authorization: Bearer <token>`.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from importlib import resources

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi import Query as Query_
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from imgest.images.decode import DecodeError
from imgest.redact import one_line, redact
from imgest.retrieval.filters import FilterError
from imgest.retrieval.following import Answer, FollowingSearcher
from imgest.retrieval.items import MAX_ITEM_ID_CHARS
from imgest.retrieval.query import Query, SearchError, UnknownItem
from imgest.tasks.search.shadow import ShadowTraffic
from imgest.tasks.search.thumbnails import Thumbnails
from imgest.timing import Stopwatch

MAX_IMAGE_BYTES = 20 << 20  # an upload larger than this is refused before it is decoded (413)
MAX_BODY_BYTES = (MAX_IMAGE_BYTES * 4) // 3 + (64 << 10)  # a base64 image plus the other fields
MAX_K = 1000
MAX_WHERE_CHARS = 2000
MAX_FIELD_BYTES = 16 << 10  # a form field other than the image


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, max_length=2000)
    item_id: str | None = Field(None, min_length=1, max_length=MAX_ITEM_ID_CHARS)
    image_b64: str | None = Field(None, max_length=(MAX_IMAGE_BYTES * 4) // 3 + 8)
    k: int = Field(10, ge=1, le=MAX_K)
    alias: list[str] | None = Field(None, min_length=1, max_length=8)
    fuse: str | None = Field(None, max_length=20)
    rrf_k: int = Field(60, ge=1, le=10_000)
    where: str | None = Field(None, max_length=MAX_WHERE_CHARS)
    group_by: str | None = Field(None, max_length=200)
    per_group: int = Field(1, ge=1, le=MAX_K)
    query_class: str | None = Field(None, max_length=200)


class _TooLarge(Exception):
    pass


class BodyLimit:
    """Refuse a request body over `limit` bytes with 413: by its Content-Length before it is read, or, sent in
    chunks, as soon as it passes the limit (nothing larger is held in memory or spooled to disk)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            return await _refuse(send, 413 if length.isdigit() else 400, f"body larger than {self.limit} bytes"
                                 if length.isdigit() else "bad Content-Length")
        received, started = 0, False

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise _TooLarge
            return message

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await _refuse(send, 413, f"body larger than {self.limit} bytes")


async def _refuse(send, status: int, detail: str) -> None:
    await JSONResponse({"detail": detail}, status_code=status)({"type": "http"}, None, send)


def _one_line(exc: ValidationError | RequestValidationError) -> str:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")


async def _read_request(request: Request) -> tuple[SearchRequest, bytes | None]:
    """The request's fields and its image bytes (a multipart `image` file, or `image_b64` decoded)."""
    image = None
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await request.form(max_files=1, max_fields=32, max_part_size=MAX_FIELD_BYTES)
        fields: dict = {}
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                if name != "image":
                    raise HTTPException(422, f"{name}: the only file field is `image`")
                image = await value.read(MAX_IMAGE_BYTES + 1)
            elif name == "alias":
                fields.setdefault("alias", []).append(value)
            else:
                fields[name] = value
        try:
            body = SearchRequest.model_validate(fields)
        except ValidationError as exc:
            raise HTTPException(422, _one_line(exc)) from None
    else:
        try:
            body = SearchRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise HTTPException(422, _one_line(exc)) from None
        if body.image_b64 is not None:
            try:
                image = base64.b64decode(body.image_b64, validate=True)
            except (binascii.Error, ValueError):
                raise HTTPException(400, "image_b64 is not base64") from None
    if image is not None and len(image) > MAX_IMAGE_BYTES:
        raise HTTPException(413, f"image larger than {MAX_IMAGE_BYTES} bytes")
    if sum(x is not None for x in (body.text, body.item_id, image)) != 1:
        raise HTTPException(400, "give exactly one of text, item_id or an image (image_b64, or a multipart image)")
    return body, image


def _alias_label(body: SearchRequest, served: tuple[str, ...]) -> str:
    """The metrics label of a request's aliases: only served names (a request cannot grow the label set)."""
    if body.alias:
        return ",".join(body.alias) if set(body.alias) <= set(served) else "not served"
    return "routed" if body.query_class else served[0]


def _hits(answer: Answer) -> list[dict]:
    hits = []
    for hit in answer.hits[0]:
        alias = answer.source(hit)
        model, version = answer.served[alias]
        found_by = [{"alias": a, "rank": rank} for a, rank in hit.found_by] if hit.found_by else None
        hits.append({"item_id": hit.item_id, "score": hit.score, "group": hit.group,
                     "metadata": (answer.metadata or {}).get(hit.item_id), "model": model, "version": version,
                     "alias": alias, "query_encoded_by": (answer.query_encoded_by or {}).get(alias),
                     "found_by": found_by})
    return hits


def create_app(follower: FollowingSearcher, token: str | None = None, shadow: ShadowTraffic | None = None) -> FastAPI:
    def authorised(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "a bearer token is required (Authorization: Bearer ...)")

    app = FastAPI(title="imgest search", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    registry = CollectorRegistry()  # the app's own: two services in one process do not mix their figures
    requests = Counter("imgest_api_requests", "Requests answered", ["route", "alias", "status"], registry=registry)
    latency = Histogram("imgest_api_request_seconds", "Time to answer", ["route", "alias"], registry=registry,
                        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
    served = Gauge("imgest_api_served_version", "Index version each alias serves", ["alias", "model"],
                   registry=registry)
    failed = Gauge("imgest_api_alias_load_failed", "1 while what an alias names failed to load", ["alias"],
                   registry=registry)
    swaps = Gauge("imgest_api_alias_swaps", "Alias moves swapped in since start", registry=registry)
    shadowed = Gauge("imgest_api_shadow_queries", "Queries run on the window's candidate, by outcome", ["outcome"],
                     registry=registry)
    routes = {"/", "/search", "/aliases", "/columns", "/thumbnail", "/healthz", "/metrics"}

    def measured(route_app):
        """Count and time every request, refusals included (plain ASGI: no response object in between)."""
        async def measure(scope, receive, send):
            if scope["type"] != "http":
                return await route_app(scope, receive, send)
            took, status = Stopwatch(), 500

            async def tracked(message):
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await route_app(scope, receive, tracked)
            finally:
                route = scope["path"] if scope["path"] in routes else "other"
                alias = scope.get("state", {}).get("alias", "")  # request.state, set by /search
                requests.labels(route, alias, str(status)).inc()
                latency.labels(route, alias).observe(took.elapsed)
        return measure

    app.add_middleware(measured)

    @app.exception_handler(SearchError)
    async def refused(request: Request, exc: SearchError) -> JSONResponse:
        return JSONResponse({"detail": redact(str(exc))}, status_code=404 if isinstance(exc, UnknownItem) else 400)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _one_line(exc)}, status_code=422)

    @app.post("/search", dependencies=[Depends(authorised)])
    async def search(request: Request) -> JSONResponse:
        took = Stopwatch()
        body, image = await _read_request(request)
        request.state.alias = _alias_label(body, follower.aliases)
        query = Query("request", text=body.text, image_bytes=image, item_id=body.item_id)
        options = {"where": body.where, "group_by": body.group_by, "per_group": body.per_group}
        searching = Stopwatch()
        try:
            answer = await run_in_threadpool(follower.search, [query], body.k, body.alias, fuse=body.fuse,
                                             query_class=body.query_class, rrf_k=body.rrf_k, with_metadata=True,
                                             **options)
        except (DecodeError, FilterError) as exc:  # an image that does not decode, a bad predicate: the request's
            raise HTTPException(400, redact(str(exc))) from None
        if shadow is not None:  # queued for the candidate, never waited for
            shadow.offer([query], body.k, options, answer, 1000 * searching.elapsed)
        return JSONResponse({"hits": _hits(answer), "took_ms": round(1000 * took.elapsed, 3),
                             "how": answer.how})

    @app.get("/aliases", dependencies=[Depends(authorised)])
    def aliases() -> dict:
        return follower.status()

    thumbnails = Thumbnails(follower.store)
    page = resources.files("imgest.tasks.search").joinpath("page.html").read_text(encoding="utf-8")

    @app.get("/", include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse(page)  # holds no data: every figure on it is fetched with the token

    @app.get("/columns", dependencies=[Depends(authorised)])
    def columns() -> dict:
        return {"columns": follower.columns()}

    @app.get("/thumbnail", dependencies=[Depends(authorised)])
    def thumbnail(item_id: str = Query_(..., max_length=MAX_ITEM_ID_CHARS),
                  alias: str | None = Query_(None, max_length=200)) -> Response:
        found = follower.locate(item_id, alias)
        if found is None:
            raise HTTPException(404, f"no served index holds item {item_id!r}")
        try:
            data = thumbnails.get(*found)
        except Exception as exc:  # noqa: BLE001 - one item's image: a 404 with the reason, the service goes on
            raise HTTPException(404, f"no thumbnail for {item_id!r}: {redact(one_line(exc))}") from None
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "private, max-age=3600"})

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        ready = follower.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/metrics", dependencies=[Depends(authorised)])
    def metrics() -> Response:
        served.clear()
        for alias, status in follower.status().items():
            if status["version"] is not None:
                served.labels(alias, status["model"]).set(status["version"])
            failed.labels(alias).set(1 if status["error"] else 0)
        swaps.set(follower.swaps)
        if shadow is not None:
            for outcome, count in (("recorded", shadow.recorded), ("failed", shadow.failed),
                                   ("dropped", shadow.dropped)):
                shadowed.labels(outcome).set(count)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app

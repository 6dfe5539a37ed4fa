"""The HTTP search service (`imgest api`): FastAPI over a FollowingSearcher, read-only.

  POST /search   {"text" | "image_b64", "k", "alias": [one alias], "where", "group_by", "per_group"}
                 -> {"hits": [{"item_id", "score", "group", "metadata", "model", "version", "alias"}], "took_ms"}
  GET  /aliases  -> {alias: {"model", "version", "recall", "loaded_at", "error"}}
  GET  /healthz  -> 200 when every alias is loaded, 503 before
  GET  /metrics  -> Prometheus text: requests and latency by route, alias and status; served versions; swaps

Requests are bounded (image bytes, k, where length) and refused with 4xx and {"detail": one line}; a request
never names a URL the service fetches. With a token (IMGEST_API_TOKEN), every route but /healthz needs
`Authorization: Bearer <token>`.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import time

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from imgest.redact import redact
from imgest.tasks.search.following import FollowingSearcher
from imgest.tasks.search.query import Query, SearchError

MAX_IMAGE_BYTES = 20 << 20  # an upload larger than this is refused before it is decoded (413)
MAX_K = 1000
MAX_WHERE_CHARS = 2000


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, max_length=2000)
    image_b64: str | None = Field(None, max_length=(MAX_IMAGE_BYTES * 4) // 3 + 8)
    k: int = Field(10, ge=1, le=MAX_K)
    alias: list[str] | None = Field(None, max_length=1)
    where: str | None = Field(None, max_length=MAX_WHERE_CHARS)
    group_by: str | None = Field(None, max_length=200)
    per_group: int = Field(1, ge=1, le=MAX_K)


def create_app(follower: FollowingSearcher, token: str | None = None) -> FastAPI:
    def authorised(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "a bearer token is required (Authorization: Bearer ...)")

    app = FastAPI(title="imgest search", docs_url=None, redoc_url=None, openapi_url=None)
    registry = CollectorRegistry()  # the app's own: two services in one process do not mix their figures
    requests = Counter("imgest_api_requests", "Requests answered", ["route", "alias", "status"], registry=registry)
    latency = Histogram("imgest_api_request_seconds", "Time to answer", ["route", "alias"], registry=registry,
                        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
    served = Gauge("imgest_api_served_version", "Index version each alias serves", ["alias", "model"],
                   registry=registry)
    failed = Gauge("imgest_api_alias_load_failed", "1 while what an alias names failed to load", ["alias"],
                   registry=registry)
    swaps = Gauge("imgest_api_alias_swaps", "Alias moves swapped in since start", registry=registry)
    routes = {"/search", "/aliases", "/healthz", "/metrics"}

    @app.middleware("http")
    async def measure(request: Request, call_next):
        started = time.perf_counter()
        response = await call_next(request)
        route = request.url.path if request.url.path in routes else "other"
        alias = getattr(request.state, "alias", "")
        requests.labels(route, alias, str(response.status_code)).inc()
        latency.labels(route, alias).observe(time.perf_counter() - started)
        return response

    @app.exception_handler(SearchError)
    async def refused(request: Request, exc: SearchError) -> JSONResponse:
        return JSONResponse({"detail": redact(str(exc))}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return JSONResponse({"detail": f"{where}: {first.get('msg', 'invalid request')}"}, status_code=422)

    @app.post("/search", dependencies=[Depends(authorised)])
    def search(body: SearchRequest, request: Request) -> dict:
        started = time.perf_counter()
        request.state.alias = body.alias[0] if body.alias else follower.aliases[0]
        if (body.text is None) == (body.image_b64 is None):
            raise HTTPException(400, "give exactly one of text or image_b64")
        image = None
        if body.image_b64 is not None:
            try:
                image = base64.b64decode(body.image_b64, validate=True)
            except (binascii.Error, ValueError):
                raise HTTPException(400, "image_b64 is not base64") from None
            if len(image) > MAX_IMAGE_BYTES:
                raise HTTPException(413, f"image larger than {MAX_IMAGE_BYTES} bytes")
        alias = body.alias[0] if body.alias else None
        try:
            answer = follower.search([Query("request", text=body.text, image_bytes=image)], body.k, alias,
                                     with_metadata=True, where=body.where, group_by=body.group_by,
                                     per_group=body.per_group)
        except SearchError:
            raise
        except ValueError as exc:  # an image that does not decode, a bad predicate: the request's fault
            raise HTTPException(400, redact(str(exc))) from None
        hits = [{"item_id": h.item_id, "score": h.score, "group": h.group, "metadata": answer.metadata.get(h.item_id),
                 "model": answer.model, "version": answer.version, "alias": answer.alias} for h in answer.hits[0]]
        return {"hits": hits, "took_ms": round(1000 * (time.perf_counter() - started), 3)}

    @app.get("/aliases", dependencies=[Depends(authorised)])
    def aliases() -> dict:
        return follower.status()

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
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app

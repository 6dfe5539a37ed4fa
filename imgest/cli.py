"""The `imgest` command line: ingest, status, export, demo."""

from __future__ import annotations

import os

# Prefect's ephemeral server must work offline and may take a while to start on a small machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import json  # noqa: E402
import sys  # noqa: E402
from typing import Optional  # noqa: E402

import typer  # noqa: E402

from imgest.storage import redact  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Batch ingestion of image catalogues into model-tagged Parquet embedding shards.")


def _fail(exc: BaseException) -> None:
    typer.echo(f"imgest: error: {redact(exc)}", err=True)
    raise typer.Exit(code=2)


def _user_errors() -> tuple[type[BaseException], ...]:
    from flows.config import ConfigError
    from imgest.encoders import EncoderError
    from imgest.lock import StoreLockedError
    from imgest.storage import StorageError
    from tasks.export import ModelNotFoundError
    from tasks.index_choice import IndexChoiceError
    from tasks.index_store import IndexIntegrityError, IndexNotFoundError
    from tasks.migration import MigrationError
    from tasks.querysets import QuerySetError
    from tasks.search import SearchError

    return (ConfigError, EncoderError, StoreLockedError, StorageError, ModelNotFoundError, FileNotFoundError,
            IndexChoiceError, IndexIntegrityError, IndexNotFoundError, SearchError, MigrationError, QuerySetError,
            LookupError)


@app.command()
def ingest(
    catalogue: str = typer.Option(..., help="Folder or URL of the catalogue: /path, file://, s3://bucket/prefix"),
    store: str = typer.Option(..., help="Folder or URL where shards and state are kept"),
    model: str = typer.Option("efficientnet-lite0", help="efficientnet-lite0 or hf:<hub id or local folder>"),
    batch_size: str = typer.Option("auto", help="'auto' (measured, cached per model and device) or N"),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N"),
    shard_size: int = typer.Option(2000, help="Images per shard (one Prefect task per shard)"),
    decode_workers: int = typer.Option(2, help="Threads reading and decoding ahead of the encoder"),
    max_pixels: int = typer.Option(100_000_000, help="Larger images are rejected as decompression bombs"),
    as_json: bool = typer.Option(False, "--json", help="Print the run summary as JSON"),
) -> None:
    """Encode what is new or changed in the catalogue; tombstone what was deleted."""
    try:
        from flows.config import IngestConfig
        from imgest import encoders
        from imgest.storage import open_location

        # Fail on bad input before Prefect starts its server: a one-line reason, exit 2.
        cfg = IngestConfig(catalogue, store, model, batch_size, device, shard_size, decode_workers, max_pixels)
        encoders.resolve(cfg.model)
        encoders.resolve_device(cfg.device)
        open_location(cfg.catalogue, must_exist=True, what="catalogue")
        open_location(cfg.store)

        from flows.ingest import ingest as ingest_flow
        from tasks.commit import RunSummary
        from tasks.report import render_summary

        summary = ingest_flow(**cfg.to_dict())
    except _user_errors() as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
    else:
        typer.echo(render_summary(RunSummary(**summary)))


@app.command()
def status(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (keys in the README)"),
) -> None:
    """Per model: live items, shards, rejected items with reasons, tombstones, last run."""
    from tasks.export import store_status

    try:
        report = store_status(store)
    except _user_errors() as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
        return
    typer.echo(f"store: {report['store']}")
    if report["running"]:
        typer.echo(f"running: {report['running']['owner']} since {report['running']['started']}")
    if not report["models"]:
        typer.echo("no models ingested yet")
    for m in report["models"]:
        last = m["last_run"] or {}
        typer.echo(f"\nmodel {m['name']} ({m['slug']}), dim {m['dim']}\n  model id: {m['model_id']}")
        typer.echo(f"  live {m['live']} in {m['shards']} shard(s), rejected {len(m['rejected'])}, "
                   f"tombstones {m['tombstones']}, snapshot {m['snapshot']}, pending shards {m['pending_shards']}")
        if last:
            typer.echo(f"  last run {last.get('run_id')} finished {last.get('finished')}: encoded "
                       f"{last.get('encoded')}, {last.get('images_per_second')} img/s")
        for rej in m["rejected"]:
            typer.echo(f"  rejected {rej['item_id']}: {rej['reason']}")


@app.command()
def export(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    model: str = typer.Option(..., help="Model name, model id or slug as shown by `imgest status`"),
    out: str = typer.Option(..., help="Output Parquet file (local path or URL)"),
) -> None:
    """Write the live embeddings of one model, one row per live item, as a Parquet file."""
    from tasks.export import export_live

    try:
        result = export_live(store, model, out)
    except _user_errors() as exc:
        _fail(exc)
    typer.echo(f"exported {result['rows']} live embeddings of {result['model_id']} to {result['out']}")


@app.command("build-index")
def build_index_cmd(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    model: str = typer.Option("efficientnet-lite0", help="Model name, model id or slug in the store"),
    kind: str = typer.Option("auto", help="auto, flat, hnsw, ivfsq8, ivfpq or a faiss factory string"),
    memory: str = typer.Option("4G", help="Memory budget for the index, e.g. 512M, 4G"),
    target_recall: float = typer.Option(0.95, help="recall@k against exact search the served parameters must meet"),
    k: int = typer.Option(10, help="k of the recall target"),
    queries: int = typer.Option(1000, help="Held-out corpus queries used to measure recall"),
    alias: str = typer.Option("auto", help="Alias to move once verified: 'auto' moves the aliases already on "
                              "this model (creating `serving` if the store has none); a name; '' for none"),
    as_json: bool = typer.Option(False, "--json", help="Print the index card as JSON"),
) -> None:
    """Build a new immutable index version from the live embeddings and move an alias to it."""
    try:
        from flows.config import IndexConfig
        from imgest.storage import open_location
        from tasks.export import find_model

        cfg = IndexConfig(store, model, kind, memory, target_recall, k, queries, alias or None)
        find_model(open_location(cfg.store, must_exist=True, what="store"), cfg.model)

        from flows.build_index import build_index
        from tasks.index_card import render_card

        result = build_index(**cfg.__dict__)
    except _user_errors() as exc:
        _fail(exc)
    if not result["built"]:
        typer.echo(f"no index built: {result['reason']}")
    elif as_json:
        typer.echo(json.dumps(result["card"], indent=2))
    else:
        typer.echo(render_card(result["card"]))


@app.command()
def nightly(
    catalogue: str = typer.Option(..., help="Folder or URL of the catalogue"),
    store: str = typer.Option(..., help="Folder or URL of the store"),
    model: str = typer.Option("efficientnet-lite0", help="efficientnet-lite0 or hf:<hub id or local folder>"),
    batch_size: str = typer.Option("auto", help="'auto' or N"),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N"),
    kind: str = typer.Option("auto", help="Index kind or faiss factory string"),
    memory: str = typer.Option("4G", help="Memory budget for the index"),
    target_recall: float = typer.Option(0.95, help="recall@10 target for the served parameters"),
) -> None:
    """Ingest, then build and verify a fresh index and move `serving` to it."""
    try:
        from flows.config import IndexConfig, IngestConfig
        from imgest import encoders
        from imgest.storage import open_location

        IngestConfig(catalogue, store, model, batch_size, device)
        IndexConfig(store, model, kind, memory, target_recall)
        encoders.resolve(model)
        open_location(catalogue, must_exist=True, what="catalogue")

        from flows.nightly import nightly as nightly_flow
        from tasks.commit import RunSummary
        from tasks.index_card import render_card
        from tasks.report import render_summary

        result = nightly_flow(catalogue=catalogue, store=store, model=model, batch_size=batch_size, device=device,
                              kind=kind, memory=memory, target_recall=target_recall)
    except _user_errors() as exc:
        _fail(exc)
    typer.echo(render_summary(RunSummary(**result["ingest"])))
    index = result["index"]
    typer.echo(render_card(index["card"]) if index["built"] else f"no index built: {index['reason']}")


@app.command("search")
def search_cmd(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    image: Optional[str] = typer.Option(None, help="Query image: a path or URL"),
    text: Optional[str] = typer.Option(None, help="Query text (models with a text tower)"),
    queries: Optional[str] = typer.Option(None, help="JSONL file: query_id and image or text per line"),
    k: int = typer.Option(10, help="Results per query"),
    alias: str = typer.Option("serving", help="Alias to search (ignored with --model)"),
    model: Optional[str] = typer.Option(None, help="Search this model's index instead of an alias"),
    version: Optional[int] = typer.Option(None, help="With --model: this version (default: latest)"),
    device: str = typer.Option("auto", help="Where to embed the queries"),
    fuse: Optional[str] = typer.Option(None, help="'rrf': reciprocal rank fusion of serving and shadow"),
    rrf_k: int = typer.Option(60, help="k of reciprocal rank fusion"),
    as_json: bool = typer.Option(False, "--json", help="JSON output"),
) -> None:
    """Search by image, by text, or a batch of queries, with the model that built the index."""
    from dataclasses import asdict

    try:
        from tasks.search import Query, Searcher, SearchError, read_queries

        given = [x for x in (image, text, queries) if x is not None]
        if len(given) != 1:
            raise SearchError("give exactly one of --image, --text or --queries")
        batch = read_queries(queries) if queries else [Query("query", image, text)]
        if fuse is not None:
            if fuse != "rrf":
                raise SearchError(f"unknown fusion {fuse!r}; allowed: rrf")
            from tasks.search import fused_search

            results = fused_search(store, batch, k, ("serving", "shadow"), rrf_k, device)
            card = {"model_id": "rrf(serving, shadow)", "version": None}
        else:
            searcher = Searcher(store, alias, model, version, device)
            results = searcher.search(batch, k)
            card = searcher.card
    except _user_errors() as exc:
        _fail(exc)
    if as_json:
        payload = [{"query_id": q.query_id, "hits": [asdict(h) for h in hits]} for q, hits in zip(batch, results)]
        typer.echo(json.dumps({"model_id": card["model_id"], "version": card["version"], "results": payload},
                              indent=2))
        return
    from tasks.index_card import served_parameters

    if fuse is None:
        typer.echo(f"index model={card['slug']} v{card['version']:04d} ({card['factory']}, "
                   f"{served_parameters(card)})")
    else:
        typer.echo(f"reciprocal rank fusion (k={rrf_k}) of serving and shadow")
    for query, hits in zip(batch, results):
        typer.echo(f"\n{query.query_id}: {query.image or query.text}")
        for hit in hits:
            typer.echo(f"  {hit.rank:>3}  {hit.score:.4f}  {hit.item_id}")


@app.command()
def demo(
    workdir: str = typer.Option("demo", help="Where to put the demo catalogue and store"),
    per_class: int = typer.Option(60, help="Fashion-MNIST images per class (10 classes)"),
) -> None:
    """Build a demo catalogue of real offline images, run the nightly job on it, search it once."""
    from imgest.demo import build_demo_catalogue

    catalogue = os.path.join(workdir, "catalogue")
    store_dir = os.path.join(workdir, "store")
    if not os.path.exists(catalogue):
        counts = build_demo_catalogue(catalogue, fashion_per_class=per_class)
        typer.echo(f"demo catalogue written to {catalogue}: {counts}")
    nightly(catalogue=catalogue, store=store_dir, model="efficientnet-lite0", batch_size="auto", device="auto",
            kind="auto", memory="4G", target_recall=0.95)
    status(store=store_dir, as_json=False)
    query = os.path.join(catalogue, "photos", "chelsea.jpg")
    typer.echo(f"\n$ imgest search --store {store_dir} --image {query} --k 5")
    search_cmd(store=store_dir, image=query, text=None, queries=None, k=5, alias="serving", model=None,
               version=None, device="auto", fuse=None, rrf_k=60, as_json=False)


@app.command()
def reencode(
    catalogue: str = typer.Option(..., help="Folder or URL of the catalogue"),
    store: str = typer.Option(..., help="Folder or URL of the store"),
    model: str = typer.Option(..., help="The new model: efficientnet-lite0 or hf:<hub id or local folder>"),
    batch_size: str = typer.Option("auto", help="'auto' or N"),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N"),
) -> None:
    """Encode the whole catalogue with a new model into its own namespace (resumable; old data untouched)."""
    try:
        from flows.config import IngestConfig
        from imgest import encoders
        from imgest.storage import open_location

        IngestConfig(catalogue, store, model, batch_size, device)
        encoders.resolve(model)
        open_location(catalogue, must_exist=True, what="catalogue")
        from flows.reencode import reencode as reencode_flow
        from tasks.report import render_reencode

        summary = reencode_flow(catalogue=catalogue, store=store, model=model, batch_size=batch_size, device=device)
    except _user_errors() as exc:
        _fail(exc)
    typer.echo(render_reencode(summary))


migrate_app = typer.Typer(help="Change the embedding model through a dual-index migration window.",
                          no_args_is_help=True)
app.add_typer(migrate_app, name="migrate")


def _migrate(store: str, action: str, as_json: bool = False, **params) -> None:
    try:
        from imgest.storage import open_location

        open_location(store, must_exist=True, what="store")
        if action == "status":  # read-only: no Prefect run needed
            from tasks.migration import window_status

            result = window_status(open_location(store))
        else:
            from flows.migrate import migrate

            result = migrate(store=store, action=action, **params)
    except _user_errors() as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
    elif "finished" in result:
        typer.echo(f"window {result['finished']['window']['id']} finished; deleted now: "
                   f"{result['finished']['deleted'] or 'nothing yet (retention, or an alias still points at it)'}")
    else:
        from tasks.report import render_window

        typer.echo(render_window(result))


@migrate_app.command("start")
def migrate_start(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    to: str = typer.Option(..., help="The new model"),
    catalogue: Optional[str] = typer.Option(None, help="Default: the serving model's last catalogue"),
    batch_size: str = typer.Option("auto", help="'auto' or N"),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N"),
    kind: str = typer.Option("auto", help="Index kind for the new model"),
    memory: str = typer.Option("4G", help="Memory budget for the new index"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Open (or resume) a window: re-encode with the new model, build its index, point `shadow` at it."""
    _migrate(store, "start", as_json, to=to, catalogue=catalogue, batch_size=batch_size, device=device, kind=kind,
             memory=memory)


@migrate_app.command("status")
def migrate_status(store: str = typer.Option(..., help="Folder or URL of the store"),
                   as_json: bool = typer.Option(False, "--json")) -> None:
    """Coverage, index currency, aliases, evaluation and storage of the open window."""
    _migrate(store, "status", as_json)


@migrate_app.command("promote")
def migrate_promote(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    gate: Optional[str] = typer.Option(None, help="Evaluation JSON; refuse when shadow is worse than serving"),
    margin: float = typer.Option(0.0, help="Allowed drop of the gated metric"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Swap `serving` to the new model (full coverage and a current, checksummed index required)."""
    gate_obj = None
    if gate:
        from imgest.storage import read_url

        try:
            gate_obj = json.loads(read_url(gate))
        except _user_errors() as exc:
            _fail(exc)
    _migrate(store, "promote", as_json, gate=gate_obj, margin=margin)


@migrate_app.command("rollback")
def migrate_rollback(store: str = typer.Option(..., help="Folder or URL of the store"),
                     as_json: bool = typer.Option(False, "--json")) -> None:
    """Swap `serving` back to the old model, any time before finish."""
    _migrate(store, "rollback", as_json)


@migrate_app.command("finish")
def migrate_finish(store: str = typer.Option(..., help="Folder or URL of the store"),
                   retain_days: float = typer.Option(7.0, help="Keep the retired model's data this long"),
                   as_json: bool = typer.Option(False, "--json")) -> None:
    """Close the window; the model no longer serving is deleted after the retention, never while aliased."""
    _migrate(store, "finish", as_json, retain_days=retain_days)


@app.command("eval")
def eval_cmd(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    queries: str = typer.Option(..., help="Query set (JSONL or Parquet): query_id, image|text, relevant, class"),
    alias: str = typer.Option("serving", help="Retriever A"),
    compare: Optional[str] = typer.Option(None, help="Retriever B (an alias), for win/loss, bootstrap, fusion"),
    k: str = typer.Option("1,5,10", help="Cut-offs, comma-separated"),
    resamples: int = typer.Option(1000, help="Paired bootstrap resamples (>= 1000 recommended)"),
    seed: int = typer.Option(0, help="Bootstrap seed"),
    out: Optional[str] = typer.Option(None, help="Folder for eval.json, eval.md and PNG plots"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """recall@K, precision@K, MRR, mAP at the served parameters and exact, per class; A vs B when compared."""
    try:
        ks = [int(x) for x in k.split(",") if x.strip()]
        if not ks or min(ks) < 1:
            raise ValueError
    except ValueError:
        _fail(ValueError(f"--k must be positive integers separated by commas, got {k!r}"))
    try:
        from tasks.querysets import read_query_set

        read_query_set(queries)  # a malformed set fails before Prefect starts
        from flows.evaluate import dumps, evaluate

        report = evaluate(store=store, queries=queries, alias=alias, compare=compare, ks=ks, resamples=resamples,
                          seed=seed, out=out)
    except _user_errors() as exc:
        _fail(exc)
    if as_json:
        typer.echo(dumps(report))
    else:
        from tasks.eval_report import render_eval

        typer.echo(render_eval(report))


queries_app = typer.Typer(help="Build labelled query sets for evaluation.", no_args_is_help=True)
app.add_typer(queries_app, name="queries")


@queries_app.command("class")
def queries_class(
    catalogue: str = typer.Option(..., help="Catalogue whose parent folders are the labels"),
    out: str = typer.Option(..., help="Output JSONL (a .meta.json sidecar records the seed)"),
    per_class: int = typer.Option(10, help="Queries drawn per class"),
    seed: int = typer.Option(0, help="Seed of the draw"),
) -> None:
    """A blind class-level set: held-out catalogue items as queries, their class as relevant, self excluded."""
    from tasks.querysets import build_class_queries

    try:
        meta = build_class_queries(catalogue, out, per_class, seed)
    except _user_errors() as exc:
        _fail(exc)
    typer.echo(f"{meta['queries']} class queries over {len(meta['classes'])} classes written to {out} (seed {seed})")


@queries_app.command("instance")
def queries_instance(
    catalogue: str = typer.Option(..., help="Catalogue"),
    out: str = typer.Option(..., help="Output folder: images/ and queries.jsonl"),
    prefix: str = typer.Option("", help="Only catalogue keys under this prefix become queries"),
    seed: int = typer.Option(0, help="Seed of the transforms"),
) -> None:
    """An instance-level set: crops, flips and colour changes of catalogue images, each finding its original."""
    from tasks.querysets import build_instance_queries

    try:
        meta = build_instance_queries(catalogue, out, prefix, seed)
    except _user_errors() as exc:
        _fail(exc)
    typer.echo(f"{meta['queries']} instance queries written to {meta['file']} (seed {seed})")


report_app = typer.Typer(help="Decision reports.", no_args_is_help=True)
app.add_typer(report_app, name="report")


@report_app.command("cost")
def report_cost(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    corpus_size: int = typer.Option(..., help="N items to cost"),
    gpu_hour_price: Optional[float] = typer.Option(None, help="Price of one GPU-hour"),
    node_memory: str = typer.Option("64G", help="Memory of a serving node"),
    device: str = typer.Option("auto", help="Where to measure encode throughput"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Encode throughput and hours, re-encode cost, query encode time, storage, index fit, dual-window storage."""
    from tasks.cost import cost_report, render_cost

    try:
        report = cost_report(store, corpus_size, gpu_hour_price, node_memory, device)
    except _user_errors() as exc:
        _fail(exc)
    typer.echo(json.dumps(report, indent=2) if as_json else render_cost(report))


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())

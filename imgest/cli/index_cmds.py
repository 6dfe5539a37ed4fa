"""Commands: build-index, search."""

from __future__ import annotations

import functools
import json
from typing import Optional

import typer

from imgest.cli.app import app, fail
from imgest.cli.options import config_command
from imgest.config import DuplicatesConfig, IndexConfig
from imgest.errors import USER_ERRORS
from imgest.names import DEFAULT_DEVICE
from imgest.retrieval.fusion import RRF_K


@app.command("build-index")
@config_command(IndexConfig)
def build_index_cmd(
    config: IndexConfig,
    as_json: bool = typer.Option(False, "--json", help="Print the index card as JSON"),
) -> None:
    """Build a new immutable index version from the live embeddings and move an alias to it."""
    try:
        from imgest.state.models import default_model, find_model
        from imgest.storage import open_location

        store = open_location(config.store, must_exist=True, what="store")
        config = config.model_copy(update={"model": default_model(store, config.model)})  # before Prefect starts
        find_model(store, config.model)

        from imgest.flows.build_index import build_index
        from imgest.progress import reporting
        from imgest.reports.index import render_card

        with reporting():
            result = build_index(config)
    except USER_ERRORS as exc:
        fail(exc)
    if not result["built"]:
        typer.echo(f"no index built: {result['reason']}")
    elif result["reused"] and not as_json:
        typer.echo(f"nothing changed since v{result['card']['version']:04d}: reused it (--rebuild builds anew)\n")
    elif as_json:
        typer.echo(json.dumps(result["card"], indent=2))
    else:
        typer.echo(render_card(result["card"]))


def _modalities(store: str, device: str, opened: dict, alias: str) -> tuple[str, ...] | None:
    """The modalities of the model `alias` serves (None: no such alias); the searcher stays open for the query."""
    from imgest.retrieval.query import Searcher
    from imgest.state.aliases import read_alias
    from imgest.storage import open_location

    if alias not in opened:
        if read_alias(open_location(store, must_exist=True, what="store"), alias) is None:
            return None
        opened[alias] = Searcher(store, alias, None, None, device)
    return tuple(opened[alias].spec.modalities)


@app.command("search")
def search_cmd(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    image: Optional[str] = typer.Option(None, help="Query image: a path or URL"),
    text: Optional[str] = typer.Option(None, help="Query text (models with a text tower)"),
    item_id: Optional[str] = typer.Option(None, help="More like this item: its stored embedding in each model "
                                                     "searched (the item itself is left out of its hits)"),
    queries: Optional[str] = typer.Option(None, help="JSONL file: query_id and image, text or item_id per line"),
    k: int = typer.Option(10, help="Results per query"),
    alias: list[str] = typer.Option(["serving"], help="Alias to search (ignored with --model); repeat it with "
                                                     "--fuse rrf to fuse several, e.g. --alias captions --alias "
                                                     "serving"),
    model: Optional[str] = typer.Option(None, help="Search this model's index instead of an alias"),
    version: Optional[int] = typer.Option(None, help="With --model: this version (default: latest)"),
    device: str = typer.Option(DEFAULT_DEVICE, help="Where to embed the queries"),
    fuse: Optional[str] = typer.Option(None, help="'rrf': reciprocal rank fusion of the --alias given (two or "
                                                  "more; default serving and shadow)"),
    rrf_k: int = typer.Option(RRF_K, help="k of reciprocal rank fusion"),
    where: Optional[str] = typer.Option(None, help="Only items whose metadata satisfies this SQL predicate, e.g. "
                                                   "\"category = 'shoes' AND price < 50\" (DuckDB, no file access)"),
    group_by: Optional[str] = typer.Option(None, help="At most --per-group hits per value of this metadata column, "
                                                      "e.g. product_id: one product's photos do not fill the page"),
    per_group: int = typer.Option(1, help="Hits kept per group with --group-by"),
    route: Optional[str] = typer.Option(None, help="A routing table from imgest eval --compare --out (routing.json): "
                                                   "search with the retriever that wins for --query-class"),
    query_class: Optional[str] = typer.Option(None, help="With --route: the query's class (its table entry; the "
                                                         "table's default when absent)"),
    as_json: bool = typer.Option(False, "--json", help="JSON output"),
) -> None:
    """Search by image, by text, by item id (more like this), or a batch of queries, with the model that built
    the index."""
    from dataclasses import asdict

    try:
        from imgest.retrieval.combined import fusion, text_to_captions
        from imgest.retrieval.query import Query, Searcher, SearchError, read_queries

        given = [x for x in (image, text, item_id, queries) if x is not None]
        if len(given) != 1:
            raise SearchError("give exactly one of --image, --text, --item-id or --queries")
        batch = read_queries(queries) if queries else [Query("query", image, text, item_id=item_id)]
        aliases, how = tuple(dict.fromkeys(alias)), None
        if route is not None:
            from imgest.retrieval.combined import routed_search

            results, how = routed_search(store, batch, k, route, query_class, device, where, group_by, per_group)
            card = {"model_id": f"route {how['route']} ({', '.join(how['aliases'])}; {how['from']})",
                    "version": None, "query_encoded_by": how.pop("query_encoded_by")}
        elif (chosen := fusion(aliases, fuse, rrf_k)).combine is not None:
            from imgest.retrieval.combined import fused_search

            aliases = chosen.aliases
            results, encoded_by = fused_search(store, batch, k, aliases, rrf_k, device, where, group_by, per_group)
            card = {"model_id": f"rrf({', '.join(aliases)})", "version": None, "query_encoded_by": encoded_by}
        else:
            opened: dict[str, Searcher] = {}
            if model is None:  # a text query to an image-only alias goes to the caption retriever, if any
                chosen = text_to_captions(chosen, batch, functools.partial(_modalities, store, device, opened))
                how = chosen.how
            alias_name = chosen.aliases[0] if model is None else aliases[0]
            searcher = opened.get(alias_name) or Searcher(store, alias_name, model, version, device)
            results = searcher.search(batch, k, where, group_by, per_group)
            card = {**searcher.card, "query_encoded_by": searcher.query_encoded_by}
    except USER_ERRORS as exc:
        fail(exc)
    if as_json:
        payload = [{"query_id": q.query_id, "hits": [asdict(h) for h in hits]} for q, hits in zip(batch, results)]
        encoded = {"query_encoded_by": card["query_encoded_by"]} if card.get("query_encoded_by") else {}
        typer.echo(json.dumps({"model_id": card["model_id"], "version": card["version"], "results": payload,
                               **encoded, **({"how": how} if how else {})}, indent=2))
        return
    from imgest.retrieval.versions import served_parameters

    if route is not None:
        typer.echo(card["model_id"])
    elif fuse is None:
        if how:
            typer.echo(f"{how['asked']} has no text tower: the caption retriever ({how['route']}) answers")
        typer.echo(f"index model={card['slug']} v{card['version']:04d} ({card['factory']}, "
                   f"{served_parameters(card)})")
    else:
        typer.echo(f"reciprocal rank fusion (k={rrf_k}) of {', '.join(aliases)}")
    for query, hits in zip(batch, results):
        typer.echo(f"\n{query.query_id}: {query.image or query.text or f'item {query.item_id}'}")
        for hit in hits:
            typer.echo(f"  {hit.rank:>3}  {hit.score:.4f}  {hit.item_id}" + (f"  [{hit.group}]" if hit.group else ""))


@app.command("duplicates")
@config_command(DuplicatesConfig)
def duplicates_cmd(
    config: DuplicatesConfig,
    as_json: bool = typer.Option(False, "--json", help="Print the summary and the first groups as JSON"),
) -> None:
    """Exact duplicates (same bytes, different keys) and near-duplicate groups; a Parquet report in the store."""
    try:
        from imgest.flows.duplicates import duplicates
        from imgest.progress import reporting
        from imgest.tasks.duplicates.report import describe_group, describe_report

        with reporting():
            report = duplicates(config)
    except USER_ERRORS as exc:
        fail(exc)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(describe_report(report))
    for n, group in enumerate(report["groups"]):
        typer.echo(describe_group(n, group))
    more = report["exact_groups"] + report["near_groups"] - len(report["groups"])
    if more > 0:
        typer.echo(f"  ... {more:,} more groups in {report['url']}")

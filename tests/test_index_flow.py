"""Index builds end to end: card, versions, aliases seen atomically, corruption refused, search."""

import hashlib
import json
import os
import shutil
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from imgest.cli import app
from imgest.config import IndexConfig, NightlyConfig
from imgest.flows.build_index import build_index
from imgest.flows.nightly import nightly
from imgest.images.demo import PHOTOS, photo
from imgest.reports.index import render_card
from imgest.retrieval.query import Query, Searcher, SearchError, search
from imgest.retrieval.versions import IndexIntegrityError, open_index
from imgest.state.aliases import read_alias, set_alias
from imgest.storage import Location
from imgest.tasks.index.rerank import on_disk
from tests.helpers import gradient, ingest_into, jpeg_bytes, png_bytes, write_files
from tests.s3servers import DEFAULT as S3_DEFAULT
from tests.s3servers import on as on_s3
from tests.s3servers import use as use_s3

pytestmark = pytest.mark.usefixtures("prefect_harness")


def photo_catalogue(root):
    files = {}
    for name in PHOTOS:
        image = photo(name).convert("RGB")
        files[f"photos/{name}.jpg"] = jpeg_bytes(image, quality=90)
    files.update({f"synthetic/{i:03d}.png": png_bytes(gradient(i)) for i in range(12)})
    write_files(str(root), files)
    return files


@pytest.fixture(scope="module")
def lite0_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("indexed")
    cat, store = root / "catalogue", root / "store"
    files = photo_catalogue(cat)
    result = nightly(NightlyConfig(catalogue=str(cat), store=str(store), batch_size="4"))
    return {"root": root, "catalogue": cat, "store": store, "files": files, "result": result}


def test_nightly_builds_a_verified_version_and_moves_serving(lite0_store):
    result, store = lite0_store["result"], lite0_store["store"]
    card = result["index"]["card"]
    n = len(lite0_store["files"])
    assert result["ingest"]["encoded"] == n and card["n"] == n and card["d"] == 1280
    assert card["version"] == 1 and card["factory"] == "Flat" and card["recall"]["met"]
    for key in ("model_id", "factory", "search", "n", "d", "bytes_on_disk", "bytes_per_vector_by_encoding", "times",
                "recall", "latency_ms_per_query", "snapshot", "sha256", "created", "imgest_version", "faiss_blas"):
        assert key in card, key
    assert card["bytes_per_vector_by_encoding"]["fp32"] == 4 * 1280
    index_file = store / card["index_file"]
    assert hashlib.sha256(index_file.read_bytes()).hexdigest() == card["sha256"]
    ids = pq.read_table(store / card["ids_file"])
    assert ids.column("faiss_id").to_pylist() == list(range(n))
    alias = read_alias(Location(str(store)), "serving")
    assert (alias["slug"], alias["version"], alias["sha256"]) == (card["slug"], 1, card["sha256"])
    # the card as the UI shows it: a Flat index's one sweep row is the exact search, not a missing parameter
    shown = render_card(card)
    assert "None" not in shown and f"| exact | {card['recall']['sweep'][0]['recall']} |" in shown, shown


def test_catalogue_photo_finds_itself_first(lite0_store):
    query = lite0_store["catalogue"] / "photos" / "chelsea.jpg"
    hits = search(str(lite0_store["store"]), image=str(query), k=3)
    assert hits[0].item_id == "photos/chelsea.jpg" and hits[0].score == pytest.approx(1.0, abs=1e-4)
    assert [h.rank for h in hits] == [1, 2, 3]
    # a crop of the photo (not in the catalogue) still finds it first
    crop = lite0_store["root"] / "crop.jpg"
    image = photo("astronaut")
    image.crop((40, 40, 470, 470)).save(crop)
    assert search(str(lite0_store["store"]), image=str(crop), k=1)[0].item_id == "photos/astronaut.jpg"


def test_text_on_image_only_model_is_refused(lite0_store):
    with pytest.raises(SearchError, match="no text tower"):
        search(str(lite0_store["store"]), text="a cat")


def test_batch_queries_file_through_cli(lite0_store):
    queries = lite0_store["root"] / "queries.jsonl"
    cat = lite0_store["catalogue"]
    queries.write_text("\n".join(json.dumps({"query_id": n, "image": str(cat / "photos" / f"{n}.jpg")})
                                 for n in ("coffee", "rocket")) + "\n")
    result = CliRunner().invoke(app, ["search", "--store", str(lite0_store["store"]), "--queries", str(queries),
                                      "--k", "2", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert [r["hits"][0]["item_id"] for r in payload["results"]] == ["photos/coffee.jpg", "photos/rocket.jpg"]


def test_alias_switch_is_seen_atomically_by_a_concurrent_reader(lite0_store, tmp_path):
    store = Location(str(tmp_path))
    cards = [{"slug": "m", "model_id": "m@1", "version": v, "sha256": f"{v:064d}"} for v in (1, 2)]
    set_alias(store, "serving", cards[0], "first")
    seen, errors, stop = set(), [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                seen.add(read_alias(store, "serving")["version"])
            except Exception as exc:  # a torn read would show up here
                errors.append(exc)

    thread = threading.Thread(target=reader, daemon=True)  # a failed assertion must not hang the session
    thread.start()
    for i in range(200):
        set_alias(store, "serving", cards[i % 2], f"switch {i}")
    stop.set()
    thread.join()
    assert not errors and seen == {1, 2}
    history = read_alias(store, "serving")["history"]
    assert len(history) == 50 and history[-1]["reason"] == "switch 198"


def test_corrupted_index_is_refused(lite0_store, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(lite0_store["store"], store)
    card = json.loads((store / "indexes").glob("*/v0001/card.json").__next__().read_text())
    path = store / card["index_file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(IndexIntegrityError, match="refusing to serve a corrupted index"):
        open_index(Location(str(store)), card["slug"], 1)
    result = CliRunner().invoke(app, ["search", "--store", str(store), "--image",
                                      str(lite0_store["catalogue"] / "photos" / "coffee.jpg")])
    assert result.exit_code == 2 and "corrupted" in result.output


def test_deleted_items_disappear_after_rebuild(lite0_store, tmp_path):
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    shutil.copytree(lite0_store["catalogue"], cat)
    shutil.copytree(lite0_store["store"], store)
    (cat / "photos" / "chelsea.jpg").unlink()
    result = nightly(NightlyConfig(catalogue=str(cat), store=str(store), batch_size="4"))
    assert result["ingest"]["deleted"] == 1 and result["index"]["card"]["version"] == 2
    hits = search(str(store), image=str(lite0_store["catalogue"] / "photos" / "chelsea.jpg"), k=50)
    assert "photos/chelsea.jpg" not in {h.item_id for h in hits}
    old = Searcher(str(store), model=result["index"]["card"]["slug"], version=1)  # versions are immutable
    assert "photos/chelsea.jpg" in old.opened.item_ids.to_pylist()


def test_text_search_through_tiny_clip_and_model_mismatch(tmp_path, tiny_models, monkeypatch):
    clip = tmp_path / "clip"
    shutil.copytree(tiny_models["clip"], clip)
    monkeypatch.setenv("IMGEST_MODEL_DIRS", str(tmp_path))  # the copy is the model the operator lists
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), {f"{i:03d}.png": png_bytes(gradient(i)) for i in range(30)})
    ingest_into(cat, store, model=f"hf:{clip}", batch_size="8")
    built = build_index(IndexConfig(store=str(store), model=f"hf:{clip}", kind="hnsw"))
    assert built["card"]["factory"] == "HNSW32,Flat" and built["card"]["search"]["param"] == "efSearch"
    searcher = Searcher(str(store))
    hits = searcher.search([Query("t", text="a red shoe")], k=5)[0]
    assert len(hits) == 5 and len({h.item_id for h in hits}) == 5
    direct = searcher.encoder().encode_texts(["a red shoe"])
    assert np.isclose(hits[0].score, float(searcher.search_vectors(direct, 1)[0][0].score), atol=1e-5)

    # Change the weights behind the same name: queries would come from another model, so refuse.
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(clip)
    with torch.no_grad():
        model.text_projection.weight.mul_(-1)
    model.save_pretrained(clip)
    from imgest import encoders

    encoders.resolve.cache_clear()
    with pytest.raises(SearchError, match="was built by .* queries would be embedded by a different model"):
        Searcher(str(store))


def test_ivf_index_opens_memory_mapped_and_serves(lite0_store, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(lite0_store["store"], store)
    built = build_index(IndexConfig(store=str(store), kind="ivfsq8", alias=None, target_recall=0.9))
    card = built["card"]
    assert card["kind"] == "ivfsq8" and card["search"]["param"] == "nprobe" and built["aliases"] == []
    assert read_alias(Location(str(store)), "serving")["version"] == 1  # alias=None moves nothing
    searcher = Searcher(str(store), model=card["slug"], version=card["version"])
    hits = searcher.search([Query("q", image=str(lite0_store["catalogue"] / "photos" / "rocket.jpg"))], k=1)[0]
    assert hits[0].item_id == "photos/rocket.jpg"


@pytest.mark.parametrize("where", ["local", *on_s3(S3_DEFAULT)])
def test_unchanged_catalogue_reuses_the_index_through_its_build_record(tmp_path, where, request):
    cat = tmp_path / "catalogue"
    write_files(str(cat), {f"p/{i:02d}.png": png_bytes(gradient(i, (16, 16))) for i in range(30)})
    if where != "local":
        import s3fs

        s3fs.S3FileSystem(client_kwargs={"endpoint_url": use_s3(request, where)}).mkdir("cache-store")
        store = "s3://cache-store/imgest"
    else:
        store = str(tmp_path / "store")
    run = {"catalogue": str(cat), "store": store, "model": "raw-pixels", "batch_size": "8", "kind": "hnsw"}

    first = nightly(NightlyConfig(**run))["index"]
    again = nightly(NightlyConfig(**run))["index"]
    assert not first["reused"] and again["reused"], "nothing changed: the version is reused, not rebuilt"
    assert again["card"]["version"] == first["card"]["version"] == 1
    loc = Location(store)
    builds = f"indexes/model={first['card']['slug']}/builds"
    assert loc.list_names(builds), "build records are kept in the store, beside the versions"
    alias = read_alias(loc, "serving")
    assert alias["version"] == 1 and alias["history"] == [], "a reused build does not rewrite the alias"

    forced = build_index(IndexConfig(store=store, model="raw-pixels", kind="hnsw", rebuild=True))
    assert not forced["reused"] and forced["card"]["version"] == 2

    write_files(str(cat), {"p/new.png": png_bytes(gradient(99, (16, 16)))})
    changed = nightly(NightlyConfig(**run))["index"]
    assert not changed["reused"] and changed["card"]["version"] == 3 and changed["card"]["n"] == 31

    # The cached version disappears (deleted by hand): the next build notices and builds again.
    loc.delete_tree("indexes/model=" + changed["card"]["slug"] + "/v0003")
    rebuilt = build_index(IndexConfig(store=store, model="raw-pixels", kind="hnsw", alias=None))
    # v0003 again on a disk and on S3; SeaweedFS lists the emptied v0003 folder for minutes after (its folders are
    # real, removed by a sweep at least 2 minutes later), and a new version never takes a listed number
    expected = 4 if where == "seaweedfs" else 3
    assert not rebuilt["reused"] and rebuilt["card"]["version"] == expected and rebuilt["card"]["n"] == 31


def test_live_vectors_spill_to_an_unlinked_scratch_map_and_build_the_same_index(lite0_store, tmp_path, monkeypatch):
    """Past SPILL_BYTES the live vectors are memory-mapped from an already-deleted scratch file (the heap
    holds one shard at a time); the vectors, their order and the index built from them are unchanged."""
    import tempfile

    import imgest.state.live
    from imgest.state.live import load_live_vectors

    store = tmp_path / "store"
    shutil.copytree(lite0_store["store"], store)
    slug, d = lite0_store["result"]["index"]["card"]["slug"], 1280
    in_memory = load_live_vectors(Location(str(store)), slug, d)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(imgest.state.live, "SPILL_BYTES", 0)
    spilled = load_live_vectors(Location(str(store)), slug, d)
    assert isinstance(spilled.vectors, np.memmap) and not isinstance(in_memory.vectors, np.memmap)
    assert list(scratch.iterdir()) == [], "the scratch file is unlinked as soon as it is mapped"
    assert spilled.item_ids == in_memory.item_ids and spilled.uris == in_memory.uris
    np.testing.assert_array_equal(np.asarray(spilled.vectors), in_memory.vectors)

    model = lite0_store["result"]["ingest"]["model_id"].split("@")[0]
    rebuilt = build_index(IndexConfig(store=str(store), model=model, rebuild=True))["card"]
    assert rebuilt["version"] == 2 and rebuilt["n"] == len(in_memory)
    query = str(lite0_store["catalogue"] / "photos" / "chelsea.jpg")
    old, new = (Searcher(str(store), model=slug, version=v).search([Query("q", image=query)], k=10)[0]
                for v in (1, 2))
    assert [(h.item_id, round(h.score, 5)) for h in old] == [(h.item_id, round(h.score, 5)) for h in new]


def test_a_planted_build_record_is_never_unpickled(tmp_path):
    """Anyone who can write to the store can write a build record: a pickle there (or where Prefect kept its
    cache records) is a cache miss, never code that runs on the build host."""
    import pickle

    pwned = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {pwned}",))

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), {f"p/{i:02d}.png": png_bytes(gradient(i, (16, 16))) for i in range(12)})
    first = nightly(NightlyConfig(catalogue=str(cat), store=str(store), model="raw-pixels", batch_size="8"))["index"]
    loc = Location(str(store))
    builds = f"indexes/model={first['card']['slug']}/builds"
    for name in loc.list_names(builds):
        loc.write_bytes(f"{builds}/{name}", pickle.dumps(Payload()))
    loc.write_bytes("cache/prefect/planted", pickle.dumps(Payload()))
    again = build_index(IndexConfig(store=str(store), model="raw-pixels"))
    assert not again["reused"] and again["card"]["version"] == 2, "an unreadable record is a miss: built again"
    assert not pwned.exists()


def test_a_pq_index_re_ranks_from_a_memory_mapped_file_and_serves(tmp_path):
    """kind ivfpq: PQ codes, float16 re-rank vectors on disk. The card gives both parameters and both sizes; a
    searcher opens it with the codes copied to RAM and the vectors memory-mapped, and a catalogue image finds
    itself first."""
    import faiss
    from PIL import Image

    rng = np.random.default_rng(0)
    cat = tmp_path / "catalogue"
    noisy = [np.asarray(gradient(i % 40, (16, 16)), int) + rng.integers(-40, 40, (16, 16, 3)) for i in range(300)]
    write_files(str(cat), {f"p/{i:03d}.png": png_bytes(Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)))
                           for i, a in enumerate(noisy)})
    store = str(tmp_path / "store")
    ingest_into(cat, store, model="raw-pixels", batch_size="64")
    built = build_index(IndexConfig(store=store, model="raw-pixels", kind="ivfpq", alias=None, target_recall=0.9))
    card = built["card"]
    assert card["factory"].endswith(",Refine(SQfp16)") and card["recall"]["met"]
    assert card["search"]["param"] == "nprobe" and card["search"]["k_factor"] >= 1
    foot = card["footprint"]
    assert foot["refine"] == "disk" and foot["disk_bytes"] == 300 * 2 * card["d"] and 0 < foot["ram_bytes"]
    opened = open_index(Location(store), card["slug"], card["version"])
    inner = faiss.downcast_index(opened.index)
    assert inner.k_factor == card["search"]["k_factor"]
    lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(inner.base_index).invlists)
    assert on_disk(inner) and isinstance(lists, faiss.ArrayInvertedLists), "re-rank vectors mapped, PQ codes in RAM"
    assert faiss.extract_index_ivf(opened.index).nprobe == card["search"]["value"]
    searcher = Searcher(store, model=card["slug"], version=card["version"])
    hits = searcher.search([Query("q", image=str(cat / "p" / "007.png"))], k=1)[0]
    assert hits[0].item_id == "p/007.png"


def test_a_pq_index_is_carried_forward_the_next_night_with_its_re_rank_vectors(tmp_path):
    """A night's change to a PQ + re-rank index is applied in place (codes and float16 vectors renumbered to
    the new item order); the new version serves the new and the kept images, its disk size counts the new N."""
    from PIL import Image

    rng = np.random.default_rng(1)
    cat, store = tmp_path / "catalogue", str(tmp_path / "store")

    def photos(names):
        return {f"p/{i:03d}.png": png_bytes(Image.fromarray(np.clip(
            np.asarray(gradient(i % 40, (16, 16)), int) + rng.integers(-40, 40, (16, 16, 3)), 0, 255).astype(np.uint8)))
            for i in names}

    write_files(str(cat), photos(range(300)))
    ingest_into(cat, store, model="raw-pixels", batch_size="64")
    first = build_index(IndexConfig(store=store, model="raw-pixels", kind="ivfpq", alias=None,
                                    target_recall=0.9))["card"]
    for i in range(0, 300, 50):
        (cat / "p" / f"{i:03d}.png").unlink()
    write_files(str(cat), photos(range(300, 312)))
    ingest_into(cat, store, model="raw-pixels", batch_size="64")
    card = build_index(IndexConfig(store=store, model="raw-pixels", kind="ivfpq", alias=None,
                                   target_recall=0.9))["card"]

    line = card["lineage"]
    assert card["factory"] == first["factory"] and line["method"] == "update", line["why"]
    assert (line["added"], line["removed"], card["n"]) == (12, 6, 306) and card["recall"]["met"]
    assert card["footprint"]["disk_bytes"] == 306 * 2 * card["d"]
    searcher = Searcher(store, model=card["slug"], version=card["version"])
    for name in ("p/305.png", "p/007.png", "p/299.png"):
        assert searcher.search([Query("q", image=str(cat / name))], k=1)[0][0].item_id == name
    hits = searcher.search([Query("q", image=str(cat / "p" / "301.png"))], k=50)[0]
    assert len(hits) == 50 and not {h.item_id for h in hits} & {f"p/{i:03d}.png" for i in range(0, 300, 50)}

"""The store as hostile input: planted and mutated records (aliases, cards, model records, retirement and window
records, shard rows) end in a clear error or are ignored with a warning; never a read, write or delete outside
the store, never a network request (a loopback HTTP server records every one), never a traceback."""

import http.server
import json
import os
import shutil
import threading
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from imgest.cli import app
from imgest.config import NightlyConfig
from imgest.errors import USER_ERRORS
from imgest.flows.nightly import nightly
from imgest.retrieval.query import Searcher
from imgest.retrieval.status import store_status
from imgest.retrieval.versions import IndexIntegrityError, open_index, resolve_target
from imgest.state.aliases import list_aliases, read_alias
from imgest.state.catalogue_images import CatalogueImages
from imgest.state.committed import load_state
from imgest.state.live import load_live_vectors
from imgest.state.models import list_models
from imgest.state.retention import collect_retired
from imgest.storage import ContainmentError, Location
from imgest.tasks.migration.window import nightly_models
from tests.helpers import gradient, jpeg_bytes, write_files

pytestmark = pytest.mark.usefixtures("prefect_harness")
FUTURE = datetime.now(UTC) + timedelta(days=3650)


class Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self):  # noqa: N802 - the handler's protocol
        Recorder.seen.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    do_HEAD = do_POST = do_PUT = do_DELETE = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def listener():
    """A loopback HTTP server that records every request a record might make imgest send."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A real store: a nightly (ingest, index, `serving`) of 12 catalogue photos with the raw-pixels model."""
    root = tmp_path_factory.mktemp("hostile")
    write_files(str(root / "catalogue"), {f"p/{i:03d}.jpg": jpeg_bytes(gradient(i, (160, 120))) for i in range(12)})
    nightly(NightlyConfig(catalogue=str(root / "catalogue"), store=str(root / "store"), model="raw-pixels",
                          batch_size="4"))
    return root


@pytest.fixture
def store(built, tmp_path):
    """A copy of the built store, with a victim folder beside it that nothing may touch."""
    shutil.copytree(built / "store", tmp_path / "store")
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "keep.txt").write_text("precious")
    return Location(str(tmp_path / "store"))


def serving(store: Location) -> tuple[str, int, str]:
    alias = read_alias(store, "serving")
    return alias["slug"], alias["version"], f"indexes/model={alias['slug']}/v{alias['version']:04d}/card.json"


def edit(store: Location, key: str, change) -> None:
    record = store.read_json(key)
    change(record)
    store.write_json(key, record)


def untouched(store: Location) -> bool:
    victim = os.path.join(os.path.dirname(store.root), "victim", "keep.txt")
    return os.path.exists(victim) and open(victim).read() == "precious"


# -- each attack as it was found --------------------------------------------------------------------------
@pytest.mark.parametrize("slug", ["../../victim", "../victim", "/tmp", "a/../../victim", "..", "x" * 300])
def test_retirement_record_cannot_delete_outside_the_store(store, slug):
    store.write_json("migration/retire/evil.json", {"slug": slug, "retire_after": "2000-01-01T00:00:00+00:00"})
    # a record whose slug is sound but is not the model its key names: refused too
    store.write_json("migration/retire/other-1a2b3c4d.json",
                     {"slug": serving(store)[0], "retire_after": "2000-01-01T00:00:00+00:00"})
    assert collect_retired(store, now=FUTURE) == []
    assert untouched(store)
    assert list_aliases(store) and open_index(store, *serving(store)[:2]).index.ntotal == 12


@pytest.mark.parametrize("path", ["../../victim/keep.txt", "/etc/hostname", "s3://other-bucket/x.faiss",
                                  "indexes/model=x/v0001/../../../../victim/keep.txt", "http://127.0.0.1:1/x"])
def test_card_cannot_point_search_at_another_file(store, path):
    slug, version, card_key = serving(store)
    edit(store, card_key, lambda card: card.update(index_file=path))
    with pytest.raises(IndexIntegrityError, match="is not the version's own index.faiss"):
        Searcher(store.url)


def test_card_checksum_is_never_a_file_name(store):
    slug, version, card_key = serving(store)
    for checksum in ("../../victim", "/abs/path", "0" * 63 + "/"):
        edit(store, card_key, lambda card, c=checksum: card.update(sha256=c))
        with pytest.raises(ValueError, match="is not a sha256 checksum"):
            open_index(store, slug, version)


def test_a_link_out_of_a_local_store_is_not_followed(store):
    slug, version, card_key = serving(store)
    index_file = store.path(f"indexes/model={slug}/v{version:04d}/index.faiss")
    os.remove(index_file)
    os.symlink(os.path.join(os.path.dirname(store.root), "victim", "keep.txt"), index_file)
    with pytest.raises(ContainmentError, match="outside the store"):
        open_index(store, slug, version)


def test_records_never_make_a_network_request(store, listener):
    Recorder.seen.clear()
    slug, version, card_key = serving(store)
    model_key = f"state/model={slug}/model.json"
    original = store.read_json(model_key)

    # an index card naming a head at a URL
    edit(store, card_key, lambda card: card.update(model_name=f"head:{listener}/card-head"))
    with pytest.raises(USER_ERRORS, match="inside the store"):
        Searcher(store.url)
    # a model record naming one: the nightly refuses it, a listing leaves it out
    store.write_json(model_key, {**original, "name": f"head:{listener}/model-head"})
    with pytest.raises(USER_ERRORS, match="inside the store"):
        nightly_models(store)
    assert [m["slug"] for m in list_models(store)] == []
    # a hub id the machine does not have: never downloaded on a record's word
    store.write_json(model_key, {**original, "name": "hf:someone/planted-model"})
    with pytest.raises(USER_ERRORS, match="never makes imgest download"):
        nightly_models(store)
    # a shard row's image uri outside the catalogue root recorded at ingest
    store.write_json(model_key, original)
    live = load_live_vectors(store, slug, int(original["dim"]))
    assert live.read_image(0)[:2] == b"\xff\xd8", "a row under the catalogue is read"
    for uri in (f"{listener}/row.jpg", "/etc/hostname", live.uris[0].rsplit("/p/", 1)[0] + "/../victim/keep.txt"):
        live.uris[1] = uri
        with pytest.raises(ContainmentError):
            live.read_image(1)
    with pytest.raises(ContainmentError):
        CatalogueImages(store, slug).read(f"{listener}/x.jpg")
    assert Recorder.seen == [], f"requests sent on a record's word: {Recorder.seen}"


@pytest.mark.parametrize("alias", ["../../x", "Serving", "a/b", "x" * 100])
def test_alias_names_out_of_grammar_are_one_line(store, alias):
    result = CliRunner().invoke(app, ["search", "--store", store.url, "--text", "x", "--alias", alias])
    assert result.exit_code == 2, result.output
    assert "alias names are lowercase" in result.output and "Traceback" not in result.output


def test_deeply_nested_or_huge_alias_record_is_one_line(store, built):
    query = str(built / "catalogue" / "p" / "000.jpg")
    store.write_bytes("aliases/serving.json", b"[" * 100_000 + b"]" * 100_000)
    result = CliRunner().invoke(app, ["search", "--store", store.url, "--image", query])
    assert result.exit_code == 2 and "nested deeper than" in result.output, result.output
    store.write_bytes("aliases/serving.json", b" " * (17 << 20))
    result = CliRunner().invoke(app, ["search", "--store", store.url, "--image", query])
    assert result.exit_code == 2 and "byte limit of a JSON record" in result.output, result.output


# -- mutations, generated ---------------------------------------------------------------------------------
HOSTILE = st.one_of(
    st.sampled_from(["..", "../..", "../../victim", "/etc/passwd", "/", "s3://other-bucket/k", "file:///etc/passwd",
                     "http://127.0.0.1:9/x", "head:http://127.0.0.1:9/h", "hf:attacker/model", "memory://x",
                     "a/../../b", "C:\\Windows", "\x00", "", " ", "model=../../victim"]),
    st.integers(min_value=-2**70, max_value=2**70), st.floats(allow_nan=True), st.booleans(), st.none(),
    st.text(max_size=40), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.none(),
                                                                             max_size=2),
)
RECORDS = ["alias", "card", "model", "retire", "window", "marker"]
SHARD = "part-r99999999-20990101T000000-ffffff-00000"  # a commit newer than any snapshot: folded on load


def _plant(store: Location, record: str, field: str | None, value) -> str:
    slug, version, card_key = serving(store)
    keys = {"alias": "aliases/serving.json", "card": card_key, "model": f"state/model={slug}/model.json",
            "retire": f"migration/retire/{slug}.json", "window": "migration/window.json",
            "marker": f"state/model={slug}/commits/{SHARD}.json"}
    key = keys[record]
    base = store.read_json(key) if store.exists(key) else {
        "retire": {"slug": slug, "retire_after": "2000-01-01T00:00:00+00:00"},
        "window": {"from": {"name": "raw-pixels", "slug": slug}, "to": {"name": "raw-pixels", "slug": slug},
                   "id": "w-1", "status": "open", "opened_at": "2026-01-01T00:00:00+00:00"},
        "marker": {"shard": SHARD, "run_id": SHARD[5:-6], "created": "2099-01-01T00:00:00+00:00",
                   "encoded": [{"item_id": "p/x.jpg", "uri": "/x.jpg", "etag": None, "size": 1, "mtime": 1.0,
                                "content_hash": "0" * 64}]}}[record]
    if field is None:
        data = value if isinstance(value, bytes) else json.dumps(value, default=str).encode()
    else:
        target = base
        *path, last = field.split(".")
        for part in path:
            target = target[part]
        target[last] = value
        data = json.dumps(base, default=str).encode()
    store.write_bytes(key, data)
    return key


FIELDS = {"alias": ["slug", "version", "sha256", "model_id", None],
          "card": ["slug", "version", "sha256", "index_file", "ids_file", "ids_sha256", "model_name", "kind", None],
          "model": ["slug", "name", "dim", "model_id", None],
          "retire": ["slug", "retire_after", None],
          "window": ["from.name", "from.slug", "to.name", "to.slug", None],
          "marker": ["shard", "run_id", "encoded", "rejected", "revived", None]}


def readers(store: Location):
    """Everything that reads the planted records: search, status, the nightly's model list, retention."""
    yield lambda: Searcher(store.url)
    yield lambda: open_index(store, *resolve_target(store, "serving", None, None))
    yield lambda: store_status(store.url)
    yield lambda: nightly_models(store)
    yield lambda: list_models(store)
    yield lambda: collect_retired(store, now=FUTURE)
    yield lambda: load_state(store, serving(store)[0])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_records_end_in_a_clear_error_or_are_ignored(built, tmp_path_factory, listener, data):
    root = tmp_path_factory.mktemp("mutated")
    shutil.copytree(built / "store", root / "store")
    (root / "victim").mkdir()
    (root / "victim" / "keep.txt").write_text("precious")
    store = Location(str(root / "store"))
    record = data.draw(st.sampled_from(RECORDS))
    field = data.draw(st.sampled_from(FIELDS[record]))
    value = data.draw(st.binary(max_size=64) | HOSTILE if field is None else HOSTILE)
    _plant(store, record, field, value)
    Recorder.seen.clear()
    before = sorted(os.listdir(root))
    for read in readers(store):
        try:
            read()
        except USER_ERRORS:
            pass  # a clear, one-line error
    assert untouched(store) and sorted(os.listdir(root)) == before
    assert Recorder.seen == []


def test_forged_index_header_is_refused_before_faiss_allocates(store):
    """A small index file whose header claims 16 GiB of vectors, with a card whose checksum matches it: refused
    in well under a second and 50 MB, naming the field, before FAISS reads it."""
    import hashlib
    import struct
    import time
    import tracemalloc

    slug, version, card_key = serving(store)
    path = store.path(f"indexes/model={slug}/v{version:04d}/index.faiss")
    data = bytearray(open(path, "rb").read())
    assert data[:4] == b"IxFI", "a flat index (12 items)"
    struct.pack_into("<Q", data, 37, 1 << 34)  # the codes' length prefix: 16 GiB in a file of a few KB
    open(path, "wb").write(bytes(data))
    edit(store, card_key, lambda card: card.update(sha256=hashlib.sha256(bytes(data)).hexdigest()))
    tracemalloc.start()
    started = time.monotonic()
    refused = r"refused before reading it: .*codes claims \d{11} bytes, the file has \d+ left"
    with pytest.raises(IndexIntegrityError, match=refused):
        Searcher(store.url)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.monotonic() - started < 5 and peak < 50 << 20


@pytest.mark.parametrize("checksum", ["../../escaped", "/tmp/escaped", "a/../../../escaped", "x" * 300])
def test_cache_names_are_hashed_never_a_records_text(tmp_path, checksum):
    """An object store's index is downloaded into the local cache under a name hashed from the location, the
    key and the checksum: a card's checksum of `../..` or an absolute path cannot place a file elsewhere."""
    from imgest.storage.cache import local_copy

    remote = Location(f"memory://hostile-{tmp_path.name}")
    remote.write_bytes("indexes/model=m-1a2b3c4d/v0001/index.faiss", b"faiss bytes")
    cache = tmp_path / "cache"
    path = local_copy(remote, "indexes/model=m-1a2b3c4d/v0001/index.faiss", str(cache), checksum, ".faiss")
    assert os.path.dirname(path) == str(cache) and open(path, "rb").read() == b"faiss bytes"
    assert sorted(os.listdir(tmp_path)) == ["cache"] and not os.path.exists("/tmp/escaped.faiss")


@pytest.mark.parametrize("base", ["head:{listener}/h", "hf:attacker/planted", "hf:/etc", "{listener}/model", 7, None])
def test_a_head_record_naming_its_base_elsewhere_is_refused(store, listener, base):
    """head.json is a record too: its base model is only one this installation has, never a URL."""
    from imgest import encoders

    Recorder.seen.clear()
    folder = "heads/head-planted"
    store.write_bytes(f"{folder}/head.safetensors", b"not weights")
    store.write_json(f"{folder}/head.json", {"base_model": base.format(listener=listener) if isinstance(base, str)
                                             else base, "base_model_id": "x", "dim_in": 4, "hidden": 4, "dim_out": 4})
    with pytest.raises(encoders.EncoderError):
        encoders.resolve.__wrapped__(f"head:{store.uri(folder)}")
    assert Recorder.seen == []


def test_on_s3_records_never_reach_outside_the_store(s3_endpoint, listener):
    """The attacks above on an S3 store (moto's server, then SeaweedFS), with a victim beside the store in its
    bucket and in another bucket of the same server: records aiming at either are refused, nothing is deleted,
    no request leaves for the listener, and serving still answers."""
    import hashlib
    import struct

    import s3fs

    from imgest import encoders

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    bucket, other = f"hostile-{os.urandom(3).hex()}", f"victim-{os.urandom(3).hex()}"
    fs.mkdir(bucket)
    fs.mkdir(other)
    for i in range(12):
        fs.pipe(f"{bucket}/catalogue/p/{i:03d}.jpg", jpeg_bytes(gradient(i, (160, 120))))
    victims = [f"{bucket}/victim/keep.txt", f"{other}/keep.txt"]
    for key in victims:
        fs.pipe(key, b"precious")
    nightly(NightlyConfig(catalogue=f"s3://{bucket}/catalogue", store=f"s3://{bucket}/store", model="raw-pixels",
                          batch_size="4"))
    store = Location(f"s3://{bucket}/store")
    slug, version, card_key = serving(store)
    Recorder.seen.clear()

    for target in ("../victim", "../../" + other, f"s3://{other}/keep.txt", "/" + other):
        store.write_json("migration/retire/evil.json", {"slug": target, "retire_after": "2000-01-01T00:00:00+00:00"})
        assert collect_retired(store, now=FUTURE) == []
    card = store.read_json(card_key)
    for path in ("../../victim/keep.txt", f"s3://{other}/keep.txt", f"indexes/model={slug}/v0001/../../../../victim",
                 f"{listener}/x.faiss"):
        store.write_json(card_key, {**card, "index_file": path})
        with pytest.raises(IndexIntegrityError, match="is not the version's own index.faiss"):
            Searcher(store.url)
    store.write_json(card_key, card)

    folder = "heads/head-planted"  # a head whose base is a URL: never fetched
    store.write_bytes(f"{folder}/head.safetensors", b"not weights")
    store.write_json(f"{folder}/head.json", {"base_model": f"{listener}/model", "base_model_id": "x", "dim_in": 4,
                                             "hidden": 4, "dim_out": 4})
    with pytest.raises(encoders.EncoderError):
        encoders.resolve.__wrapped__(f"head:{store.uri(folder)}")

    fs.invalidate_cache()
    assert all(fs.cat(key) == b"precious" for key in victims) and Recorder.seen == []
    assert open_index(store, slug, version).index.ntotal == 12

    # a forged header, its checksum matching: refused before FAISS reads it, on the copy fetched from S3
    index_key = f"indexes/model={slug}/v{version:04d}/index.faiss"
    data = bytearray(store.read_bytes(index_key))
    struct.pack_into("<Q", data, 37, 1 << 34)
    store.write_bytes(index_key, bytes(data))
    store.write_json(card_key, {**card, "sha256": hashlib.sha256(bytes(data)).hexdigest()})
    with pytest.raises(IndexIntegrityError, match="refused before reading it"):
        Searcher(store.url)

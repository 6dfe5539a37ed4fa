"""A duplicates run at catalogue size holds the duplicates as integer arrays, not the catalogue nor an object per
duplicate: every live vector searched a shard at a time, the pairs over the floor written to disk and joined with
the live set in DuckDB, which numbers the items that have a duplicate; groups are connected components over
integer edges and the report is written by DuckDB. The mechanism at 200,000 items of which a third are planted
copies: what Python and numpy allocate (tracemalloc) stays under a fixed cap while the run finds exactly the
planted groups, where grouping them the way the run before did (a dict entry per item and per pair, union-find over
strings) takes several times the cap, and loading the live set as lists (the run before that streamed) more."""

import tracemalloc

import faiss
import numpy as np
import pyarrow.parquet as pq

from imgest.retrieval.idmap import IdMap
from imgest.retrieval.versions import OpenIndex
from imgest.state.live import LiveShards, load_live_vectors
from imgest.tasks.duplicates.groups import group_items
from imgest.tasks.duplicates.report import GROUPS_SHOWN, DuplicateReport, write_report
from imgest.tasks.duplicates.scan import candidates, scan_pairs
from imgest.tasks.index.choice import choose_index
from imgest.tasks.index.stream import stream_build
from tests.test_index_stream import SPEC, write_store

N = 200_000
# in each block of six rows: row 1 has row 0's bytes (exact), row 4 has row 3's vector under other bytes (near);
# in every 50th block row 2 also has row 1's vector (row 0, 1 and 2: one near group, joined through row 1's bytes)
SAME_BYTES = {6 * b + 1: 6 * b for b in range(N // 6 + 1) if 6 * b + 1 < N}
SAME_VECTOR = {6 * b + 4: 6 * b + 3 for b in range(N // 6) if 6 * b + 4 < N} | \
              {6 * b + 2: 6 * b + 1 for b in range(0, N // 6, 50)}


def grouped_with_dicts(items: str, a: np.ndarray, b: np.ndarray, score: np.ndarray) -> list[tuple[str, list[str]]]:
    """The grouping the run before did: the candidates as dicts keyed by item (content hash, uri), the pairs as
    a dict keyed by (item, item), union-find over strings, a dict per group."""
    table = pq.read_table(items)
    ids = table["item_id"].to_pylist()
    hashes = dict(zip(ids, table["content_hash"].to_pylist()))
    uris = dict(zip(ids, table["uri"].to_pylist()))
    pairs = {(ids[x], ids[y]): (float(s), "embedding") for x, y, s in zip(a.tolist(), b.tolist(), score.tolist())}
    parent: dict[str, str] = {}

    def find(item: str) -> str:
        parent.setdefault(item, item)
        while parent[item] != item:
            parent[item] = parent[parent[item]]
            item = parent[item]
        return item

    first: dict[str, str] = {}
    for item, content_hash in sorted(hashes.items()):
        find(item)
        if content_hash in first:
            parent[max(find(item), find(first[content_hash]))] = min(find(item), find(first[content_hash]))
        else:
            first[content_hash] = item
    for x, y in pairs:
        rx, ry = find(x), find(y)
        if rx != ry:
            parent[max(rx, ry)] = min(rx, ry)
    members: dict[str, list[str]] = {}
    for item in hashes:
        members.setdefault(find(item), []).append(item)
    groups = [{"kind": "exact" if len({hashes[i] for i in m}) == 1 else "near", "items": sorted(m),
               "uris": [uris[i] for i in sorted(m)]} for m in members.values() if len(m) > 1]
    return sorted(((g["kind"], g["items"]) for g in groups), key=lambda g: (-len(g[1]), g[1]))


def test_a_duplicates_run_holds_the_duplicates_as_columns_not_the_catalogue(tmp_path):
    store, state, vectors = write_store(tmp_path, N, 2000, same_vector=SAME_VECTOR, same_bytes=SAME_BYTES)
    keys = list(vectors)
    live = LiveShards(state)
    state.close()
    choice = choose_index(len(live), SPEC.dim, "1G", "IVF256,Flat", "unlimited")
    built = stream_build(store, SPEC.slug, SPEC.dim, live, choice, queries=10, depth=10)
    faiss.extract_index_ivf(built.index).nprobe = 1  # a copy's vector is in its original's list
    opened = OpenIndex({}, built.index, IdMap(built.ids.path, "ids", str(tmp_path)))

    # one shard's vectors and neighbour lists, then integer arrays for the 134,000 items with a copy or a pair
    # (7.5 MB measured; grouping them with dicts: 97 MB)
    cap = 12 << 20
    tracemalloc.start()
    pairs_file = scan_pairs(store, SPEC.slug, SPEC.dim, live, opened, floor=0.99999, k=16)
    found = candidates(live, pairs_file)
    signal = np.zeros(len(found.a), np.int8)
    groups = group_items(found.hash_code, found.a, found.b, found.score, signal)
    report = DuplicateReport(SPEC.slug, "m", 0.99999, len(live))
    write_report(store, report, found, groups, found.a, found.b, found.score, signal, "20261205T000000000000",
                 live.folder)
    held = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()

    mixed = {6 * b for b in range(0, N // 6, 50)}
    expected = sorted([("near", sorted(keys[r] for r in (row, row + 1, row + 2))) for row in mixed] +
                      [("exact", sorted([keys[c], keys[o]])) for c, o in SAME_BYTES.items() if o not in mixed] +
                      [("near", sorted([keys[c], keys[o]])) for c, o in SAME_VECTOR.items() if o % 6 == 3],
                      key=lambda g: (-len(g[1]), g[1]))
    assert sum(len(items) for _, items in expected) > N / 3
    table = pq.read_table(store.path(report.key))
    rows = table.group_by("group").aggregate([("kind", "min"), ("item_id", "list")]).sort_by("group")
    assert list(zip(rows["kind_min"].to_pylist(), rows["item_id_list"].to_pylist())) == expected
    assert rows["group"].to_pylist() == list(range(len(expected)))  # numbered largest first, then by first item
    assert report.exact_groups + report.near_groups == len(expected) and report.new_groups == len(expected)
    assert report.exact_items + report.near_items == table.num_rows
    assert [(g["kind"], g["items"]) for g in report.groups] == expected[:GROUPS_SHOWN]
    assert held < cap, f"the run allocated {held / 1e6:.1f} MB of Python objects and arrays"

    # the hash band: every pair in it, every image's perceptual hash cached: its items, content hashes and hashes
    # stay columns (a dict per content hash held 20 MB here)
    import pyarrow as pa

    from imgest.tasks.duplicates.find import hash_pairs
    from imgest.tasks.duplicates.hashes import HashCache

    everything = pq.read_table(found.items, columns=["content_hash"])["content_hash"]
    phashes = np.zeros(len(everything), np.uint64)  # one picture, as far as the hashes go: every pair is within 0
    HashCache(store, max_rows=4 * len(live)).write(
        pa.table({"content_hash": everything, "phash": phashes}), live.ordered, "20261205T000000000001")

    class Unread:
        def read(self, uri):
            raise AssertionError(f"{uri} read: its hash is in the cache")

    band = np.arange(len(found.a))
    tracemalloc.start()
    hashed = hash_pairs(store, live, found, band, Unread(), {"hash_distance": 0}, "20261205T000000000002")
    banded = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert banded < cap, f"the hash band allocated {banded / 1e6:.1f} MB of Python objects and arrays"
    assert len(hashed) == len(band) and hashed.all()  # each item's hash found in the cache, none read

    tracemalloc.start()
    assert grouped_with_dicts(found.items, found.a, found.b, found.score) == expected
    with_dicts = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert with_dicts > 4 * cap, f"{with_dicts / 1e6:.1f} MB"

    tracemalloc.start()
    loaded = load_live_vectors(store, SPEC.slug, SPEC.dim)
    gathered = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(loaded) == N and gathered > 3 * cap, f"{gathered / 1e6:.1f} MB"

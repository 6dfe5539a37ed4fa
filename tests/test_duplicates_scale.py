"""A duplicates run at catalogue size holds the items that have a duplicate, not the catalogue: every live vector
searched a shard at a time, the pairs over the floor written to disk and joined with the live set in DuckDB, the
exact copies grouped there. The mechanism at 200,000 items: what Python and numpy allocate (tracemalloc) stays
under a fixed cap while the run finds exactly the planted copies, where loading the live set as lists (the run
before it streamed: 76 MB measured) takes several times the cap."""

import tracemalloc

import faiss

from imgest.retrieval.idmap import IdMap
from imgest.retrieval.versions import OpenIndex
from imgest.state.live import LiveShards, load_live_vectors
from imgest.tasks.duplicates.groups import find_duplicates
from imgest.tasks.duplicates.scan import candidates, scan_pairs
from imgest.tasks.index.choice import choose_index
from imgest.tasks.index.stream import stream_build
from tests.test_index_stream import SPEC, write_store

N = 200_000
SAME_VECTOR = {7: 70_001, 123_456: 5, 199_999: 42}  # near copies: the same vector under other bytes
SAME_BYTES = {1_000: 2_000, 3_000: 2_000, 150_000: 60}  # exact copies: the same content hash


def test_a_duplicates_scan_holds_the_duplicates_not_the_catalogue(tmp_path):
    store, state, vectors = write_store(tmp_path, N, 2000, same_vector=SAME_VECTOR, same_bytes=SAME_BYTES)
    keys = list(vectors)
    live = LiveShards(state)
    state.close()
    choice = choose_index(len(live), SPEC.dim, "1G", "IVF256,Flat", "unlimited")
    built = stream_build(store, SPEC.slug, SPEC.dim, live, choice, queries=10, depth=10)
    faiss.extract_index_ivf(built.index).nprobe = 1  # a copy's vector is in its original's list
    opened = OpenIndex({}, built.index, IdMap(built.ids.path, "ids", str(tmp_path)))

    cap = 8 << 20  # one shard's vectors and neighbour lists, the candidates' dicts (1 MB measured)
    tracemalloc.start()
    pairs_file = scan_pairs(store, SPEC.slug, SPEC.dim, live, opened, floor=0.99999, k=16)
    found = candidates(live, pairs_file)
    groups = find_duplicates(found.hashes, {(a, b): (s, "embedding") for a, b, s in found.pairs})
    scanned = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()

    exact = sorted(keys[r] for r in (1_000, 2_000, 3_000))
    expected = [("exact", exact)] + sorted(
        [("exact", sorted([keys[150_000], keys[60]]))] +
        [("near", sorted([keys[r], keys[s]])) for r, s in SAME_VECTOR.items()], key=lambda g: g[1])
    assert [(g["kind"], g["items"]) for g in groups] == expected
    assert all(g["min_score"] >= 0.9999 for g in groups if g["kind"] == "near")
    assert scanned < cap, f"the scan allocated {scanned / 1e6:.1f} MB of Python objects and arrays"

    tracemalloc.start()
    loaded = load_live_vectors(store, SPEC.slug, SPEC.dim)
    gathered = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(loaded) == N and gathered > 2 * cap, f"{gathered / 1e6:.1f} MB"

"""A faiss index file is walked before faiss reads it: every file faiss writes for the kinds imgest builds passes,
a forged, truncated or mutated one is refused with an IndexHeaderError, and what passes reads within its budget."""

import json
import os
import struct
import subprocess
import sys
import tracemalloc

import faiss
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from imgest.retrieval.header import KINDS, IndexHeaderError, check_index_file
from imgest.tasks.index.build import add_in_blocks, train
from imgest.tasks.index.choice import choose_index

D, N = 32, 600
IP, L2 = faiss.METRIC_INNER_PRODUCT, faiss.METRIC_L2
HEADER = 4 + 33  # fourcc, then d int32, ntotal int64, two unused int64, is_trained byte, metric int32
FORGED = 1 << 34  # 16 GiB

# name: (factory, metric, vectors added); IP kinds are built by imgest's own build(), the others by faiss directly
GENUINE = {
    "flat-ip": ("Flat", IP, N),
    "flat-l2": ("Flat", L2, N),
    "hnsw": ("HNSW32,Flat", IP, N),
    "ivf-flat": ("IVF8,Flat", IP, N),
    "ivf-flat-sparse": ("IVF64,Flat", IP, 10),  # most lists empty: faiss stores (list, size) pairs
    "ivf-sq8": ("IVF8,SQ8", IP, N),
    "ivf-hnsw-sq8": ("IVF8_HNSW32,SQ8", IP, N),
    "ivf-pq": ("IVF8,PQ8", IP, N),
    "ivf-pq-empty": ("IVF8,PQ8", IP, 0),
    "ivf-pq-l2": ("IVF8,PQ8", L2, N),  # faiss recomputes a table of nlist x M x 256 floats on read
    "ivf-pq-refine-sqfp16": ("IVF8,PQ8,Refine(SQfp16)", IP, N),
    "ivf-pq-refine-flat": ("IVF8,PQ8,RFlat", IP, N),
    "opq-ivf-pq-refine": ("OPQ4_32,IVF8,PQ4,Refine(SQfp16)", IP, N),
    "idmap-flat": ("IDMap,Flat", L2, N),
    "idmap2-flat": ("IDMap2,Flat", L2, N),
}


def vectors(n: int = N, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def write_genuine(name: str, path: str) -> str:
    factory, metric, n = GENUINE[name]
    x = vectors()
    if metric == IP:  # imgest's own path: polysemous training off, OPQ bounded, trained on every row here
        index = add_in_blocks(train(x, choose_index(N, D, kind=factory), rows=np.arange(N)), x[:n])
    else:
        index = faiss.index_factory(D, factory, metric)
        if "PQ" in factory:  # as imgest does: polysemous training is slow and never used
            faiss.downcast_index(faiss.extract_index_ivf(index)).do_polysemous_training = False
        index.train(x)
        index.add_with_ids(x, np.arange(N) * 7) if factory.startswith("IDMap") else index.add(x)
    faiss.write_index(index, path)
    return path


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    folder, made = tmp_path_factory.mktemp("genuine"), {}

    def get(name: str) -> bytes:
        if name not in made:
            made[name] = open(write_genuine(name, str(folder / f"{name}.faiss")), "rb").read()
        return made[name]

    return get


def written(tmp_path, data: bytes, name: str = "index.faiss") -> str:
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return str(path)


@pytest.mark.parametrize("name", GENUINE)
def test_every_genuine_file_is_accepted_with_its_sizes(name, genuine, tmp_path):
    path = written(tmp_path, genuine(name))
    index = faiss.read_index(path)
    info = check_index_file(path, expect={"dim": index.d, "ntotal": index.ntotal})
    assert (info["dim"], info["ntotal"], info["fourcc"]) == (D, index.ntotal, open(path, "rb").read(4).decode())
    assert info["file_bytes"] == os.path.getsize(path)
    # all but the headers is payload that faiss allocates: a count well under it means a part was skipped
    assert info["alloc_bytes"] + info["mapped_bytes"] >= info["file_bytes"] - 2048
    mapped = check_index_file(path, io_flags=faiss.IO_FLAG_MMAP)
    assert mapped["alloc_bytes"] + mapped["mapped_bytes"] >= info["file_bytes"] - 2048


def test_allocation_worked_by_hand_for_flat_and_ivf(genuine, tmp_path):
    flat = check_index_file(written(tmp_path, genuine("flat-ip"), "flat.faiss"))
    assert (flat["alloc_bytes"], flat["mapped_bytes"]) == (N * D * 4, 0)  # 600 x 32 floats = 76,800 bytes
    path = written(tmp_path, genuine("ivf-flat"), "ivf.faiss")
    lists = N * (D * 4 + 8)  # each vector's code (128 bytes) and id (8): 81,600
    small = 8 * 8 + 8 * D * 4  # the 8 list sizes (64) and the 8 centroids (1,024)
    whole = check_index_file(path)
    assert (whole["alloc_bytes"], whole["mapped_bytes"]) == (lists + small + 8 * (8 + 2 * 64), 0)  # 83,776
    served = check_index_file(path, io_flags=faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
    assert (served["alloc_bytes"], served["mapped_bytes"]) == (small + 8 * (8 + 24), lists)  # 1,344 and 81,600
    assert faiss.read_index(path, faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY).ntotal == N


def pq_centroids_offset(data: bytes) -> int:
    # IwPQ: header, nlist, nprobe, the IxFI quantizer (fourcc, header, length, nlist x d floats), the direct map
    # (type byte, empty vector), by_residual, code_size, then the PQ's d, M, nbits and its centroids' length
    nlist = struct.unpack_from("<Q", data, HEADER)[0]
    return HEADER + 16 + (HEADER + 8 + nlist * D * 4) + (1 + 8) + (1 + 8) + 24


FORGERIES = {  # name: (genuine file, field named in the message, offset, value claiming 16 GiB)
    "flat ntotal": ("flat-ip", "ntotal", lambda data: 8, FORGED // (4 * D)),
    "flat codes length": ("flat-ip", "codes", lambda data: HEADER, FORGED // 4),
    "ivfpq ntotal": ("ivf-pq", "ntotal", lambda data: 8, FORGED // 8),
    "ivfpq nlist": ("ivf-pq", "nlist", lambda data: HEADER, FORGED // 8),
    "ivfpq pq centroids length": ("ivf-pq", "pq centroids", pq_centroids_offset, FORGED // 4),
    "ivfpq list size": ("ivf-pq", "inverted list data", lambda data: data.index(b"ilar") + 4 + 16 + 4 + 8,
                        FORGED // (8 + 8)),
    "ivfpq list sizes length": ("ivf-pq", "inverted list sizes", lambda data: data.index(b"ilar") + 4 + 16 + 4,
                                FORGED // 8),
}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_forged_sizes_are_refused_naming_the_field_with_little_memory(forgery, genuine, tmp_path):
    name, field, offset, value = FORGERIES[forgery]
    data = bytearray(genuine(name))
    at = offset(data)
    fmt = "<Q" if at != 8 else "<q"
    data[at:at + 8] = struct.pack(fmt, value)
    path = written(tmp_path, data)
    tracemalloc.start()
    try:
        with pytest.raises(IndexHeaderError) as refused:
            check_index_file(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(refused.value)
    assert field in message and path in message and "\n" not in message
    assert peak < 50 << 20


@pytest.mark.parametrize("name", ["flat-ip", "hnsw", "ivf-flat-sparse", "ivf-sq8", "ivf-hnsw-sq8",
                                  "opq-ivf-pq-refine", "ivf-pq-refine-flat", "idmap2-flat"])
def test_truncated_files_are_refused(name, genuine, tmp_path):
    data = genuine(name)
    cuts = {0, 1, 3, 4, 8, HEADER - 1, HEADER, HEADER + 3, len(data) // 3, len(data) // 2, len(data) - 8,
            len(data) - 1} | set(range(40, min(len(data), 400), 17))
    for cut in sorted(cuts):
        with pytest.raises(IndexHeaderError):
            check_index_file(written(tmp_path, data[:cut]))
    with pytest.raises(IndexHeaderError, match="bytes after the index"):
        check_index_file(written(tmp_path, data + b"\0"))


@pytest.mark.parametrize("fourcc", [b"ZZZZ", b"IxPQ", b"IxLS", b"null"])
def test_unknown_fourcc_is_refused_listing_the_known_ones(fourcc, genuine, tmp_path):
    data = bytearray(genuine("ivf-pq"))
    with pytest.raises(IndexHeaderError, match="not an index type imgest builds") as refused:
        check_index_file(written(tmp_path, fourcc + data[4:]))
    assert all(kind in str(refused.value) for kind in KINDS)
    quantizer = HEADER + 16
    data[quantizer:quantizer + 4] = fourcc
    with pytest.raises(IndexHeaderError, match="quantizer fourcc"):
        check_index_file(written(tmp_path, data))


def test_a_known_index_in_the_wrong_place_is_refused(genuine, tmp_path):
    data = bytearray(genuine("ivf-pq"))
    data[HEADER + 16:HEADER + 20] = b"IwPQ"  # an IVF as the coarse quantizer of an IVF
    with pytest.raises(IndexHeaderError, match="IwPQ quantizer fourcc is 'IwPQ', allowed one of IxFI"):
        check_index_file(written(tmp_path, data))


def test_memory_budget_below_the_allocation_is_refused_naming_the_budget(genuine, tmp_path):
    path = written(tmp_path, genuine("ivf-pq-refine-sqfp16"))
    need = check_index_file(path)["alloc_bytes"]
    assert check_index_file(path, memory_budget=need)["alloc_bytes"] == need
    with pytest.raises(IndexHeaderError, match=f"over the memory budget of {need - 1} bytes"):
        check_index_file(path, memory_budget=need - 1)
    mapped = check_index_file(path, memory_budget=need - 1, io_flags=faiss.IO_FLAG_MMAP)  # its lists stay on disk
    assert mapped["alloc_bytes"] < need - 1 and mapped["mapped_bytes"] > 0


def test_the_card_is_cross_checked(genuine, tmp_path):
    path = written(tmp_path, genuine("hnsw"))
    assert check_index_file(path, expect={"dim": D, "ntotal": N})["ntotal"] == N
    with pytest.raises(IndexHeaderError, match=f"ntotal is {N}, its card says {N - 1}"):
        check_index_file(path, expect={"ntotal": N - 1})
    with pytest.raises(IndexHeaderError, match=f"dim is {D}, its card says 64"):
        check_index_file(path, expect={"dim": 64})
    with pytest.raises(ValueError, match="unknown field"):
        check_index_file(path, expect={"d": D})


# Reads each accepted file in a child whose address space is capped at what it has plus the file's alloc_bytes
# and a slack: an allocation larger than the check said fails there with MemoryError (std::bad_alloc).
READ_CAPPED = """
import json, resource, sys, faiss
slack, failures = 256 << 20, []
for path, alloc in json.load(open(sys.argv[1])):
    have = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (have + alloc + slack, resource.RLIM_INFINITY))
    try:
        faiss.read_index(path)
    except MemoryError as e:
        failures.append(f"{path}: {e}")
    except RuntimeError as e:  # faiss's own checks of values (graph links, ranges): refused, not allocated
        if "bad_alloc" in str(e):
            failures.append(f"{path}: {e}")
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(json.dumps(failures))
"""
MUTATED = ["flat-ip", "hnsw", "ivf-pq", "ivf-flat-sparse", "ivf-hnsw-sq8", "opq-ivf-pq-refine", "idmap2-flat"]


@pytest.mark.slow("a subprocess")
def test_mutated_bytes_are_accepted_or_refused_and_what_is_accepted_reads_within_its_count(genuine, tmp_path):
    accepted = []
    sources = {name: genuine(name) for name in MUTATED}

    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(name=st.sampled_from(MUTATED), in_head=st.booleans(), cut=st.none() | st.floats(0, 1),
           edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=6))
    def mutate(name, in_head, cut, edits):
        data = bytearray(sources[name])
        span = min(len(data), 600) if in_head else len(data)  # the structure sits mostly in the first bytes
        for where, value in edits:
            data[int(where * span)] = value
        if cut is not None:
            data = data[:int(cut * len(data))]
        path = written(tmp_path, data, f"mutant-{len(accepted)}.faiss")
        try:
            info = check_index_file(path)
        except IndexHeaderError:
            return
        assert info["alloc_bytes"] <= 4 * info["file_bytes"] + (1 << 20)
        accepted.append((path, info["alloc_bytes"]))

    mutate()
    assert accepted, "no mutant was accepted: the faiss half of this test read nothing"
    listing = tmp_path / "accepted.json"
    listing.write_text(json.dumps(accepted[:150]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-c", READ_CAPPED, str(listing)], capture_output=True, text=True,
                           timeout=300, env=env)
    assert child.returncode == 0, child.stderr[-2000:]
    assert json.loads(child.stdout.strip().splitlines()[-1]) == []

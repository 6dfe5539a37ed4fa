"""Check a FAISS index file's structure against its real size before faiss.read_index allocates what it claims."""

from __future__ import annotations

import math
import os
import struct

# the faiss.read_index flags that change what is allocated (faiss/index_io.h)
IO_FLAG_SKIP_IVF_DATA = 8  # set by faiss.IO_FLAG_MMAP: inverted lists mapped from the file (OnDiskInvertedLists)
IO_FLAG_SKIP_PRECOMPUTE_TABLE = 16
IO_FLAG_MMAP_IFC = 512  # codes, graph links and inverted lists mapped from the file

FLAT = ("IxFI", "IxF2", "IxFl")  # IndexFlatIP, IndexFlatL2, IndexFlat
IVF = ("IwFl", "IwSq", "IwPQ")  # IVF with flat, scalar-quantized or PQ codes, lists stored inline ("ilar")
METRICS = {0: "inner product", 1: "L2"}
SQ_TYPES = {0: ("SQ8", 1, 2), 4: ("SQfp16", 2, 0)}  # faiss qtype: name, code bytes and trained floats per dimension
MAX_DIM = 1 << 20  # faiss's own bound on d
PRECOMPUTED_TABLE_MAX = 1 << 31  # faiss's precomputed_table_max_bytes: an L2 IVF-PQ builds its table up to this
LIST_OVERHEAD = 8 + 2 * 64  # heap per inverted list read whole: its size and two vector objects (ids, codes)
MAPPED_LIST_OVERHEAD = 8 + 24  # heap per inverted list mapped: its size, and offset/size/capacity
HASH_ENTRY = 48  # heap per entry of an unordered_map<int64, int64> (node and bucket): IndexIDMap2's reverse map
CHUNK = 8192  # list sizes are summed this many at a time (even: a sparse pair never straddles two chunks)


class IndexHeaderError(ValueError):
    """An index file's structure does not fit its size, its card or the memory budget; faiss never reads it."""


class _Walk:
    """A bounded reader over the file: knows the bytes left, seeks past payloads, counts what faiss would allocate."""

    def __init__(self, fh, path: str, size: int, io_flags: int):
        self.fh, self.path, self.size = fh, path, size
        self.lists_mapped = bool(io_flags & IO_FLAG_SKIP_IVF_DATA)
        self.ifc = bool(io_flags & IO_FLAG_MMAP_IFC)
        self.precompute = not io_flags & IO_FLAG_SKIP_PRECOMPUTE_TABLE
        self.alloc = self.mapped = 0

    def left(self) -> int:
        return self.size - self.fh.tell()

    def check(self, field: str, value, ok: bool, allowed) -> None:
        if not ok:
            raise IndexHeaderError(f"{self.path}: {field} is {value}, allowed {allowed}")

    def fits(self, field: str, nbytes: int, verb: str = "claims") -> None:
        if nbytes > self.left():
            raise IndexHeaderError(f"{self.path}: {field} {verb} {nbytes} bytes, the file has {self.left()} left")

    def scalars(self, fmt: str, field: str) -> tuple:
        need = struct.calcsize("<" + fmt)
        self.fits(field, need, "needs")
        return struct.unpack("<" + fmt, self.fh.read(need))

    def one(self, fmt: str, field: str):
        return self.scalars(fmt, field)[0]

    def flag(self, field: str) -> int:
        value = self.one("B", field)
        self.check(field, value, value in (0, 1), "0 or 1")  # faiss refuses any other byte for a bool
        return value

    def fourcc(self, field: str) -> str:
        return self.scalars("4s", field)[0].decode("latin-1")

    def payload(self, field: str, nbytes: int, mappable: bool = False) -> int:
        """Seek past `nbytes` of data (never read them); the offset where they start."""
        self.fits(field, nbytes)
        start = self.fh.tell()
        self.fh.seek(nbytes, os.SEEK_CUR)
        if mappable:
            self.mapped += nbytes
        else:
            self.alloc += nbytes
        return start

    def vector(self, field: str, item: int, expect: int | None = None, mappable: bool = False) -> tuple[int, int]:
        """A length-prefixed vector of `item`-byte elements: (its length, the offset of its data)."""
        count = self.one("Q", f"{field} length")
        start = self.payload(field, count * item, mappable)
        if expect is not None:
            self.check(f"{field} length", count, count == expect, expect)
        return count, start

    def peek(self, offset: int, fmt: str) -> int:
        here = self.fh.tell()
        self.fh.seek(offset)
        value = struct.unpack("<" + fmt, self.fh.read(struct.calcsize("<" + fmt)))[0]
        self.fh.seek(here)
        return value

    def index(self, allowed: tuple[str, ...], role: str) -> dict:
        kind = self.fourcc(f"{role} fourcc")
        if kind not in KINDS:
            raise IndexHeaderError(f"{self.path}: {role} fourcc {kind!r} is not an index type imgest builds; "
                                   f"known: {', '.join(KINDS)}")
        self.check(f"{role} fourcc", repr(kind), kind in allowed, f"one of {', '.join(allowed)} here")
        return KINDS[kind](self, kind)


def _header(w: _Walk, kind: str) -> dict:
    d, ntotal, _, _, trained, metric = w.scalars("iqqqBi", f"{kind} header")
    w.check(f"{kind} d", d, 0 < d <= MAX_DIM, f"1 to {MAX_DIM}")
    w.check(f"{kind} ntotal", ntotal, ntotal >= 0, ">= 0")
    w.check(f"{kind} is_trained", trained, trained in (0, 1), "0 or 1")
    w.check(f"{kind} metric_type", metric, metric in METRICS, " or ".join(f"{k} ({v})" for k, v in METRICS.items()))
    return {"fourcc": kind, "d": d, "ntotal": ntotal, "trained": trained, "metric": metric}


def _same(w: _Walk, kind: str, outer: dict, inner: dict, role: str, ntotal: bool = True) -> None:
    w.check(f"{kind} {role} d", inner["d"], inner["d"] == outer["d"], f"d={outer['d']} of {kind}")
    if ntotal:
        w.check(f"{kind} {role} ntotal", inner["ntotal"], inner["ntotal"] == outer["ntotal"],
                f"ntotal={outer['ntotal']} of {kind}")


def _flat(w: _Walk, kind: str) -> dict:
    h = _header(w, kind)
    floats, _ = w.vector(f"{kind} codes", 4, mappable=w.ifc)  # counted in floats (an old layout faiss keeps)
    w.check(f"{kind} ntotal", h["ntotal"], floats == h["ntotal"] * h["d"], f"{floats // h['d']} (its codes)")
    return h


def _sq(w: _Walk, kind: str, d: int) -> int:
    qtype, _, _, sq_d, code_size = w.scalars("iifQQ", f"{kind} scalar quantizer")
    names = ", ".join(f"{q} ({name})" for q, (name, _, _) in SQ_TYPES.items())
    w.check(f"{kind} sq qtype", qtype, qtype in SQ_TYPES, names)
    _, per_dim, trained_per_dim = SQ_TYPES[qtype]
    w.check(f"{kind} sq d", sq_d, sq_d == d, d)
    w.check(f"{kind} sq code_size", code_size, code_size == per_dim * d, per_dim * d)
    trained, _ = w.vector(f"{kind} sq trained", 4)
    w.check(f"{kind} sq trained length", trained, trained in (0, trained_per_dim * d), f"0 or {trained_per_dim * d}")
    return code_size


def _sq_flat(w: _Walk, kind: str) -> dict:
    h = _header(w, kind)
    code_size = _sq(w, kind, h["d"])
    nbytes, _ = w.vector(f"{kind} codes", 1, mappable=w.ifc)
    w.check(f"{kind} ntotal", h["ntotal"], nbytes == h["ntotal"] * code_size, f"{nbytes // code_size} (its codes)")
    return h


def _pq(w: _Walk, kind: str, d: int) -> tuple[int, int, int]:
    """(M, ksub, code_size) of a ProductQuantizer, its centroids skipped."""
    pq_d, m, nbits = w.scalars("QQQ", f"{kind} pq")
    w.check(f"{kind} pq d", pq_d, pq_d == d, d)
    w.check(f"{kind} pq M", m, 0 < m <= d and d % m == 0, f"a divisor of d={d}")
    w.check(f"{kind} pq nbits", nbits, 1 <= nbits <= 24, "1 to 24")
    # faiss sizes the centroids from d and nbits before it reads them: they must be what the file holds
    w.vector(f"{kind} pq centroids", 4, expect=d << nbits)
    return m, 1 << nbits, (m * nbits + 7) // 8


def _ivf(w: _Walk, kind: str) -> dict:
    h = _header(w, kind)
    nlist, nprobe = w.scalars("QQ", f"{kind} nlist and nprobe")
    quantizer = w.index(FLAT + ("IHNf",), f"{kind} quantizer")
    _same(w, kind, h, quantizer, "quantizer", ntotal=False)
    # list tables are sized by nlist before any list is read: it must be the centroids the file holds
    w.check(f"{kind} nlist", nlist, 0 < nlist == quantizer["ntotal"], f"the {quantizer['ntotal']} centroids stored")
    w.check(f"{kind} nprobe", nprobe, 0 < nprobe <= nlist, f"1 to nlist={nlist}")
    direct = w.one("B", f"{kind} direct map type")
    w.check(f"{kind} direct map type", direct, direct in (0, 1, 2), "0 (none), 1 (array) or 2 (hashtable)")
    w.vector(f"{kind} direct map", 8)
    if direct == 2:
        pairs, _ = w.vector(f"{kind} direct map hashtable", 16)
        w.alloc += pairs * HASH_ENTRY
    return {**h, "nlist": nlist, "quantizer_metric": quantizer["metric"]}


def _list_sizes(w: _Walk, kind: str, start: int, count: int, sparse: bool, nlist: int) -> tuple[int, int]:
    """(vectors in all lists, in the largest), read CHUNK sizes at a time."""
    end, total, largest, last = w.fh.tell(), 0, 0, -1
    w.fh.seek(start)
    for first in range(0, count, CHUNK):
        values = struct.unpack(f"<{min(CHUNK, count - first)}Q", w.fh.read(8 * min(CHUNK, count - first)))
        sizes = values[1::2] if sparse else values
        for list_no in values[0::2] if sparse else ():  # faiss writes (list, size) pairs in list order
            w.check(f"{kind} sparse list number", list_no, last < list_no < nlist, f"{last + 1} to {nlist - 1}")
            last = list_no
        total, largest = total + sum(sizes), max(largest, max(sizes, default=0))
    w.fh.seek(end)
    return total, largest


def _lists(w: _Walk, kind: str, h: dict, code_size: int) -> None:
    tag = w.fourcc(f"{kind} inverted lists fourcc")
    w.check(f"{kind} inverted lists fourcc", repr(tag), tag == "ilar", "'ilar' (lists stored in the file)")
    nlist, stored = w.scalars("QQ", f"{kind} inverted lists nlist and code_size")
    w.check(f"{kind} inverted lists nlist", nlist, nlist == h["nlist"], h["nlist"])
    w.check(f"{kind} inverted lists code_size", stored, stored == code_size, code_size)
    layout = w.fourcc(f"{kind} inverted lists layout")
    w.check(f"{kind} inverted lists layout", repr(layout), layout in ("full", "sprs"), "'full' or 'sprs'")
    count, start = w.vector(f"{kind} inverted list sizes", 8, expect=nlist if layout == "full" else None)
    w.check(f"{kind} sparse list sizes length", count, layout == "full" or count % 2 == 0, "an even number")
    total, largest = _list_sizes(w, kind, start, count, layout == "sprs", nlist)
    w.payload(f"{kind} inverted list data", total * (code_size + 8), mappable=w.lists_mapped or w.ifc)
    w.check(f"{kind} ntotal", h["ntotal"], h["ntotal"] == total, f"the {total} vectors its inverted lists hold")
    w.alloc += nlist * (MAPPED_LIST_OVERHEAD if w.lists_mapped else LIST_OVERHEAD)
    if w.ifc and not w.lists_mapped:  # each list is allocated, then swapped for its mapped view
        w.alloc += largest * (code_size + 8)


def _ivf_flat(w: _Walk, kind: str) -> dict:
    h = _ivf(w, kind)
    _lists(w, kind, h, 4 * h["d"])
    return h


def _ivf_sq(w: _Walk, kind: str) -> dict:
    h = _ivf(w, kind)
    code_size = _sq(w, kind, h["d"])
    stored = w.one("Q", f"{kind} code_size")
    w.check(f"{kind} code_size", stored, stored == code_size, code_size)
    w.flag(f"{kind} by_residual")
    _lists(w, kind, h, code_size)
    return h


def _ivf_pq(w: _Walk, kind: str) -> dict:
    h = _ivf(w, kind)
    by_residual = w.flag(f"{kind} by_residual")
    stored = w.one("Q", f"{kind} code_size")
    m, ksub, code_size = _pq(w, kind, h["d"])
    w.check(f"{kind} code_size", stored, stored == code_size, f"{code_size} (the PQ's)")
    _lists(w, kind, h, code_size)
    table = h["nlist"] * m * ksub * 4  # recomputed on read, never stored: L2 residuals only, and up to a cap
    if h["trained"] and by_residual and h["quantizer_metric"] == 1 and w.precompute and table <= PRECOMPUTED_TABLE_MAX:
        w.alloc += table
    return h


def _hnsw(w: _Walk, kind: str) -> dict:
    h = _header(w, kind)
    n = h["ntotal"]
    w.vector(f"{kind} assign_probas", 8)
    w.vector(f"{kind} cum_nneighbor_per_level", 4)
    w.vector(f"{kind} levels", 4, expect=n)
    _, offsets = w.vector(f"{kind} offsets", 8, expect=n + 1)
    w.vector(f"{kind} neighbors", 4, expect=w.peek(offsets + 8 * n, "Q"), mappable=w.ifc)
    w.scalars("5i", f"{kind} graph parameters")
    _same(w, kind, h, w.index(FLAT, f"{kind} storage"), "storage")
    return h


def _pretransform(w: _Walk, kind: str) -> dict:
    h = _header(w, kind)
    chain = w.one("i", f"{kind} chain length")
    w.check(f"{kind} chain length", chain, 0 <= chain <= 4, "0 to 4")
    d = h["d"]
    for i in range(chain):
        role = f"{kind} transform {i}"
        tag = w.fourcc(f"{role} fourcc")
        w.check(f"{role} fourcc", repr(tag), tag == "LTra", "'LTra' (a linear transform: OPQ)")
        w.flag(f"{role} have_bias")
        a, _ = w.vector(f"{role} A", 4)
        b, _ = w.vector(f"{role} b", 4)
        d_in, d_out = w.scalars("ii", f"{role} d_in and d_out")
        w.flag(f"{role} is_trained")
        w.check(f"{role} d_in", d_in, d_in == d, d)
        w.check(f"{role} d_out", d_out, 0 < d_out <= MAX_DIM, f"1 to {MAX_DIM}")
        w.check(f"{role} A length", a, a == d_in * d_out, d_in * d_out)
        w.check(f"{role} b length", b, b in (0, d_out), f"0 or {d_out}")
        w.alloc += 4 * d_out * d_out if d_out <= d_in else 0  # faiss tests A for orthonormality with A A^T
        d = d_out
    inner = w.index(IVF, f"{kind} index")
    _same(w, kind, {**h, "d": d}, inner, "index")
    return h


def _refine(w: _Walk, kind: str) -> dict:
    h = _header(w, kind)
    _same(w, kind, h, w.index(IVF + ("IxPT",), f"{kind} base"), "base")
    _same(w, kind, h, w.index(FLAT + ("IxSQ",), f"{kind} refine"), "refine")
    k_factor = w.one("f", f"{kind} k_factor")
    w.check(f"{kind} k_factor", k_factor, math.isfinite(k_factor) and 1 <= k_factor <= 1000, "1 to 1000")
    return h


def _idmap(w: _Walk, kind: str) -> dict:
    h = _header(w, kind)
    _same(w, kind, h, w.index(FLAT + ("IHNf",) + IVF + ("IxPT", "IxRF"), f"{kind} index"), "index")
    w.vector(f"{kind} id_map", 8, expect=h["ntotal"])
    if kind == "IxM2":  # IndexIDMap2 builds a reverse map on read
        w.alloc += h["ntotal"] * HASH_ENTRY
    return h


KINDS = {"IxFI": _flat, "IxF2": _flat, "IxFl": _flat, "IxSQ": _sq_flat, "IHNf": _hnsw, "IwFl": _ivf_flat,
         "IwSq": _ivf_sq, "IwPQ": _ivf_pq, "IxPT": _pretransform, "IxRF": _refine, "IxMp": _idmap, "IxM2": _idmap}
TOP = FLAT + ("IHNf",) + IVF + ("IxPT", "IxRF", "IxMp", "IxM2")


def check_index_file(path: str, *, memory_budget: int | None = None, expect: dict | None = None,
                     io_flags: int = 0) -> dict:
    """Walk the faiss index file at `path` without reading its payloads and refuse it (IndexHeaderError) unless
    every size it claims fits the bytes it has: each length-prefixed vector, ntotal against the codes or lists,
    nlist against the stored centroids; only the index types imgest builds (KINDS).

    `io_flags` are the flags the caller will pass to faiss.read_index: with faiss.IO_FLAG_MMAP the inverted
    lists, with faiss.IO_FLAG_MMAP_IFC also codes and graph links, are mapped from the file instead of read.
    Returns {"fourcc", "dim", "ntotal", "alloc_bytes": heap faiss allocates to read it with those flags,
    "mapped_bytes": bytes it maps instead, "file_bytes"}; alloc_bytes over `memory_budget` is refused, and so is
    a dim or ntotal other than `expect` says (fields of the index's card)."""
    wrong = set(expect or {}) - {"dim", "ntotal"}
    if wrong:
        raise ValueError(f"expect: unknown field(s) {', '.join(sorted(wrong))}; allowed: dim, ntotal")
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        w = _Walk(fh, path, size, io_flags)
        top = w.index(TOP, "index")
        w.check("bytes after the index", w.left(), w.left() == 0, "0 (faiss writes none)")
    found = {"dim": top["d"], "ntotal": top["ntotal"]}
    for field, value in (expect or {}).items():
        if found[field] != value:
            raise IndexHeaderError(f"{path}: {field} is {found[field]}, its card says {value}")
    if memory_budget is not None and w.alloc > memory_budget:
        raise IndexHeaderError(f"{path}: reading it allocates {w.alloc} bytes, over the memory budget of "
                               f"{memory_budget} bytes")
    return {"fourcc": top["fourcc"], **found, "alloc_bytes": w.alloc, "mapped_bytes": w.mapped, "file_bytes": size}

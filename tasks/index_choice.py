"""Choose a FAISS index from N, d and a memory budget; the rule is stated here, in the README and the card.

The rule, first that fits the budget wins (autofaiss-style):
  1. Flat (exact)            when N <= 50,000: exact search is fast enough and needs no tuning.
  2. HNSW32,Flat             when N x (4d + 2 x 32 x 4 x 1.1) bytes fit: best recall/latency per query.
  3. IVF{nlist},SQ8          when N x (d + 8) + nlist x 4d bytes fit: 4x smaller, near-exact.
  4. IVF{nlist},PQ{m} with the largest m in (64, 48, 32, 16, 8) that divides d into sub-vectors
     of >= 4 dimensions and fits. OPQ is left to explicit factory strings: its training cost on a CPU
     (minutes for 20k vectors of d=1280) outweighs its recall gain for an automatic nightly build.
nlist is the power of two nearest 8 x sqrt(N) (inside the 4-16 x sqrt(N) band), lowered until there
are >= 39 training points per centroid; training uses at most 64 points per centroid (k-means
quality flattens well before faiss's 256 cap, and training time is linear in the sample). From
nlist = 16,384 (N around 4M) the coarse quantizer is an HNSW graph over the centroids
(`IVF{nlist}_HNSW32,...`): finding the nprobe nearest lists then costs a graph walk, not a scan of every
centroid (16,384 x d flops per query and growing with sqrt(N)), as autofaiss does at that size.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

RULE = ("first that fits the memory budget: Flat if N <= 50000; HNSW32,Flat if N*(4d+281.6) bytes fit; "
        "IVF{nlist},SQ8 if N*(d+8)+nlist*4d fit; else IVF{nlist},PQm with the largest m in (64,48,32,16,8) "
        "giving >= 4 dims per sub-vector that fits (OPQ only by factory string); nlist = power of two nearest "
        "8*sqrt(N), "
        "lowered to keep >= 39 training points per centroid; <= 64 training points per centroid; an HNSW32 coarse "
        "quantizer from nlist 16384")
FLAT_MAX_N = 50_000
TRAIN_PER_CENTROID = 64
HNSW_M = 32
COARSE_HNSW_MIN_NLIST = 16_384  # from here the centroids are searched through an HNSW graph
KINDS = ("auto", "flat", "hnsw", "ivfsq8", "ivfpq")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class IndexChoiceError(ValueError):
    """The kind, factory string or memory budget cannot work; the message says what would."""


def parse_memory(text: str | int) -> int:
    """'4G', '512M', '1.5GB', '2GiB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", str(text).upper())
    if not match:
        raise IndexChoiceError(f"memory must look like 4G, 512M, 1.5GB or a byte count; got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


@dataclass(frozen=True)
class IndexChoice:
    factory: str
    kind: str
    nlist: int | None
    pq_m: int | None
    train_size: int
    estimated_bytes: int
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def flat_bytes(n: int, d: int) -> int:
    return n * d * 4


def hnsw_bytes(n: int, d: int, m: int = HNSW_M) -> int:
    # level 0 keeps 2M int32 neighbours per vector; upper levels add about 10%
    return int(n * (4 * d + 2 * m * 4 * 1.1))


def nlist_for(n: int) -> int:
    if n < 39 * 2:
        return 1
    nlist = 2 ** round(math.log2(8 * math.sqrt(n)))
    while nlist > 1 and n < 39 * nlist:
        nlist //= 2
    return nlist


def coarse_bytes(nlist: int, d: int) -> int:
    """The centroids, plus their HNSW graph from COARSE_HNSW_MIN_NLIST on."""
    return nlist * d * 4 + (int(nlist * 2 * HNSW_M * 4 * 1.1) if nlist >= COARSE_HNSW_MIN_NLIST else 0)


def sq8_bytes(n: int, d: int, nlist: int) -> int:
    return n * (d + 8) + coarse_bytes(nlist, d)


def pq_bytes(n: int, d: int, nlist: int, m: int) -> int:
    return n * (m + 8) + coarse_bytes(nlist, d) + d * d * 4


def _pq_choice(n: int, d: int, nlist: int, budget: int | None) -> tuple[int, int]:
    options = [m for m in (64, 48, 32, 16, 8) if d % m == 0 and d // m >= 4]  # sub-vectors of >= 4 dims
    if not options:
        raise IndexChoiceError(f"PQ needs d divisible by 8, 16, 32, 48 or 64 with >= 4 dims each; d={d}: use "
                               "--kind hnsw or a factory string")
    for m in options:
        size = pq_bytes(n, d, nlist, m)
        if budget is None or size <= budget:
            return m, size
    need = pq_bytes(n, d, nlist, options[-1])
    raise IndexChoiceError(f"memory budget {budget} bytes is too small for {n} vectors of d={d}: the smallest "
                           f"index (IVF{nlist},PQ{options[-1]}) needs about {need} bytes")


def choose_index(n: int, d: int, memory: int | str = "4G", kind: str = "auto") -> IndexChoice:
    """Pick the index for ``n`` vectors of dimension ``d`` under ``memory`` bytes (see module doc)."""
    budget = parse_memory(memory)
    if kind not in KINDS:
        if "," in kind or kind.startswith(("Flat", "HNSW", "IVF", "OPQ", "PQ")):
            return IndexChoice(kind, "factory", None, None, min(n, TRAIN_PER_CENTROID * 1024), 0,
                               "explicit faiss factory string")
        raise IndexChoiceError(f"unknown index kind {kind!r}; allowed: {', '.join(KINDS)} or a faiss factory string")
    nlist = nlist_for(n)
    ivf = f"IVF{nlist}_HNSW{HNSW_M}" if nlist >= COARSE_HNSW_MIN_NLIST else f"IVF{nlist}"
    train = min(n, TRAIN_PER_CENTROID * nlist)
    if kind == "flat" or (kind == "auto" and n <= FLAT_MAX_N and flat_bytes(n, d) <= budget):
        why = "asked for" if kind == "flat" else f"N={n} <= {FLAT_MAX_N}: exact search"
        return IndexChoice("Flat", "flat", None, None, 0, flat_bytes(n, d), why)
    if kind == "hnsw" or (kind == "auto" and hnsw_bytes(n, d) <= budget):
        why = "asked for" if kind == "hnsw" else f"HNSW{HNSW_M} fits: {hnsw_bytes(n, d)} <= {budget} bytes"
        return IndexChoice(f"HNSW{HNSW_M},Flat", "hnsw", None, None, 0, hnsw_bytes(n, d), why)
    if kind == "ivfsq8" or (kind == "auto" and sq8_bytes(n, d, nlist) <= budget):
        why = "asked for" if kind == "ivfsq8" else f"HNSW does not fit; IVF,SQ8 does ({sq8_bytes(n, d, nlist)} bytes)"
        return IndexChoice(f"{ivf},SQ8", "ivfsq8", nlist, None, train, sq8_bytes(n, d, nlist), why)
    m, size = _pq_choice(n, d, nlist, budget if kind == "auto" else None)
    # No OPQ in the automatic choice: faiss's OPQ training took over 10 minutes for 20k vectors of
    # d=1280 on the 2-core development machine (IVF512,PQ64 alone: 48 s). Pass "OPQ64_512,IVF...,PQ64"
    # as a factory string where its recall gain is worth that.
    why = "asked for" if kind == "ivfpq" else f"only PQ fits the budget: PQ{m} needs {size} bytes"
    return IndexChoice(f"{ivf},PQ{m}", "ivfpq", nlist, m, train, size, why)

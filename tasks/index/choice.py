"""Choose a FAISS index from N, d and a memory budget; stated here, in docs/indexes-and-search.md, on the card.

The rule, first that fits the budget wins (autofaiss-style):
  1. Flat (exact)            when N <= 50,000: exact search is fast enough and needs no tuning.
  2. HNSW32,Flat             when N x (4d + 2 x 32 x 4 x 1.1) bytes fit and N <= HNSW_NIGHTLY_MAX_N: best
                             recall/latency per query, but a nightly builds the graph again every night.
  3. IVF{nlist},SQ8          when N x (d + 8) + nlist x 4d bytes fit: 4x smaller, near-exact, updated in place
                             by the nightly. Past HNSW_NIGHTLY_MAX_N it is taken even where HNSW would fit; if
                             it then misses the recall target the build falls back to HNSW (and keeps HNSW until
                             the catalogue doubles).
  4. IVF{nlist},PQ{m},Refine(SQfp16): PQ codes searched for k x k_factor candidates, re-ranked by the
     float16 vectors. m is the largest in PQ_OPTIONS that divides d into sub-vectors of >= 4 dimensions
     and whose codes fit the RAM budget; the float16 vectors (2d bytes each) go on local disk (memory-mapped
     when served, read k x k_factor times per query) when they fit `--disk`, else in RAM when they fit
     there too, else PQ alone (which rarely meets a recall target: the card says so). With sub-vectors of
     >= OPQ_MIN_DIMS dimensions an OPQ rotation comes first (OPQ{m}_{d}), trained on at most OPQ_TRAIN
     vectors for OPQ_NITER iterations: PQ's error grows with the width of a sub-vector, which a learned
     rotation spreads evenly.
nlist is 8 x sqrt(N) rounded to a multiple of NLIST_STEP (1,024; below it, the nearest power of two),
lowered until there are >= 39 training points per centroid; training uses at most 64 points per centroid
(k-means quality flattens well before faiss's 256 cap). Training then costs 64 x nlist^2 x d per k-means
iteration, which is 64 x 64 N d: linear in N as long as nlist follows 8 x sqrt(N) closely. Rounding to a power
of two did not: 32,768 lists at 10M for 25,298, 1.68x the lists and 2.8x the training (the build grew 20x
from 1M to 10M). From nlist = 16,384 (N around 4.2M) the coarse quantizer is an HNSW graph over the centroids
(`IVF{nlist}_HNSW32,...`): finding the nprobe nearest lists then costs a graph walk, not a scan of every
centroid (16,384 x d flops per query and growing with sqrt(N)), as autofaiss does at that size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from imgest.errors import UserError
from imgest.names import KINDS, parse_disk, parse_memory

RULE = ("first that fits the memory budget: Flat if N <= 50000; HNSW32,Flat if N*(4d+281.6) bytes fit and "
        "N <= 100000 (past it IVF,SQ8 when it fits, which the nightly updates in place; HNSW if IVF misses the "
        "target); "
        "IVF{nlist},SQ8 if N*(d+8)+nlist*4d fit; else IVF{nlist},PQm,Refine(SQfp16) with the largest m in "
        "PQ_OPTIONS giving >= 4 dims per sub-vector whose codes N*(m+8) (+ coarse, codebooks) fit, the float16 "
        "re-rank vectors (2dN bytes) on disk if they fit --disk, else in RAM if they fit, else no re-rank; OPQ "
        "in front when a sub-vector has >= 16 dims; nlist = 8*sqrt(N) to a multiple of 1024 (a power of two "
        "below 1024), lowered to keep >= "
        "39 training points per centroid; <= 64 training points per centroid; an HNSW32 coarse quantizer from "
        "nlist 16384")
FLAT_MAX_N = 50_000
TRAIN_PER_CENTROID = 64
NLIST_STEP = 1024  # nlist is a multiple of this from 8 x sqrt(N) >= NLIST_STEP on
HNSW_M = 32
COARSE_HNSW_MIN_NLIST = 16_384  # from here the centroids are searched through an HNSW graph
# Past this N, `auto` takes IVF,SQ8 over an HNSW graph that would fit: a nightly builds a graph again every night
# (faiss cannot remove a vector from one) but updates an IVF index in place. Measured through the build-index flow
# at d = 1280 (BENCHMARKS.md, "Which index a nightly keeps"): here the rebuild takes HNSW_REBUILD_OVER_UPDATE
# times the update and more, and grows faster than it.
HNSW_NIGHTLY_MAX_N = 100_000
HNSW_REBUILD_OVER_UPDATE = 15
PQ_OPTIONS = (320, 256, 160, 128, 96, 80, 64, 48, 32, 16, 8)  # sub-quantizers, 8 bits each: m bytes per vector
REFINE = "SQfp16"  # the re-rank vectors: float16, 2d bytes each (exact to ~1e-3 on unit vectors)
OPQ_MIN_DIMS = 16  # a sub-vector this wide or wider gets an OPQ rotation first
OPQ_TRAIN = 25_000  # OPQ's own training sample (faiss's default is 65,536)
OPQ_NITER = 10  # its alternating iterations (faiss's default is 50: 5x the time for a small gain)


def nightly_fallback(choice: IndexChoice, n: int, d: int, memory: int | str, disk: int | str | None,
                     recall: float, target: float) -> IndexChoice:
    """The kind `choice` was picked instead of (HNSW), after `choice`'s index reached only `recall` of `target`:
    the card says why."""
    back = choose_index(n, d, memory, choice.instead_of, disk)
    why = (f"{choice.factory} (picked over HNSW{HNSW_M} to be updated in place) reached recall {recall} < target "
           f"{target}: {back.factory} instead, built again every night")
    return IndexChoice(**{**back.to_dict(), "reason": why, "missed_at_n": n})


def kept_fallback(previous: dict | None, n: int, d: int, memory: int | str,
                  disk: int | str | None) -> IndexChoice | None:
    """The previous version's kind again when it is a fallback (its updatable kind missed the target, see
    `nightly_fallback`) and the catalogue has not doubled since: trying that kind again every night would build
    twice a night. None otherwise."""
    choice = (previous or {}).get("choice") or {}
    missed, kind = choice.get("missed_at_n"), choice.get("kind")
    if not (isinstance(missed, int) and 0 < n < 2 * missed and kind in KINDS):
        return None
    back = choose_index(n, d, memory, kind, disk)
    why = (f"v{previous['version']:04d} fell back to {kind}: the updatable kind missed the recall target at "
           f"N={missed:,}; kept until N reaches {2 * missed:,}")
    return IndexChoice(**{**back.to_dict(), "reason": why, "missed_at_n": missed})


class IndexChoiceError(UserError, ValueError):
    """The kind, factory string or memory budget cannot work; the message says what would."""


@dataclass(frozen=True)
class IndexChoice:
    factory: str
    kind: str
    nlist: int | None
    pq_m: int | None
    train_size: int
    estimated_bytes: int  # in RAM
    reason: str
    refine: str | None = None  # "disk": re-rank vectors memory-mapped from local disk; "ram"; None: no re-rank
    disk_bytes: int = 0  # on local disk beside the RAM (the re-rank vectors when refine == "disk")
    instead_of: str | None = None  # the kind the rule left for this updatable one: built instead if this one
    # misses the recall target (see `nightly_fallback`)
    missed_at_n: int | None = None  # on a fallback: N at which the updatable kind missed the target

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
    aim = 8 * math.sqrt(n)
    nlist = round(aim / NLIST_STEP) * NLIST_STEP if aim >= NLIST_STEP else 2 ** round(math.log2(aim))
    while nlist > 1 and n < 39 * nlist:
        nlist //= 2
    return nlist


def coarse_bytes(nlist: int, d: int) -> int:
    """The centroids, plus their HNSW graph from COARSE_HNSW_MIN_NLIST on."""
    return nlist * d * 4 + (int(nlist * 2 * HNSW_M * 4 * 1.1) if nlist >= COARSE_HNSW_MIN_NLIST else 0)


def sq8_bytes(n: int, d: int, nlist: int) -> int:
    return n * (d + 8) + coarse_bytes(nlist, d)


def pq_bytes(n: int, d: int, nlist: int, m: int, opq: bool = False) -> int:
    """RAM of IVF-PQ: codes and int64 ids in the inverted lists, the coarse quantizer, the PQ codebooks
    (256 centroids of d/m dims per sub-quantizer: 256 x d floats), an OPQ rotation (d x d floats)."""
    return n * (m + 8) + coarse_bytes(nlist, d) + 256 * d * 4 + (d * d * 4 if opq else 0)


def refine_bytes(n: int, d: int) -> int:
    return n * 2 * d  # float16


def refines(factory: str) -> bool:
    """A factory whose PQ candidates are re-ranked by stored vectors (faiss IndexRefine)."""
    return ",Refine(" in factory or factory.endswith(",RFlat")


def _pq_choice(n: int, d: int, nlist: int, ram: int | None, disk: int | None) -> tuple[int, bool, str | None]:
    """(m, opq, where the re-rank vectors go) for the largest m whose codes fit `ram` (None: no limit)."""
    options = [m for m in PQ_OPTIONS if d % m == 0 and d // m >= 4]  # sub-vectors of >= 4 dims
    if not options:
        raise IndexChoiceError(f"PQ needs d divisible by one of {PQ_OPTIONS} with >= 4 dims each; d={d}: use "
                               "--kind hnsw or a factory string")
    default = [m for m in options if m <= 64] or options[-1:]
    for m in options if ram is not None else default:
        opq = d // m >= OPQ_MIN_DIMS
        if ram is not None and opq and pq_bytes(n, d, nlist, m, True) > ram:
            opq = False  # the d x d rotation does not fit beside the codes (a small N): PQ without it
        codes = pq_bytes(n, d, nlist, m, opq)
        if ram is not None and codes > ram:
            continue
        if disk is None or refine_bytes(n, d) <= disk:
            return m, opq, "disk"
        if ram is None or codes + refine_bytes(n, d) <= ram:
            return m, opq, "ram"
        return m, opq, None
    need = pq_bytes(n, d, nlist, options[-1])
    raise IndexChoiceError(f"memory budget {ram} bytes is too small for {n} vectors of d={d}: the smallest "
                           f"index (IVF{nlist},PQ{options[-1]}) needs about {need} bytes")


def choose_index(n: int, d: int, memory: int | str = "4G", kind: str = "auto",
                 disk: int | str | None = "unlimited") -> IndexChoice:
    """Pick the index for ``n`` vectors of dimension ``d`` under ``memory`` bytes of RAM and ``disk`` bytes of
    local disk for re-rank vectors (see module doc)."""
    budget, disk_budget = parse_memory(memory), parse_disk(disk)
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
    hnsw_fits, sq8_fits = hnsw_bytes(n, d) <= budget, sq8_bytes(n, d, nlist) <= budget
    updatable_instead = kind == "auto" and hnsw_fits and sq8_fits and n > HNSW_NIGHTLY_MAX_N
    if kind == "hnsw" or (kind == "auto" and hnsw_fits and not updatable_instead):
        why = "asked for" if kind == "hnsw" else f"HNSW{HNSW_M} fits: {hnsw_bytes(n, d)} <= {budget} bytes"
        return IndexChoice(f"HNSW{HNSW_M},Flat", "hnsw", None, None, 0, hnsw_bytes(n, d), why)
    if kind == "ivfsq8" or (kind == "auto" and sq8_fits):
        why = "asked for" if kind == "ivfsq8" else f"HNSW does not fit; IVF,SQ8 does ({sq8_bytes(n, d, nlist)} bytes)"
        if updatable_instead:
            why = (f"HNSW{HNSW_M} fits, but past N={HNSW_NIGHTLY_MAX_N:,} a graph built again every night costs "
                   f"{HNSW_REBUILD_OVER_UPDATE}x and more the update of an IVF index in place (measured); IVF,SQ8 "
                   f"fits ({sq8_bytes(n, d, nlist)} bytes) and the nightly updates it; HNSW if it misses the target")
        return IndexChoice(f"{ivf},SQ8", "ivfsq8", nlist, None, train, sq8_bytes(n, d, nlist), why,
                           instead_of="hnsw" if updatable_instead else None)
    m, opq, refine = _pq_choice(n, d, nlist, budget if kind == "auto" else None, disk_budget)
    size = pq_bytes(n, d, nlist, m, opq) + (refine_bytes(n, d) if refine == "ram" else 0)
    factory = (f"OPQ{m}_{d}," if opq else "") + f"{ivf},PQ{m}" + (f",Refine({REFINE})" if refine else "")
    where = {"disk": f"float16 re-rank vectors on disk ({refine_bytes(n, d)} bytes)",
             "ram": "float16 re-rank vectors in RAM (they do not fit --disk)",
             None: "no re-rank: the float16 vectors fit neither --disk nor RAM"}[refine]
    why = "asked for" if kind == "ivfpq" else f"only PQ fits the budget: PQ{m} codes need {size} bytes"
    return IndexChoice(factory, "ivfpq", nlist, m, train, size, f"{why}; {where}", refine,
                       refine_bytes(n, d) if refine == "disk" else 0)

"""The store's layout: every folder and key imgest reads or writes in a store, spelled here and nowhere else.

A key is built by one of these functions from the parts that vary (a model's slug, a shard, a run, a sequence
number); a slug is checked on the way (`records.slug`), so a key never climbs out of its folder. `TREE` is the
layout as docs/store.md shows it: tests/test_layout.py checks the page against it, and that no other module of
the package spells a store key.
"""

from __future__ import annotations

from imgest.storage import records

# -- the top-level folders ----------------------------------------------------------------------------------
EMBEDDINGS = "embeddings"
STATE = "state"
PIXELS = "pixels"
RUNS = "runs"
TUNING = "tuning"
LOCKS = "locks"
INDEXES = "indexes"
ALIASES = "aliases"
MIGRATION = "migration"
METADATA = "metadata"
HISTORY = "history"
HEADS = "heads"
DUPLICATES = "duplicates"
SYNC = "sync"

MODEL = "model="  # a model's folder in each of them: model=<slug>, hive-style
LOCK_DIR = f"{LOCKS}/writer"
WINDOW_KEY = f"{MIGRATION}/window.json"
RETIRED = f"{MIGRATION}/retire"
CLOSED_WINDOWS = f"{MIGRATION}/history"
METADATA_SNAPSHOTS = f"{METADATA}/snapshots"
NIGHTLY_HISTORY = f"{HISTORY}/nightly"
DUPLICATE_HASHES = f"{DUPLICATES}/hashes"
MODEL_RECORD = "model.json"  # in a model's state folder
DELTA = ".delta"  # a state snapshot holding a run's changed items only (imgest/state/committed.py)


def file_in(folder: str, name: str) -> str:
    """A file of one of these folders by the name the folder's listing gave."""
    return f"{folder}/{name}"


def model_folder(top: str, slug: str, what: str = "model") -> str:
    """`<top>/model=<slug>`: a model's folder under one of the top-level folders (the slug checked)."""
    return f"{top}/{MODEL}{records.slug(slug, what)}"


# -- a model's shards, state and kept pixels ----------------------------------------------------------------
def embeddings_prefix(slug: str) -> str:
    return model_folder(EMBEDDINGS, slug)


def shard_key(slug: str, shard: str) -> str:
    return f"{embeddings_prefix(slug)}/{shard}.parquet"


def state_prefix(slug: str) -> str:
    return model_folder(STATE, slug)


def model_key(slug: str) -> str:
    """The model's record (imgest/state/models.py)."""
    return f"{state_prefix(slug)}/{MODEL_RECORD}"


def decoder_key(slug: str) -> str:
    """The model's JPEG decode, recorded once (imgest/images/decoders.py)."""
    return f"{state_prefix(slug)}/decoder.json"


def catalogue_root_key(slug: str) -> str:
    """The catalogue root the model's item ids are relative to (imgest/state/catalogue_images.py)."""
    return f"{state_prefix(slug)}/catalogue.json"


def kept_setting_key(slug: str) -> str:
    return f"{state_prefix(slug)}/kept-pixels.json"


def kept_gate_key(slug: str) -> str:
    return f"{state_prefix(slug)}/kept-gate.json"


def commits_prefix(slug: str) -> str:
    return f"{state_prefix(slug)}/commits"


def commit_key(slug: str, shard: str) -> str:
    return f"{commits_prefix(slug)}/{shard}.json"


def snapshots_prefix(slug: str) -> str:
    return f"{state_prefix(slug)}/snapshots"


def snapshot_key(slug: str, seq: int, delta: bool = False) -> str:
    return f"{snapshots_prefix(slug)}/{seq:08d}{DELTA if delta else ''}.parquet"


def pixels_prefix(slug: str) -> str:
    """Where a model's kept pixels are (imgest/state/pixels.py): a pixel file beside each shard, by side."""
    return model_folder(PIXELS, slug)


def pixels_side_prefix(slug: str, side: int) -> str:
    return f"{pixels_prefix(slug)}/side={int(side)}"


def pixels_key(slug: str, side: int, shard: str) -> str:
    return f"{pixels_side_prefix(slug, side)}/{shard}.parquet"


# -- runs, measurements, the writer lock --------------------------------------------------------------------
def run_summary_key(run_id: str) -> str:
    return f"{RUNS}/{run_id}.json"


def run_timeline_key(run_id: str) -> str:
    return f"{RUNS}/{run_id}.shards.parquet"


def tuning_key(slug: str, device_key: str, runtime: str = "torch", precision: str = "fp32",
               batch: int | None = None) -> str:
    return f"{model_folder(TUNING, slug)}/{device_key}-{runtime}-{precision}-batch-{batch or 'auto'}.json"


def tuning_prefix(slug: str) -> str:
    return model_folder(TUNING, slug)


def generation_key(generation: int) -> str:
    return f"{LOCK_DIR}/{generation:012d}.json"


# -- indexes and aliases ------------------------------------------------------------------------------------
def index_prefix(slug: str) -> str:
    return model_folder(INDEXES, slug, "index model")


def version_prefix(slug: str, version: int) -> str:
    return f"{index_prefix(slug)}/v{version:04d}"


def build_record_key(slug: str, key: str) -> str:
    return f"{index_prefix(slug)}/builds/{key}.json"


def alias_key(name: str) -> str:
    """An alias's record; the name is checked by imgest/state/aliases.py before it gets here."""
    return f"{ALIASES}/{name}.json"


# -- the migration window -----------------------------------------------------------------------------------
def shadow_prefix(window_id: str) -> str:
    return f"{MIGRATION}/shadow/{window_id}"


def retired_key(slug: str) -> str:
    return f"{RETIRED}/{records.slug(slug, 'retired model')}.json"


def closed_window_key(window_id: str) -> str:
    return f"{CLOSED_WINDOWS}/{window_id}.json"


# -- catalogue metadata, history, heads, duplicates, sync ---------------------------------------------------
def metadata_snapshot_key(seq: int) -> str:
    return f"{METADATA_SNAPSHOTS}/{seq:08d}.parquet"


def drift_reference_key(slug: str, version: int) -> str:
    return f"{model_folder(HISTORY + '/drift', slug, 'drift model')}/v{version:04d}.npz"


def nightly_history_prefix(slug: str) -> str:
    return model_folder(NIGHTLY_HISTORY, slug, "history model")


def head_folder(head_id: str) -> str:
    return f"{HEADS}/{head_id}"


def duplicates_prefix(slug: str) -> str:
    return model_folder(DUPLICATES, slug)


def duplicates_report_key(slug: str, run: str) -> str:
    return f"{duplicates_prefix(slug)}/{run}.parquet"


def duplicate_pairs_key(slug: str, run: str) -> str:
    return f"{model_folder(DUPLICATES + '/pairs', slug)}/{run}.parquet"


def calibration_prefix(slug: str) -> str:
    return model_folder(DUPLICATES + "/calibration", slug)


def sync_target_prefix(target_slug: str) -> str:
    return f"{SYNC}/{target_slug}"


# -- the layout as docs/store.md shows it (tests/test_layout.py holds the page to it) ------------------------
TREE = (
    ("embeddings/model=<slug>/part-<run>-<NNNNN>.parquet", "one row per encoded image (hive-style folder)"),
    ("state/model=<slug>/model.json", "the encoder: name, model id, dim, preprocessing"),
    ("state/model=<slug>/decoder.json",
     "the model's JPEG decode (decoder, side): recorded once, kept by its runs and queries"),
    ("state/model=<slug>/catalogue.json", "the catalogue root its item ids are relative to"),
    ("state/model=<slug>/kept-pixels.json", "kept pixels: the side its runs keep copies at (0: none)"),
    ("state/model=<slug>/kept-gate.json", "kept pixels: the gate's verdicts on reading another model's copies"),
    ("pixels/model=<slug>/side=<S>/part-<run>-<NNNNN>.parquet",
     "kept pixels: a reduced JPEG copy per image of the shard"),
    ("state/model=<slug>/commits/part-<run>-<NNNNN>.json", "shard commit marker: written after its Parquet file"),
    ("state/model=<slug>/snapshots/<seq>[.delta].parquet",
     "catalogue state after each run that changed it (or its change)"),
    ("runs/<run>.json", "run summary: parameters, counts, batch size, images/s, workers"),
    ("runs/<run>.shards.parquet", "per shard: worker, started, finished, seconds, where it decoded, rows, sha256"),
    ("tuning/model=<slug>/<device>-<runtime>-<precision>-batch-<auto|N>.json", "runtime and batch-size measurements"),
    ("locks/writer/<generation>.json", "the fenced writer lock: its holder is the highest generation"),
    ("indexes/model=<slug>/v<NNNN>/", "an index version: index, ids, card.json, truth (docs/indexes-and-search.md)"),
    ("indexes/model=<slug>/builds/<key>.json", "build records: which version the same inputs built (JSON)"),
    ("aliases/<name>.json", "an alias (serving, shadow, captions, ...): the version it points at, its history"),
    ("migration/window.json", "the open migration window"),
    ("migration/shadow/<window>/", "shadow traffic's records of that window"),
    ("migration/history/<window>.json", "closed windows"),
    ("migration/retire/<slug>.json", "models a finished window retired (never ingested again)"),
    ("metadata/snapshots/<seq>.parquet", "catalogue metadata (title, caption, attributes) as each run stored it"),
    ("history/nightly/model=<slug>/", "the nightly's trend rows (imgest watch)"),
    ("history/drift/model=<slug>/v<NNNN>.npz", "the drift reference of an index version"),
    ("heads/head-<sha>/", "a trained head: weights, held-out views and queries, loss curves, head.json"),
    ("duplicates/model=<slug>/<time>.parquet", "a duplicates report: a row per member of each group"),
    ("duplicates/pairs/model=<slug>/<time>.parquet", "the near pairs that joined that report's groups"),
    ("duplicates/calibration/model=<slug>/<time>.json", "the model's duplicate threshold measured on this catalogue"),
    ("duplicates/hashes/<time>.parquet", "perceptual hashes per content hash (a cache)"),
    ("sync/<target>/<slug>/<seq>.json", "a vector database target's watermark (and its .intent/.manifest files)"),
)


def tree_text() -> str:
    """TREE as docs/store.md shows it."""
    return "<store>/\n" + "".join(f"  {path:<52} {what}\n" for path, what in TREE)

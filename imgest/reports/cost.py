"""The cost model of the serving model at N items: encode time, re-encode cost, query latency, storage."""

from __future__ import annotations

import json
import time

import numpy as np

from imgest import encoders
from imgest.names import DEFAULT_SHARD_SIZE, parse_memory
from imgest.retrieval.versions import IndexNotFoundError, read_card
from imgest.state.aliases import read_alias
from imgest.state.models import list_models
from imgest.storage import Location
from imgest.tasks.index.choice import HNSW_M, choose_index
from imgest.tasks.ingest.batch_size import tune_batch_size
from imgest.timing import Stopwatch, projected_hours


def _latency_ms(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    with Stopwatch() as calls:
        for _ in range(repeats):
            fn()
    return round(calls.elapsed * 1000 / repeats, 2)


def storage_per_vector(d: int, pq_m: int = 64) -> dict[str, float]:
    return {"fp32": 4 * d, "fp16": 2 * d, "int8": d, f"pq{pq_m}": pq_m, "hnsw32_graph": round(2 * HNSW_M * 4 * 1.1, 1)}


REHEARSED = ("train-head", "migrate start", "migrate status", "migrate promote", "sync", "serve", "migrate finish")


def read_rehearsal(path: str) -> dict:
    """A model change rehearsed at N (bench/bench_model_change.py's result: a file whose last non-empty line is
    its JSON, as the benchmark prints it), checked: {"objects": N, "stages": {stage: {"seconds", "peak_rss_mb"}}}."""
    from imgest.config import ConfigError

    try:
        with open(path) as fh:
            lines = [line for line in fh.read().splitlines() if line.strip()]
        found = json.loads(lines[-1]) if lines else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--rehearsal {path}: not a rehearsal's result ({exc})") from None
    stages = found.get("stages") if isinstance(found, dict) else None
    n = found.get("objects") if isinstance(found, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or not isinstance(stages, dict) or not stages or \
            not all(isinstance(s, dict) and isinstance(s.get("seconds"), int | float) and s["seconds"] >= 0
                    for s in stages.values()):
        raise ConfigError(f"--rehearsal {path}: its last line is not a rehearsal's result "
                          "({\"objects\": N, \"stages\": {...}}, as bench/bench_model_change.py --json prints it)")
    return found


def model_change(rehearsal: dict, corpus_size: int, encode_hours: float) -> dict:
    """A model change's window at `corpus_size`, from one rehearsed at N: each stage's time scaled linearly in
    N (from 1M to 10M each stage grew at most 12x, BENCHMARKS.md), its peak memory as measured (it does not
    follow N). The rehearsal changes to a model derived from stored vectors; a new backbone also encodes every
    image (`encode_hours`), in place of the derivation inside `migrate start`: its total is an upper bound."""
    n, scale = rehearsal["objects"], corpus_size / rehearsal["objects"]
    stages = {name: {"measured_seconds": float(row["seconds"]), "projected_hours":
                     float(f"{row['seconds'] * scale / 3600:.4g}"), "peak_rss_mb": row.get("peak_rss_mb")}
              for name in REHEARSED if isinstance(row := rehearsal["stages"].get(name), dict)}
    window = sum(row["projected_hours"] for name, row in stages.items() if name != "serve")
    return {"rehearsed_objects": n, "rehearsed_on": rehearsal.get("date"), "stages": stages,
            "derived_model_hours": float(f"{window:.4g}"),
            "new_backbone_hours": float(f"{window + encode_hours:.4g}")}


KEPT_SAMPLE = 32  # parity photos decoded to measure what a copy saves, when the store keeps none to measure
PIXEL_FILE_ROWS = DEFAULT_SHARD_SIZE  # copies a pixel file holds (one per shard, as its shard): objects read


def kept_pixels_cost(store: Location, slug: str, encoder, images_per_second: float, sizes: list[int]) -> dict:
    """A model change's decode and encode hours, objects and bytes read, from the catalogue and from kept pixels, at
    each of `sizes` items on this host; and the copies' storage. Per image: the originals' mean size (the serving
    model's live rows), the copies' (its pixel files; else copies of the parity sample's photos at the side it would
    keep, 256 unless recorded), and a decode worker's core-seconds for either (measured here on the parity sample's
    photos, with the model's decoder and decode side). Hours are the work bound: decode core-seconds spread over the
    host's cores, beside the encoder's measured images/s."""
    import hashlib
    import os

    from imgest.encoders import parity
    from imgest.images import kept
    from imgest.images.decode import decode_image
    from imgest.images.decoders import recorded
    from imgest.images.demo import product_photos
    from imgest.state import pixels
    from imgest.state.committed import load_state

    state = load_state(store, slug)
    try:
        original_bytes = state.query("SELECT avg(size) AS b FROM state WHERE status = 'live'")["b"][0].as_py() or 0
        coverage = pixels.coverage(store, slug, state)
    finally:
        state.close()
    side = coverage["side"] or (coverage["sides"] or [256])[0]
    decode = recorded(store, slug, encoder)
    need, decoder = decode.side, decode.decoder
    files = tuple(product_photos(KEPT_SAMPLE, seed=parity.SAMPLE_SEED).values())
    copies = [kept.make_copy(decode_image(data, min_side=max(need or 0, side), decoder=decoder), side)[0]
              for data in files]

    def core_seconds(work, datas) -> float:
        start = time.thread_time()
        for data in datas:
            work(data)
        return (time.thread_time() - start) / len(datas)

    def from_original(data: bytes):
        hashlib.sha256(data).hexdigest()
        return encoder.preprocess(decode_image(data, min_side=need, decoder=decoder))

    def from_copy(data: bytes):
        return encoder.preprocess(decode_image(data, min_side=need))

    decode = {"catalogue": core_seconds(from_original, files), "kept pixels": core_seconds(from_copy, copies)}
    copy_bytes = coverage["bytes"] / coverage["live_items"] if coverage["live_items"] else \
        sum(map(len, copies)) / len(copies) * (original_bytes / (sum(map(len, files)) / len(files)) if original_bytes
                                               else 1.0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_image = {source: seconds / cores + 1 / images_per_second for source, seconds in decode.items()}
    return {
        "side": side, "fits": kept.fits(need, side), "cores": cores,
        "copy_bytes_per_image": round(copy_bytes), "original_bytes_per_image": round(original_bytes),
        "copies_measured": coverage["live_items"] > 0,
        "decode_core_ms_per_image": {k: round(v * 1e3, 3) for k, v in decode.items()},
        "at": {str(n): {"hours": {k: float(f"{v * n / 3600:.4g}") for k, v in per_image.items()},
                        "objects_read": {"catalogue": n, "kept pixels": -(-n // PIXEL_FILE_ROWS)},
                        "bytes_read": {"catalogue": round(n * original_bytes), "kept pixels": round(n * copy_bytes)},
                        "copies_storage_bytes": round(n * copy_bytes)} for n in sizes},
    }


def cost_report(store_url: str, corpus_size: int, gpu_hour_price: float | None = None,
                node_memory: str = "64G", device: str = "auto", min_seconds: float = 1.0,
                node_disk: str = "unlimited", rehearsal: dict | None = None) -> dict:
    store = Location(store_url)
    serving = read_alias(store, "serving")
    if serving is None:
        raise IndexNotFoundError(f"no serving alias in {store.url}: run `imgest nightly` first")
    card = read_card(store, serving["slug"], serving["version"])
    spec = encoders.resolve_recorded(card.get("model_name"), store, f"{store.url}: index card of model={card['slug']}")
    encoder = encoders.load(spec, device)
    tuning = tune_batch_size(encoder, min_seconds=min_seconds)
    best = tuning.measured[tuning.batch_size]
    hours = projected_hours(corpus_size, best)
    on_gpu = encoder.device.startswith("cuda")
    image_ms = _latency_ms(lambda: encoder.encode_images(np.zeros((1, *encoder.input_shape), np.float32)))
    text_ms = _latency_ms(lambda: encoder.encode_texts(["a red leather handbag"])) if "text" in spec.modalities \
        else None
    d = spec.dim
    per_vector = storage_per_vector(d)
    choice = choose_index(corpus_size, d, node_memory, disk=node_disk)
    models = list_models(store)
    dual = sum(4 * int(m["dim"]) for m in models) * corpus_size if len(models) > 1 else None
    return {
        "model_id": spec.model_id,
        "device": encoder.device,
        "corpus_size": corpus_size,
        "encode_images_per_second": {str(b): r for b, r in sorted(tuning.measured.items())},
        "best_batch": tuning.batch_size,
        "projected_encode_hours": hours,
        "reencode_cost": {"hours": hours, "device": "GPU" if on_gpu else "CPU",
                          "price": round(hours * gpu_hour_price, 2) if gpu_hour_price and on_gpu else None,
                          "gpu_hour_price": gpu_hour_price},
        "query_encode_ms": {"image": image_ms, "text": text_ms},
        "storage_bytes_per_vector": per_vector,
        "storage_bytes": {k: int(v * corpus_size) for k, v in per_vector.items()},
        "index": {"factory": choice.factory, "estimated_bytes": choice.estimated_bytes, "node_memory": node_memory,
                  "disk_bytes": choice.disk_bytes, "node_disk": node_disk, "refine": choice.refine,
                  "fits": choice.estimated_bytes <= parse_memory(node_memory), "reason": choice.reason},
        "dual_window_fp32_bytes": dual,
        "models_in_store": [m["slug"] for m in models],
        "measured_on": tuning.device_key,
        "model_change": model_change(rehearsal, corpus_size, hours) if rehearsal is not None else None,
        "kept_pixels": kept_pixels_cost(store, serving["slug"], encoder, best,
                                        sorted({corpus_size, 4_000_000, 100_000_000}))
        if "image" in spec.modalities else None,
    }

"""Label-free training data: each catalogue item is its own label, its positives views of its image made by
augmentations that cover what differs between two photographs (or two drawings) of one product.

Each augmentation is applied with probability 1/2 (the crop always), in the order of AUGMENTATIONS, to the
image shrunk to at most WORK_SIDE pixels (the encoder resizes to its input anyway). Seeded per (item, view).

Views are encoded on the runtime and precision the catalogue's shards record (an item and its views made alike, as
search encodes its queries), behind the same parity check as ingest. Encoding the views is most of a label-free
training run (decode, augment and the base model, per view), so the encoded views are kept in a local cache
(VIEW_CACHE, plain .npz read without pickle), keyed by everything that makes them: the base model id (weights hash
included), the runtime and precision, views, seed, augmentations, this module's source, and each item's row, id and
content hash. A second head trained on the same catalogue (another loss, keep weight,
learning rate) reuses them; a changed item, model or augmentation makes a new key.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from imgest.names import AUGMENTATIONS
from imgest.progress import report
from imgest.tasks.heads.train import HeadError

WORK_SIDE = 448
VIEW_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "imgest", "views")


def _crop(im, rng):
    w, h = im.size
    scale = rng.uniform(0.55, 0.9)
    cw, ch = int(w * scale), int(h * scale)
    left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    return im.crop((left, top, left + cw, top + ch))


def _colour(im, rng):
    return ImageEnhance.Color(ImageEnhance.Brightness(im).enhance(rng.uniform(0.7, 1.3))).enhance(rng.uniform(0.3, 1.7))


def _contrast(im, rng):
    return ImageEnhance.Contrast(im).enhance(rng.uniform(0.5, 1.6))


def _blur(im, rng):
    return im.filter(ImageFilter.GaussianBlur(rng.uniform(0.5, 2.5) * max(im.size) / 256))


def _jpeg(im, rng):
    buffer = io.BytesIO()
    im.save(buffer, "JPEG", quality=int(rng.integers(10, 50)))
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def _quantise(im, rng):
    return im.quantize(colors=int(rng.integers(4, 25)), method=Image.Quantize.MEDIANCUT).convert("RGB")


def _background(im, rng):
    """Near-white pixels (a product shot's backdrop) replaced by a random colour or a two-colour gradient."""
    a = np.asarray(im, np.float32)
    mask = (a.min(axis=2) > 225)[..., None]
    top, bottom = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    ramp = np.linspace(0, 1, a.shape[0], dtype=np.float32)[:, None, None] if rng.random() < 0.5 else 0.0
    backdrop = top + (bottom - top) * ramp
    return Image.fromarray(np.where(mask, backdrop, a).astype(np.uint8))


def _rotate(im, rng):
    return im.rotate(rng.uniform(-12, 12), resample=Image.Resampling.BILINEAR, fillcolor=(255, 255, 255))


def _perspective(im, rng):
    w, h = im.size
    jitter = rng.uniform(-0.08, 0.08, 8) * np.array([w, h] * 4)
    corners = np.array([0, 0, w, 0, w, h, 0, h], float) + jitter
    return im.transform((w, h), Image.Transform.QUAD, corners.tolist(), Image.Resampling.BILINEAR,
                        fillcolor=(255, 255, 255))


def _edges(im, rng):
    """Line weight: dark strokes thickened (a min filter) or thinned (a max filter)."""
    size = 3 if max(im.size) < 600 else 5
    return im.filter(ImageFilter.MinFilter(size) if rng.random() < 0.5 else ImageFilter.MaxFilter(size))


_TRANSFORMS = {
    "crop": _crop, "flip": lambda im, rng: ImageOps.mirror(im), "rotate": _rotate, "perspective": _perspective,
    "colour": _colour, "contrast": _contrast, "background": _background, "quantise": _quantise,
    "edges": _edges, "blur": _blur, "jpeg": _jpeg,
}
DESCRIPTION = ("crop 55-90% (always), each other with p=0.5: mirror, rotation +-12 deg, perspective (corners +-8%), "
               "brightness 0.7-1.3 and colour 0.3-1.7, contrast 0.5-1.6, near-white background replaced by a colour "
               "or gradient, colour quantisation to 4-24 colours, line weight (min or max filter), Gaussian blur, "
               "JPEG quality 10-49")


def augment(image, rng, names: tuple[str, ...] = tuple(AUGMENTATIONS)):
    image = image.convert("RGB")
    image.thumbnail((WORK_SIDE, WORK_SIDE))
    for name in AUGMENTATIONS:
        if name in names and (name == "crop" or rng.random() < 0.5):
            image = _TRANSFORMS[name](image, rng)
    return image


def view_rng(seed: int, index: int, view: int):
    return np.random.default_rng([seed, index, view])


def views_key(live, rows: list[int], model_id: str, views: int, seed: int, names: tuple[str, ...],
              encoding: tuple[str, str] | None = None) -> str:
    h = hashlib.sha256(json.dumps({"model": model_id, "views": views, "seed": seed, "augmentations": list(names),
                                   "work_side": WORK_SIDE, "encoding": list(encoding or ())}).encode())
    with open(__file__, "rb") as fh:
        h.update(fh.read())
    for row in rows:
        h.update(f"{row}\0{live.item_ids[row]}\0{live.content_hashes[row]}\n".encode())
    return h.hexdigest()


def _npy_shape(archive: zipfile.ZipFile, name: str) -> tuple[tuple[int, ...], np.dtype]:
    with archive.open(name) as fh:
        major, _ = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(fh)
    return shape, dtype


def _read_cached(path: str, rows: int, views: int, dim: int) -> tuple[list[int], np.ndarray] | None:
    """The cached views, or None when absent, damaged, truncated or not the shape these rows make: the shapes
    are read from the arrays' headers first, so a damaged file never makes numpy allocate what it claims."""
    try:
        with zipfile.ZipFile(path) as archive:
            (used,), used_type = _npy_shape(archive, "used.npy")
            shape, views_type = _npy_shape(archive, "views.npy")
        if used > rows or shape != (used * views, dim) or used_type != np.int64 or views_type != np.float32:
            return None
        with np.load(path, allow_pickle=False) as saved:
            return saved["used"].tolist(), saved["views"]
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        return None  # absent or unreadable: encoded again


def _write_cached(path: str, used: list[int], views: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial.npz"
    try:
        np.savez(partial, used=np.asarray(used, np.int64), views=views)
        os.replace(partial, path)  # a reader sees the whole file or none
    finally:
        if os.path.exists(partial):  # a failed write (disk full) leaves nothing behind
            os.remove(partial)


class ViewProgress:
    """Catalogue images made into views so far, for a person: the command's terminal bar, and the run's progress
    artifact (moved a percent at a time: one call to the Prefect API per batch would be thousands)."""

    def __init__(self, what: str):
        self.what, self.artifact, self.shown = what, None, -1

    def __call__(self, done: int, total: int) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        report(self.what, done, total, "images")
        percent = int(100 * done / max(total, 1))
        if self.artifact is None:
            self.artifact = create_progress_artifact(0.0, key="views-progress",
                                                     description=f"views of {total:,} images")
        if percent > self.shown:
            self.shown = percent
            update_progress_artifact(self.artifact, float(percent),
                                     description=f"{done:,}/{total:,} images made into views")


def catalogue_encoder(spec, device: str, made: tuple[str, str] | None, log=lambda line: None):
    """The base model on the runtime and precision that encoded the catalogue's rows (`made`: what most of the rows
    read were encoded with, as their shards record it), behind ingest's parity check, so that a view is encoded as
    its original was; the plain encoder, with one warning, where that cannot run here (another device, a runtime
    not installed, a parity refusal) or where the shards do not say."""
    import logging

    from imgest import encoders

    if made is not None:
        try:
            return encoders.load(spec, device, *made)
        except encoders.EncoderError as exc:
            line = (f"views of {spec.name}: the catalogue was encoded with {' '.join(made)}, which cannot run here "
                    f"({exc}): encoding them with the plain encoder")
            logging.getLogger("imgest").warning(line)
            log(line)
    return encoders.load(spec, device)


def recorded_encoding(encoded_by: dict[str, int] | None) -> tuple[str, str] | None:
    """The (runtime, precision) that encoded most of the rows counted in `encoded_by` ("runtime precision" -> rows,
    as `shard_encoder` names them), when it is one a run could load; None when the shards do not say."""
    from imgest.retrieval.query import catalogue_encoding

    return catalogue_encoding({"encoded_by": dict(encoded_by or {})})


def augmented_instances(live, base_name: str, views: int, seed: int, max_items: int = 0, device: str = "auto",
                        names: tuple[str, ...] = tuple(AUGMENTATIONS), log=lambda line: None,
                        cache_dir: str | None = VIEW_CACHE,
                        progress=lambda done, total: None) -> tuple[np.ndarray, list[str], list[str], list[int]]:
    """Each live item becomes a label of its own: its stored embedding plus `views` augmented views, each
    image read and decoded once and encoded once by the base model (or read from `cache_dir`, see above) on the
    runtime and precision that encoded the catalogue (`live.encoded_by`: `catalogue_encoder`). `progress(done,
    total)` is told of the images made into views. Returns vectors, ids (`<item>#view<v>` for views), labels (the
    item id) and the live rows used."""
    from imgest import encoders

    if views < 1:
        raise HeadError(f"views must be >= 1 to make instance pairs without labels; got {views}")
    rows = list(range(len(live)))
    if max_items and max_items < len(rows):
        rows = sorted(np.random.default_rng(seed).choice(len(rows), size=max_items, replace=False).tolist())
    spec = encoders.resolve(base_name)
    made = recorded_encoding(getattr(live, "encoded_by", None))
    path = cached = None
    if cache_dir:
        path = os.path.join(cache_dir, f"{views_key(live, rows, spec.model_id, views, seed, names, made)}.npz")
        cached = _read_cached(path, len(rows), views, int(live.vectors.shape[1]))
    if cached is not None:
        used, encoded = cached
        ran = " ".join(made) if made else "the plain encoder"
        log(f"{len(used)} items x {views} augmented views read from the cache {path}")
        progress(len(rows), len(rows))
    else:
        encoder = catalogue_encoder(spec, device, made, log)
        ran = f"{encoder.runtime} {encoder.precision}"
        used, encoded = _encode_views(live, rows, encoder, views, seed, names, log, progress)
        if path and made not in (None, (encoder.runtime, encoder.precision)):
            path = None  # made on a fallback: the cache keeps only views made as the catalogue was
        if path:
            try:
                _write_cached(path, used, encoded)
            except OSError as exc:  # a cache that cannot be written costs the next run time, not this one
                log(f"views not cached ({exc}): the next head encodes them again")
    if len(used) < 2:
        raise HeadError(f"{len(used)} catalogue image(s) could be read: instance pairs need at least 2")
    originals = [live.item_ids[r] for r in used]
    ids = [f"{item}#view{v}" for item in originals for v in range(views)]
    labels = [item for item in originals for _ in range(views)]
    vectors = np.vstack([live.vectors[used], encoded]).astype(np.float32)
    log(f"{len(used)} items x {views} augmented views ({', '.join(names)}) by {base_name} on {ran}")
    return vectors, originals + ids, originals + labels, used


def _encode_views(live, rows: list[int], encoder, views: int, seed: int, names: tuple[str, ...],
                  log, progress=lambda done, total: None) -> tuple[list[int], np.ndarray]:
    from imgest.images.decode import DecodeError, decode_image
    from imgest.storage import StorageError

    batch, chunks, used = [], [], []
    progress(0, len(rows))
    for n, row in enumerate(rows):
        try:
            # decoded at reduced scale (libjpeg's DCT scaling) and shrunk once; each view starts from it
            image = decode_image(live.read_image(row), min_side=WORK_SIDE // 2)
            image.thumbnail((WORK_SIDE, WORK_SIDE))
        except (DecodeError, OSError, StorageError) as exc:  # one image's fault (a row outside the catalogue too)
            log(f"skipping {live.item_ids[row]}: {exc}")
            continue
        used.append(row)
        batch.extend(encoder.preprocess(augment(image, view_rng(seed, row, v), names)) for v in range(views))
        if len(batch) >= 64 or n == len(rows) - 1:
            chunks.append(encoder.encode_images(np.stack(batch)))
            batch = []
            progress(n + 1, len(rows))
    if batch:
        chunks.append(encoder.encode_images(np.stack(batch)))
    progress(len(rows), len(rows))
    dim = int(live.vectors.shape[1])
    return used, (np.vstack(chunks).astype(np.float32) if chunks else np.empty((0, dim), np.float32))

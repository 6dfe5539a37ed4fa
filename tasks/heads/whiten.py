"""Learned whitening of a model's embeddings, fitted without labels: an affine map applied to catalogue and query
vectors alike, then L2-normalised, that weights the directions telling items apart above those that vary
between two pictures of one item.

Two ways, both without labels:
- "pairs" (the default; Radenovic, Tolias and Chum 2018's learned whitening, with its matching pairs made by
  imgest's augmentations instead of labels): whiten by the covariance of the differences between each sampled
  item's stored vector and its augmented views' vectors (what a re-shoot changes), then rotate onto the
  principal directions of the whitened catalogue vectors, optionally cutting to the first `dim`.
- "pca" (Jegou and Chum 2012): whiten by the catalogue vectors' own covariance. It reads no image, but it
  learns only what varies across the catalogue: a query shift the catalogue never shows (a photo on a
  background against packshots on white) lands in the directions of least catalogue variance, which it
  amplifies most (measured in BENCHMARKS.md, where it loses on such a set).

Either way the covariance is shrunk towards its mean eigenvalue first, (1 - a) C + a mu I, or every
direction of tiny variance, mostly noise, is blown up as much as the informative ones. `a` is given, or
"auto": the Ledoit-Wolf intensity (scikit-learn), which needs nothing but the vectors.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from imgest.encoders.head import ARCHITECTURES, write_head
from imgest.names import AUGMENTATIONS, DEFAULT_VIEWS, VERSION
from imgest.state.clock import now_iso
from imgest.state.live import sample_rows
from imgest.tasks.heads.train import HeadError
from imgest.tasks.heads.views import ViewProgress, augmented_instances


class WhiteningError(HeadError):
    """Whitening cannot be fitted on these vectors as asked; the message says why in one line."""


@dataclass
class Whitening:
    mean: np.ndarray  # (d,) float32: what is subtracted first
    projection: np.ndarray  # (dim, d) float32: whitened principal directions, the largest variance first
    shrinkage: float  # a of (1 - a) S + a mu I
    shrinkage_source: str  # "ledoit-wolf" or "given"
    explained_variance: float  # of the (pair-whitened, for "pairs") vectors' variance, the share kept
    sample: int  # vectors it was fitted on
    method: str = "pca"  # "pca" or "pairs"
    pairs: int = 0  # (item, augmented view) pairs it was fitted on

    @property
    def dim(self) -> int:
        return int(self.projection.shape[0])

    def apply(self, vectors: np.ndarray) -> np.ndarray:
        """Vectors -> whitened, L2-normalised float32 vectors of `dim` dimensions."""
        out = (np.asarray(vectors, np.float32) - self.mean) @ self.projection.T
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)

    def describe(self) -> dict:
        return {"dim_in": int(self.projection.shape[1]), "dim_out": self.dim, "shrinkage": round(self.shrinkage, 6),
                "shrinkage_source": self.shrinkage_source, "explained_variance": round(self.explained_variance, 6),
                "sample": self.sample, "method": self.method, "pairs": self.pairs}


def _check_shape(x: np.ndarray, dim: int, variance: float) -> tuple[int, int]:
    if x.ndim != 2:
        raise WhiteningError(f"whitening takes a matrix of vectors, got shape {x.shape}")
    n, d = x.shape
    if n <= d:
        raise WhiteningError(f"whitening {d}-dimensional vectors needs more than {d} items to fit on; got {n}")
    if not 0 <= dim <= d:
        raise WhiteningError(f"--dim {dim} is above the base model's {d} dimensions (0 keeps all {d})")
    if not 0.0 < variance <= 1.0:
        raise WhiteningError(f"variance {variance}: a share of the variance above 0 and at most 1")
    return n, d


def _shrinkage(shrinkage: float | str, ledoit_wolf) -> tuple[float, str]:
    if shrinkage == "auto":
        return float(ledoit_wolf()), "ledoit-wolf"
    alpha = float(shrinkage)
    if not 0.0 <= alpha <= 1.0:
        raise WhiteningError(f"shrinkage {shrinkage!r}: auto, or a number from 0 to 1")
    return alpha, "given"


def fit_whitening(vectors: np.ndarray, dim: int = 0, shrinkage: float | str = "auto",
                  variance: float = 1.0) -> Whitening:
    """Fit on `vectors` (n, d), n > d. Kept: `dim` directions if given, else the fewest that hold `variance` of
    the vectors' variance (1: all d). Eigenvalues shrunk by `shrinkage` ("auto": the Ledoit-Wolf intensity of
    these vectors; a float in [0, 1])."""
    from sklearn.covariance import empirical_covariance, ledoit_wolf_shrinkage

    x = np.asarray(vectors, np.float64)
    n, d = _check_shape(x, dim, variance)
    alpha, source = _shrinkage(shrinkage, lambda: ledoit_wolf_shrinkage(x))
    empirical = empirical_covariance(x)
    spread, vecs = np.linalg.eigh(empirical)
    order = np.argsort(spread)[::-1]
    spread, vecs = np.clip(spread[order], 0.0, None), vecs[:, order]
    share = np.cumsum(spread) / spread.sum()
    kept = dim or (d if variance >= 1.0 else int(np.searchsorted(share, variance - 1e-12) + 1))
    # (1 - a) S + a mu I has S's eigenvectors and eigenvalues moved towards their mean mu
    values = (1 - alpha) * spread[:kept] + alpha * spread.mean()
    if values[-1] <= 0:
        raise WhiteningError(f"the vectors span fewer than {kept} dimensions with no shrinkage to fill "
                             "the rest: give a shrinkage above 0, or a smaller --dim")
    return Whitening(x.mean(0).astype(np.float32), (vecs[:, :kept] / np.sqrt(values)).T.astype(np.float32), alpha,
                     source, float(share[kept - 1]), n)


def _shrunk_inverse_root(covariance: np.ndarray, alpha: float) -> np.ndarray:
    """((1 - a) C + a mu I)^(-1/2), symmetric."""
    values, vectors = np.linalg.eigh(covariance)
    values = (1 - alpha) * np.clip(values, 0.0, None) + alpha * float(np.trace(covariance)) / len(covariance)
    if values.min() <= 0:
        raise WhiteningError(f"the pairs' differences span fewer than {len(values)} dimensions with no shrinkage "
                             "to fill the rest: give a shrinkage above 0, or more pairs")
    return (vectors / np.sqrt(values)) @ vectors.T


def fit_pair_whitening(vectors: np.ndarray, originals: np.ndarray, views: np.ndarray, dim: int = 0,
                       shrinkage: float | str = 0.5, variance: float = 1.0) -> Whitening:
    """Fit on catalogue `vectors` (n, d), n > d, and matching pairs: row i of `originals` and row i of `views`
    are two pictures of one item. Whitened by the pairs' difference covariance, shrunk by `shrinkage`
    ("auto": its Ledoit-Wolf intensity), then rotated onto the whitened catalogue's principal directions;
    kept: `dim` of them if given, else the fewest holding `variance` of that variance (1: all d)."""
    from sklearn.covariance import ledoit_wolf_shrinkage

    x = np.asarray(vectors, np.float64)
    n, d = _check_shape(x, dim, variance)
    differences = np.asarray(views, np.float64) - np.asarray(originals, np.float64)
    if differences.ndim != 2 or differences.shape[1] != d or len(differences) < 2:
        raise WhiteningError(f"pair whitening needs at least 2 pairs of {d}-dimensional vectors; got "
                             f"{differences.shape}")
    alpha, source = _shrinkage(shrinkage, lambda: ledoit_wolf_shrinkage(differences, assume_centered=True))
    inverse_root = _shrunk_inverse_root(differences.T @ differences / len(differences), alpha)
    mean = x.mean(0)
    whitened = (x - mean) @ inverse_root
    spread, rotation = np.linalg.eigh(whitened.T @ whitened / n)
    order = np.argsort(spread)[::-1]
    spread, rotation = np.clip(spread[order], 0.0, None), rotation[:, order]
    share = np.cumsum(spread) / spread.sum()
    kept = dim or (d if variance >= 1.0 else int(np.searchsorted(share, variance - 1e-12) + 1))
    return Whitening(mean.astype(np.float32), (inverse_root @ rotation[:, :kept]).T.astype(np.float32), alpha, source,
                     float(share[kept - 1]), n, "pairs", len(differences))


def whitening_weights(fitted: Whitening) -> bytes:
    """The mean and projection as safetensors (read back by imgest.encoders.head, checked; never a pickle)."""
    import torch
    from safetensors.torch import save

    return save({"mean": torch.from_numpy(np.ascontiguousarray(fitted.mean)),
                 "projection": torch.from_numpy(np.ascontiguousarray(fitted.projection))})


PROXY_SHARE = 0.2  # of the pair items, held out of the fit: their views measure the proxy
PROXY_CATALOGUE = 10_000  # live vectors the held-out views are searched among, at most


@task(name="whiten", cache_policy=NO_CACHE)
def whiten_task(store, base: dict, live, cfg, views: int, names: tuple[str, ...], device: str = "auto") -> dict:
    return whiten_head(store, base, live, cfg, views, names, device, get_run_logger().info,
                       ViewProgress(f"{base['name']} pair views"))


def whiten_head(store, base: dict, live, cfg, views: int = DEFAULT_VIEWS, names: tuple[str, ...] = tuple(AUGMENTATIONS),
                device: str = "auto", log=lambda line: None, progress=lambda done, total: None) -> dict:
    """Fit a whitening of `base`'s live vectors (`cfg`: a HeadConfig with head_type whiten; `cfg.pair_images` > 0:
    from pairs of catalogue images and their `views` augmented views) and save it as a model of its own,
    `head:<folder>`, whose record says what it is."""
    if base.get("base") is not None:
        raise WhiteningError(f"{base['name']} is itself a head: whiten a model's own embeddings (its base's)")
    rows = sample_rows(len(live.item_ids), cfg.sample, cfg.seed)  # `live` may already be that sample
    shrinkage = cfg.shrinkage if cfg.shrinkage == "auto" else float(cfg.shrinkage)
    catalogue = np.asarray(live.vectors[rows])
    _check_shape(catalogue, cfg.dim_out, 1.0)  # refused before any image is read
    proxy = None
    if cfg.pair_images:
        fitted, proxy = _fit_on_pairs(live, base, catalogue, rows, cfg, shrinkage, views, names, device, log,
                                      progress)
    else:
        fitted = fit_whitening(catalogue, cfg.dim_out, shrinkage)
    weights = whitening_weights(fitted)
    record = {"base_model": base["name"], "base_model_id": base["model_id"], "base_slug": base["slug"],
              "head_type": "whiten", "architecture": ARCHITECTURES["whiten"], "hidden": 0, **fitted.describe(),
              "live_items": live.total or len(live.item_ids), "seed": cfg.seed,
              **({"pair_images": proxy.pop("fitted_images"), "views": views, "augmentations": list(names),
                  "proxy": proxy} if cfg.pair_images else {}),
              "weights_sha256": hashlib.sha256(weights).hexdigest(), "created": now_iso(), "imgest_version": VERSION}
    return {**write_head(store, weights, record, [], {}, None), "config": record}


def _fit_on_pairs(live, base, catalogue, rows, cfg, shrinkage, views, names, device, log,
                  progress) -> tuple[Whitening, dict]:
    """Pairs from `cfg.pair_images` sampled catalogue images; a share of them held out to measure the proxy: how often
    an augmented view finds its own item first, before and after (a proxy of a real shift, never a gain)."""
    vectors, _, _, used = augmented_instances(live, base["name"], views, cfg.seed, cfg.pair_images, device,
                                              names=names, log=log, progress=progress)
    originals = np.repeat(vectors[:len(used)], views, axis=0)  # the views are item-major
    shots, items = vectors[len(used):], np.repeat(np.asarray(used), views)
    held = np.random.default_rng(cfg.seed).random(len(used)) < PROXY_SHARE
    held = np.repeat(held, views) if 2 <= held.sum() < len(used) - 1 else np.zeros(len(items), bool)
    fitted = fit_pair_whitening(catalogue, originals[~held], shots[~held], cfg.dim_out, shrinkage)
    fitted_images = int(len(used) - held.sum() // views)
    if not held.any():
        return fitted, {"fitted_images": fitted_images, "held_out_items": 0}
    searched = np.union1d(rows[:PROXY_CATALOGUE], items[held])
    base_hit = _top1(shots[held], live.vectors[searched], searched) == items[held]
    whitened = fitted.apply(live.vectors[searched])
    whitened_hit = _top1(fitted.apply(shots[held]), whitened, searched) == items[held]
    return fitted, {"fitted_images": fitted_images,
                    "what": "recall@1 of held-out catalogue images' augmented views among live vectors (a proxy)",
                    "held_out_items": int(held.sum() // views), "searched": len(searched),
                    "base": round(float(base_hit.mean()), 4), "whitened": round(float(whitened_hit.mean()), 4)}


def _top1(queries: np.ndarray, catalogue: np.ndarray, ids: np.ndarray) -> np.ndarray:
    catalogue = np.asarray(catalogue, np.float32)
    return np.concatenate([ids[np.argmax(np.asarray(queries[i:i + 256], np.float32) @ catalogue.T, axis=1)]
                           for i in range(0, len(queries), 256)])

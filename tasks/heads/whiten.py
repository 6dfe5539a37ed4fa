"""Learned whitening of a model's embeddings, fitted without labels (Jegou and Chum 2012; Radenovic, Tolias and
Chum 2018): the catalogue's own vectors centred, rotated onto their principal directions and scaled to unit
variance, optionally cut to the first `dim` directions, then L2-normalised.

Plain whitening divides by every eigenvalue, so the directions of least variance (mostly noise) are blown up
as much as the informative ones, and retrieval gets worse. The eigenvalues are therefore shrunk towards
their mean first: the covariance becomes (1 - a) S + a mu I, with `a` given, or chosen by the Ledoit-Wolf
formula (scikit-learn), which needs nothing but the vectors. The same transform applies to catalogue and
query vectors alike: it is an affine map followed by normalisation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from imgest.encoders.head import ARCHITECTURES, write_head
from imgest.names import VERSION
from imgest.tasks.heads.train import HeadError
from imgest.tasks.state.committed import now_iso


class WhiteningError(HeadError):
    """Whitening cannot be fitted on these vectors as asked; the message says why in one line."""


@dataclass
class Whitening:
    mean: np.ndarray  # (d,) float32: what is subtracted first
    projection: np.ndarray  # (dim, d) float32: whitened principal directions, the largest variance first
    shrinkage: float  # a of (1 - a) S + a mu I
    shrinkage_source: str  # "ledoit-wolf" or "given"
    explained_variance: float  # of the vectors' variance, the share along the kept directions
    sample: int  # vectors it was fitted on

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
                "sample": self.sample}


def fit_whitening(vectors: np.ndarray, dim: int = 0, shrinkage: float | str = "auto") -> Whitening:
    """Fit on `vectors` (n, d), n > d: `dim` directions kept (0: all d), eigenvalues shrunk by `shrinkage`
    ("auto": the Ledoit-Wolf intensity of these vectors; a float in [0, 1])."""
    from sklearn.covariance import empirical_covariance, ledoit_wolf_shrinkage, shrunk_covariance

    x = np.asarray(vectors, np.float64)
    if x.ndim != 2:
        raise WhiteningError(f"whitening takes a matrix of vectors, got shape {x.shape}")
    n, d = x.shape
    if n <= d:
        raise WhiteningError(f"whitening {d}-dimensional vectors needs more than {d} items to fit on; got {n}")
    if not 0 <= dim <= d:
        raise WhiteningError(f"--dim {dim} is above the base model's {d} dimensions (0 keeps all {d})")
    if shrinkage == "auto":
        alpha, source = float(ledoit_wolf_shrinkage(x)), "ledoit-wolf"
    else:
        alpha, source = float(shrinkage), "given"
        if not 0.0 <= alpha <= 1.0:
            raise WhiteningError(f"shrinkage {shrinkage!r}: auto, or a number from 0 to 1")
    empirical = empirical_covariance(x)
    values, vecs = np.linalg.eigh(shrunk_covariance(empirical, alpha))  # shrinking keeps the eigenvectors
    order = np.argsort(values)[::-1][:dim or d]
    values, vecs = values[order], vecs[:, order]
    if values[-1] <= 0:
        raise WhiteningError(f"the vectors span fewer than {len(values)} dimensions with no shrinkage to fill "
                             "the rest: give a shrinkage above 0, or a smaller --dim")
    kept = float(np.einsum("ij,ik,kj->", vecs, empirical, vecs))  # variance along the kept directions
    return Whitening(x.mean(0).astype(np.float32), (vecs / np.sqrt(values)).T.astype(np.float32), alpha, source,
                     kept / float(np.trace(empirical)), n)


def sample_rows(n: int, limit: int, seed: int) -> np.ndarray:
    """A seeded sample of at most `limit` of `n` rows, in order: memory bounded whatever the catalogue's size."""
    if n <= limit:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=limit, replace=False))


def whitening_weights(fitted: Whitening) -> bytes:
    """The mean and projection as safetensors (read back by imgest.encoders.head, checked; never a pickle)."""
    import torch
    from safetensors.torch import save

    return save({"mean": torch.from_numpy(np.ascontiguousarray(fitted.mean)),
                 "projection": torch.from_numpy(np.ascontiguousarray(fitted.projection))})


@task(name="whiten", cache_policy=NO_CACHE)
def whiten_task(store, base: dict, live, cfg) -> dict:
    return whiten_head(store, base, live, cfg)


def whiten_head(store, base: dict, live, cfg) -> dict:
    """Fit a whitening of `base`'s live vectors (`cfg`: a HeadConfig with head_type whiten) and save it as a
    model of its own, `head:<folder>`, whose record says what it is."""
    if base.get("base") is not None:
        raise WhiteningError(f"{base['name']} is itself a head: whiten a model's own embeddings (its base's)")
    rows = sample_rows(len(live.item_ids), cfg.sample, cfg.seed)
    shrinkage = cfg.shrinkage if cfg.shrinkage == "auto" else float(cfg.shrinkage)
    fitted = fit_whitening(np.asarray(live.vectors[rows]), cfg.dim_out, shrinkage)
    weights = whitening_weights(fitted)
    record = {"base_model": base["name"], "base_model_id": base["model_id"], "base_slug": base["slug"],
              "head_type": "whiten", "architecture": ARCHITECTURES["whiten"], "hidden": 0, **fitted.describe(),
              "live_items": len(live.item_ids), "seed": cfg.seed,
              "weights_sha256": hashlib.sha256(weights).hexdigest(), "created": now_iso(), "imgest_version": VERSION}
    return {**write_head(store, weights, record, [], {}, None), "config": record}

"""Train an embedding head on frozen base embeddings with a metric loss.

Losses, as in the literature:
- triplet with semi-hard mining (Schroff et al., FaceNet, 2015): per anchor, the hardest in-class
  positive and the hardest semi-hard negative (farther than the positive, within the margin); with no
  semi-hard negative in the batch, the hardest negative;
- InfoNCE / NT-Xent with in-batch negatives and a temperature (Chen et al., SimCLR, 2020; with several
  positives per anchor the supervised form of Khosla et al., 2020, averaged over positives);
- ProxyNCA (Movshovitz-Attias et al., 2017): one learned proxy per label, NCA over proxies with the
  anchor's own proxy left out of the denominator.
Batches are P labels x K items (K >= 2) so every anchor has a positive. Validation is recall@1 of
held-out items against every labelled item (the query itself excluded); training stops when it has not
improved for `patience` epochs and the best epoch's weights are kept. Seeded: the same inputs and seed
give the same head, bit for bit, on CPU.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field

import numpy as np

from imgest.config import HeadConfig
from imgest.errors import UserError


class HeadError(UserError, ValueError):
    """Labels, split or parameters cannot train a head; says what is wrong and what is allowed."""


# -- labels ------------------------------------------------------------------------------------------
def read_labels(data: bytes, name: str) -> dict[str, str]:
    """CSV with header `item_id,label`, or JSONL with those keys per line."""
    text = data.decode("utf-8-sig")
    rows: list[dict] = []
    if name.endswith((".jsonl", ".json")):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise HeadError(f"{name} line {n}: not JSON ({exc.msg})") from None
    else:
        reader = csv.DictReader(io.StringIO(text))
        if not reader.fieldnames or not {"item_id", "label"} <= set(reader.fieldnames):
            raise HeadError(f"{name}: a labels CSV needs the header `item_id,label`; got {reader.fieldnames}")
        rows = list(reader)
    labels = {}
    for n, row in enumerate(rows, 1):
        if not row.get("item_id") or row.get("label") in (None, ""):
            raise HeadError(f"{name} row {n}: item_id and label are both required")
        labels[str(row["item_id"])] = str(row["label"])
    return labels


# -- the head and the losses ---------------------------------------------------------------------------
def pairwise_sq(e):
    """Squared euclidean distances of L2-normalised rows: 2 - 2 cos."""
    return (2 - 2 * e @ e.T).clamp_min(0)


def triplet_semihard(e, labels, margin: float = 0.2):
    import torch

    d = pairwise_sq(e)
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(e), dtype=torch.bool, device=e.device)
    pos_mask, neg_mask = same & ~eye, ~same
    has = pos_mask.any(1) & neg_mask.any(1)
    d_ap = torch.where(pos_mask, d, torch.full_like(d, -1)).max(1).values  # hardest positive
    big = torch.full_like(d, float("inf"))
    semihard = neg_mask & (d > d_ap[:, None]) & (d < d_ap[:, None] + margin)
    d_semi = torch.where(semihard, d, big).min(1).values  # hardest semi-hard negative
    d_hard = torch.where(neg_mask, d, big).min(1).values  # fallback: hardest negative
    d_an = torch.where(torch.isfinite(d_semi), d_semi, d_hard)
    losses = torch.relu(d_ap - d_an + margin)
    return losses[has].mean() if has.any() else e.sum() * 0


def infonce(e, labels, temperature: float = 0.1):
    import torch

    logits = e @ e.T / temperature
    eye = torch.eye(len(e), dtype=torch.bool, device=e.device)
    logits = logits.masked_fill(eye, float("-inf"))
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    pos = (labels[:, None] == labels[None, :]) & ~eye
    count = pos.sum(1)
    has = count > 0
    per_anchor = -torch.where(pos, log_prob, torch.zeros_like(log_prob)).sum(1) / count.clamp_min(1)
    return per_anchor[has].mean() if has.any() else e.sum() * 0


def proxynca(e, labels, proxies, scale: float = 3.0):
    import torch

    p = torch.nn.functional.normalize(proxies, dim=1)
    d = scale * (2 - 2 * e @ p.T)  # (B, C) squared distances to every proxy, scaled
    own = torch.nn.functional.one_hot(labels, len(p)).bool()
    positive = d[own]
    negatives = torch.logsumexp((-d).masked_fill(own, float("-inf")), dim=1)
    return (positive + negatives).mean()  # -log(exp(-d_pos) / sum over other proxies of exp(-d))


# -- training ---------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    state_dict: dict
    config: HeadConfig
    dim_in: int
    history: list[dict] = field(default_factory=list)  # epoch, train_loss, val_recall@1
    best_epoch: int = 0
    val_recall_at_1: float = 0.0
    base_val_recall_at_1: float = 0.0
    train_items: int = 0
    val_items: int = 0
    labels: int = 0
    seconds: float = 0.0
    val_item_ids: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("state_dict")
        out["config"] = self.config.model_dump()
        return out


def split(item_ids: list[str], labels: list[str], cfg: HeadConfig) -> tuple[np.ndarray, np.ndarray]:
    """Indices of training and validation items; only labels with >= 2 items can train or validate."""
    rng = np.random.default_rng(cfg.seed)
    by_label: dict[str, list[int]] = {}
    for i, label in enumerate(labels):
        by_label.setdefault(label, []).append(i)
    usable = {lab: idx for lab, idx in sorted(by_label.items()) if len(idx) >= 2}
    if len(usable) < 2:
        raise HeadError(f"{len(usable)} label(s) have 2 or more embedded items: a metric loss needs at least 2")
    train, val = [], []
    if cfg.split == "labels":
        names = list(usable)
        rng.shuffle(names)
        n_val = max(1, round(len(names) * cfg.val_fraction))
        for n, name in enumerate(names):
            (val if n < n_val else train).extend(usable[name])
    else:
        for idx in usable.values():
            idx = list(idx)
            rng.shuffle(idx)
            n_val = int(round(len(idx) * cfg.val_fraction)) if len(idx) >= 4 else 0
            val.extend(idx[:n_val])
            train.extend(idx[n_val:])
    if not val:
        raise HeadError("no validation items: split=items holds out items only of labels with 4 or more; "
                        "for instance labels (2-3 images each) hold out whole labels (--split labels)")
    return np.array(sorted(train)), np.array(sorted(val))


def recall_at_1(queries: np.ndarray, query_rows: np.ndarray, gallery: np.ndarray, labels: np.ndarray) -> float:
    """Nearest gallery item (the query's own row excluded) has the query's label."""
    hits = 0
    for begin in range(0, len(queries), 1024):
        sims = queries[begin:begin + 1024] @ gallery.T
        rows = query_rows[begin:begin + 1024]
        sims[np.arange(len(rows)), rows] = -np.inf
        hits += int((labels[sims.argmax(1)] == labels[rows]).sum())
    return hits / max(len(queries), 1)


def neighbour_labels(vectors: np.ndarray, label_ids: np.ndarray, rows: np.ndarray, h: int) -> dict[int, list[int]]:
    """Each label's `h` nearest labels by the cosine of their mean base vectors: the hard negatives a batch
    draws in with it (an approximate HNSW search past 20,000 labels)."""
    import faiss

    if h == 0:
        return {}
    labs, inverse = np.unique(label_ids[rows], return_inverse=True)
    centroids = np.zeros((len(labs), vectors.shape[1]), np.float32)
    np.add.at(centroids, inverse, vectors[rows])
    centroids /= np.maximum(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-12)
    index = faiss.IndexFlatIP(centroids.shape[1]) if len(labs) <= 20_000 else \
        faiss.index_factory(centroids.shape[1], "HNSW32,Flat", faiss.METRIC_INNER_PRODUCT)
    index.add(centroids)
    _, near = index.search(centroids, min(h + 1, len(labs)))
    return {int(labs[i]): [int(labs[j]) for j in near[i] if j >= 0 and j != i][:h] for i in range(len(labs))}


def pk_batches(train_rows: np.ndarray, label_ids: np.ndarray, cfg: HeadConfig, rng,
               neighbours: dict[int, list[int]] | None = None) -> list[np.ndarray]:
    """One epoch of P-labels x K-items batches covering every training item about once. Labels are drawn in a
    random order; each brings up to `hard_negatives` of its base-space neighbours into the same batch."""
    by_label: dict[int, list[int]] = {}
    for row in train_rows:
        by_label.setdefault(int(label_ids[row]), []).append(int(row))
    pools = {lab: rng.permutation(rows).tolist() for lab, rows in by_label.items() if len(rows) >= 2}
    neighbours = neighbours or {}
    batches: list[np.ndarray] = []
    order: list[int] = []
    while len(pools) >= 2:
        want, chosen = min(cfg.labels_per_batch, len(pools)), []
        while len(chosen) < want:
            if not order:
                order = rng.permutation(sorted(pools)).tolist()
            seed = order.pop()
            if seed not in pools or seed in chosen:
                continue
            chosen.append(seed)
            for near in neighbours.get(seed, [])[:cfg.hard_negatives]:
                if len(chosen) < want and near in pools and near not in chosen:
                    chosen.append(near)
        batch = []
        for lab in chosen:
            pool = pools[lab]
            take, pools[lab] = pool[:cfg.items_per_label], pool[cfg.items_per_label:]
            if len(take) < 2:  # pad a short tail with items already seen this epoch
                take = take + rng.choice(by_label[lab], size=2 - len(take), replace=False).tolist()
            batch.extend(take)
            if len(pools[lab]) < 2:
                del pools[lab]
        batches.append(np.array(batch))
    return batches


def keep_neighbourhood(e, base, temperature: float):
    """KL(base || head) of each row's softmax over the batch's other rows: the head may move an item's
    neighbours only as far as the metric loss gives it reason to."""
    import torch

    eye = torch.eye(len(e), dtype=torch.bool, device=e.device)
    p = torch.softmax((base @ base.T / temperature).masked_fill(eye, -1e9), dim=1)
    log_q = torch.log_softmax((e @ e.T / temperature).masked_fill(eye, -1e9), dim=1)
    return torch.nn.functional.kl_div(log_q, p, reduction="batchmean")


def train_head(vectors: np.ndarray, item_ids: list[str], labels: list[str], cfg: HeadConfig,
               log=lambda line: None, scorer=None) -> TrainResult:
    """Train on `vectors`; keep the best epoch by the held-out split's recall@1, or by `scorer` (a given
    query set: `scorer.score(project) -> {"recall@1", "recall@10", ...}`) when there is one. A residual head
    is scored before training too (epoch 0, the base itself), so it is kept only if an epoch beats the base."""
    import torch

    from imgest.encoders.head import build_module
    from imgest.timing import Stopwatch

    total = Stopwatch()
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    names = sorted(set(labels))
    index = {name: i for i, name in enumerate(names)}
    label_ids = np.array([index[x] for x in labels])
    train_rows, val_rows = split(item_ids, labels, cfg)
    x = torch.from_numpy(np.ascontiguousarray(vectors, np.float32))
    base = torch.nn.functional.normalize(x, dim=1)
    y = torch.from_numpy(label_ids)
    dim_out = cfg.out_dim(vectors.shape[1])
    head = build_module(cfg.head_type, vectors.shape[1], cfg.hidden, dim_out)
    params = [{"params": head.parameters()}]
    proxies = None
    if cfg.loss == "proxynca":
        proxies = torch.nn.Parameter(torch.randn(len(names), dim_out) * 0.1)
        params.append({"params": [proxies], "lr": cfg.lr * 10})  # proxies learn faster (as in the paper)
    optimiser = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    neighbours = neighbour_labels(vectors, label_ids, train_rows, cfg.hard_negatives)

    def project(v: np.ndarray) -> np.ndarray:
        head.eval()
        with torch.inference_mode():
            out = torch.nn.functional.normalize(head(torch.from_numpy(np.ascontiguousarray(v, np.float32))), dim=1)
        head.train()
        return out.numpy()

    def measure(epoch: int, losses: list[float]) -> tuple:
        emb = project(vectors)
        entry = {"epoch": epoch, "train_loss": round(float(np.mean(losses)), 5) if losses else None,
                 "val_recall@1": round(recall_at_1(emb[val_rows], val_rows, emb, label_ids), 5)}
        if scorer is not None:
            got = scorer.score(project)
            entry.update({f"eval_{k}": round(got[k], 5) for k in ("recall@1", "recall@10")})
        result.history.append(entry)
        log(f"epoch {epoch}: loss {entry['train_loss']}, " + ", ".join(f"{k} {v}" for k, v in entry.items()
                                                                      if "recall" in k))
        return (entry["eval_recall@1"], entry["eval_recall@10"]) if scorer is not None else (entry["val_recall@1"],)

    base_recall = recall_at_1(vectors[val_rows], val_rows, vectors, label_ids)
    result = TrainResult(state_dict={}, config=cfg, dim_in=vectors.shape[1], base_val_recall_at_1=base_recall,
                         train_items=len(train_rows), val_items=len(val_rows), labels=len(names),
                         val_item_ids=[item_ids[i] for i in val_rows])
    best, since_best = None, 0
    if cfg.head_type == "residual":  # epoch 0: the identity, i.e. the base model
        best = measure(0, [])
        result.state_dict = {k: v.detach().clone() for k, v in head.state_dict().items()}
    for epoch in range(1, cfg.epochs + 1):
        losses = []
        for batch in pk_batches(train_rows, label_ids, cfg, rng, neighbours):
            e = torch.nn.functional.normalize(head(x[batch]), dim=1)
            if cfg.loss == "triplet":
                loss = triplet_semihard(e, y[batch], cfg.margin)
            elif cfg.loss == "infonce":
                loss = infonce(e, y[batch], cfg.temperature)
            else:
                loss = proxynca(e, y[batch], proxies, cfg.proxy_scale)
            if cfg.keep:
                loss = loss + cfg.keep * keep_neighbourhood(e, base[batch], cfg.keep_temperature)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(float(loss.detach()))
        score = measure(epoch, losses)
        if best is None or score > best:
            best, since_best, result.best_epoch = score, 0, epoch
            result.state_dict = {k: v.detach().clone() for k, v in head.state_dict().items()}
        else:
            since_best += 1
            if since_best >= cfg.patience:
                log(f"no better validation for {cfg.patience} epochs: stopping, keeping epoch {result.best_epoch}")
                break
    if result.best_epoch == 0:
        log("no epoch beat the base model on the validation: the saved head is the identity (the base)")
    result.val_recall_at_1 = result.history[[h["epoch"] for h in result.history].index(result.best_epoch)][
        "val_recall@1"]
    result.base_val_recall_at_1 = round(base_recall, 5)
    result.seconds = total.seconds
    return result


def loss_curves_png(result: TrainResult) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from imgest.plots import _png

    epochs = [h["epoch"] for h in result.history]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    loss = [np.nan if h["train_loss"] is None else h["train_loss"] for h in result.history]
    ax.plot(epochs, loss, "o-", color="tab:blue", label="train loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel(f"{result.config.loss} loss", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(epochs, [h["val_recall@1"] for h in result.history], "s-", color="tab:green", label="held-out recall@1")
    if result.history and "eval_recall@1" in result.history[-1]:
        ax2.plot(epochs, [h["eval_recall@1"] for h in result.history], "^-", color="tab:red",
                 label="eval queries recall@1")
    ax2.axhline(result.base_val_recall_at_1, color="grey", linestyle="--", label="base model")
    ax2.axvline(result.best_epoch, color="tab:green", linestyle=":")
    ax2.set_ylabel("validation recall@1", color="tab:green")
    ax.set_title(f"{result.config.loss} head: best epoch {result.best_epoch}")
    fig.legend(loc="lower right", fontsize=7)
    return _png(fig)

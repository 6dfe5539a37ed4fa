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
held-out items (VALIDATION_QUERIES of them at most) against every labelled item (the query itself excluded);
training stops when it has not improved for `patience` epochs and the best epoch's weights are kept. Seeded: the
same inputs and seed give the same head, bit for bit, on CPU. Labels, the split and the batches' pools are arrays
(Arrow, NumPy), never an object per item: a label file may cover the whole catalogue.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from imgest.config import HeadConfig
from imgest.tasks.heads.labels import HeadError


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


PROJECT_BLOCK = 4_096  # rows through the head at a time when measuring: hidden x 16 KB of activations
CENTROID_BLOCK = 65_536  # training rows summed into their labels' centroids at a time
GALLERY_BLOCK = 32_768  # gallery rows through the head and searched at a time when measuring recall@1 (131,072
# took 60 MB more at the peak of a 1M-item training)
VALIDATION_QUERIES = 10_000  # held-out items queried each epoch, at most (a seeded sample of them): each is an
# exact search over every labelled item, so a catalogue-wide label file would otherwise cost items x items per epoch


def as_strings(values) -> pa.Array:
    """Item ids or labels as one Arrow string array (a list, an Arrow array or chunked array): no object per row."""
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks().cast(pa.string())
    if isinstance(values, pa.Array):
        return values.cast(pa.string())
    return pa.array(values, pa.string())


def label_numbers(labels: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """The distinct labels in sorted order, and each row's number among them."""
    distinct = pc.unique(labels)
    names = distinct.take(pc.sort_indices(distinct))
    return names, pc.index_in(labels, value_set=names).to_numpy(zero_copy_only=False).astype(np.int64)


def _grouped(label_ids: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows grouped by label (in row order within one) and where each label's rows start."""
    return np.argsort(label_ids, kind="stable"), np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def split(label_ids: np.ndarray, cfg: HeadConfig) -> tuple[np.ndarray, np.ndarray]:
    """Rows of training and validation items; only labels with >= 2 items can train or validate. `label_ids`: each
    row's label number (`label_numbers`)."""
    rng = np.random.default_rng(cfg.seed)
    counts = np.bincount(label_ids)
    usable = np.flatnonzero(counts >= 2)
    if len(usable) < 2:
        raise HeadError(f"{len(usable)} label(s) have 2 or more embedded items: a metric loss needs at least 2")
    kept = counts[label_ids] >= 2
    val = np.zeros(len(label_ids), bool)
    if cfg.split == "labels":
        names = usable.copy()
        rng.shuffle(names)
        held = np.zeros(len(counts), bool)
        held[names[:max(1, round(len(names) * cfg.val_fraction))]] = True
        val = kept & held[label_ids]
    else:  # a label's items in a random order, the first round(n x share) held out (of labels of 4 or more)
        grouped, starts = _grouped(label_ids, counts)
        for label in usable.tolist():
            rows = grouped[starts[label]:starts[label] + counts[label]]
            n_val = int(round(len(rows) * cfg.val_fraction)) if len(rows) >= 4 else 0
            val[rows[rng.permutation(len(rows))[:n_val]]] = True
    if not val.any():
        raise HeadError("no validation items: split=items holds out items only of labels with 4 or more; "
                        "for instance labels (2-3 images each) hold out whole labels (--split labels)")
    return np.flatnonzero(kept & ~val), np.flatnonzero(val)


def recall_at_1(vectors: np.ndarray, query_rows: np.ndarray, labels: np.ndarray, transform=None) -> float:
    """Of the rows `query_rows` of `vectors`, the share whose nearest other row (the query's own row excluded) has
    the query's label: an exact inner-product search by faiss over the gallery a block at a time (`transform`, the
    head, applied to each block as it is searched), each block's two nearest merged in a faiss ResultHeap; never
    the gallery transformed whole, nor a queries x gallery matrix."""
    import faiss

    if not len(query_rows):
        return 0.0
    transform = transform or (lambda v: v)
    queries = np.ascontiguousarray(transform(vectors[query_rows]), np.float32)
    k = min(2, len(vectors))
    heap = faiss.ResultHeap(len(queries), k, keep_max=True)
    for begin in range(0, len(vectors), GALLERY_BLOCK):
        block = np.ascontiguousarray(transform(vectors[begin:begin + GALLERY_BLOCK]), np.float32)
        scores, near = faiss.knn(queries, block, min(k, len(block)), metric=faiss.METRIC_INNER_PRODUCT)
        heap.add_result(scores, np.where(near >= 0, near + begin, -1))
    heap.finalize()
    near = heap.I
    first = near[:, 0] if k == 1 else np.where(near[:, 0] == query_rows, near[:, 1], near[:, 0])
    return float(np.sum((first >= 0) & (labels[first] == labels[query_rows])) / len(queries))


def neighbour_labels(vectors: np.ndarray, label_ids: np.ndarray, rows: np.ndarray, h: int) -> np.ndarray:
    """Each label's `h` nearest labels by the cosine of their mean base vectors, as a (labels, h) array padded with
    -1: the hard negatives a batch draws in with it (an approximate HNSW search past 20,000 labels)."""
    import faiss

    labels = int(label_ids.max()) + 1 if len(label_ids) else 0
    out = np.full((labels, h), -1, np.int64)
    if h == 0 or not len(rows):
        return out
    labs, inverse = np.unique(label_ids[rows], return_inverse=True)
    centroids = np.zeros((len(labs), vectors.shape[1]), np.float32)
    for begin in range(0, len(rows), CENTROID_BLOCK):  # a block of rows at a time, never a copy of them all
        at = slice(begin, begin + CENTROID_BLOCK)
        np.add.at(centroids, inverse[at], vectors[rows[at]])
    centroids /= np.maximum(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-12)
    index = faiss.IndexFlatIP(centroids.shape[1]) if len(labs) <= 20_000 else \
        faiss.index_factory(centroids.shape[1], "HNSW32,Flat", faiss.METRIC_INNER_PRODUCT)
    index.add(centroids)
    _, near = index.search(centroids, min(h + 1, len(labs)))
    other = (near >= 0) & (near != np.arange(len(labs))[:, None])  # the label itself left out
    first = np.argsort(~other, axis=1, kind="stable")[:, :h]  # the others, nearest first
    found = np.where(np.take_along_axis(other, first, 1), labs[np.take_along_axis(near, first, 1)], -1)
    out[labs, :found.shape[1]] = found
    return out


def pk_batches(train_rows: np.ndarray, label_ids: np.ndarray, cfg: HeadConfig, rng,
               neighbours: np.ndarray | None = None) -> list[np.ndarray]:
    """One epoch of P-labels x K-items batches covering every training item about once. Labels are drawn in a
    random order; each brings up to `hard_negatives` of its base-space neighbours (`neighbour_labels`) into the
    same batch. The pools are one array of the training rows grouped by label, a random order within each, and a
    cursor per label: no object per item (a loop per label and per batch, none per item)."""
    labs = label_ids[train_rows]
    counts = np.bincount(labs, minlength=int(label_ids.max()) + 1 if len(label_ids) else 0)
    grouped, cursor = _grouped(labs, counts)
    pool = train_rows[grouped]
    _, first = np.unique(labs, return_index=True)
    for label in labs[np.sort(first)].tolist():  # in the order labels first appear, each label's items shuffled
        if counts[label] >= 2:
            at = slice(cursor[label], cursor[label] + counts[label])
            pool[at] = rng.permutation(pool[at])
    left = counts.copy()
    alive = left >= 2
    n_alive, hard = int(alive.sum()), min(cfg.hard_negatives, neighbours.shape[1]) if neighbours is not None else 0
    batches: list[np.ndarray] = []
    order, pointer = np.empty(0, np.int64), 0
    while n_alive >= 2:
        want, chosen = min(cfg.labels_per_batch, n_alive), []
        while len(chosen) < want:
            if pointer == 0:
                order = rng.permutation(np.flatnonzero(alive))
                pointer = len(order)
            pointer -= 1
            seed = int(order[pointer])
            if not alive[seed] or seed in chosen:
                continue
            chosen.append(seed)
            for near in neighbours[seed, :hard].tolist() if hard else ():
                if len(chosen) < want and near >= 0 and alive[near] and near not in chosen:
                    chosen.append(near)
        parts = []
        for lab in chosen:
            take = min(cfg.items_per_label, int(left[lab]))
            parts.append(pool[cursor[lab]:cursor[lab] + take])
            cursor[lab] += take
            left[lab] -= take
            if left[lab] < 2:
                alive[lab] = False
                n_alive -= 1
        batches.append(np.concatenate(parts))
    return batches


def keep_neighbourhood(e, base, temperature: float):
    """KL(base || head) of each row's softmax over the batch's other rows: the head may move an item's
    neighbours only as far as the metric loss gives it reason to."""
    import torch

    eye = torch.eye(len(e), dtype=torch.bool, device=e.device)
    p = torch.softmax((base @ base.T / temperature).masked_fill(eye, -1e9), dim=1)
    log_q = torch.log_softmax((e @ e.T / temperature).masked_fill(eye, -1e9), dim=1)
    return torch.nn.functional.kl_div(log_q, p, reduction="batchmean")


def train_head(vectors: np.ndarray, item_ids, labels, cfg: HeadConfig, log=lambda line: None,
               scorer=None) -> TrainResult:
    """Train on `vectors` (`item_ids` and `labels`: a list or an Arrow array each, a row per vector); keep the best
    epoch by the held-out split's recall@1 (at most VALIDATION_QUERIES of its items queried), or by `scorer` (a given
    query set: `scorer.score(project) -> {"recall@1", "recall@10", ...}`) when there is one. A residual head is
    scored before training too (epoch 0, the base itself), so it is kept only if an epoch beats the base."""
    import torch

    from imgest.encoders.head import build_module
    from imgest.encoders.head import project as project_blocks
    from imgest.timing import Stopwatch

    total = Stopwatch()
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    item_ids = as_strings(item_ids)
    names, label_ids = label_numbers(as_strings(labels))
    train_rows, held_rows = split(label_ids, cfg)
    val_rows = held_rows if len(held_rows) <= VALIDATION_QUERIES else \
        np.sort(np.random.default_rng([cfg.seed, 1]).choice(held_rows, VALIDATION_QUERIES, replace=False))
    x = torch.from_numpy(np.ascontiguousarray(vectors, np.float32))
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
        """Through the head a block of rows at a time: its hidden layer over every labelled item at once would be
        items x hidden floats (4 GB for a million items)."""
        head.eval()
        out = project_blocks(head, v, batch=PROJECT_BLOCK)
        head.train()
        return out

    def measure(epoch: int, losses: list[float]) -> tuple:
        entry = {"epoch": epoch, "train_loss": round(float(np.mean(losses)), 5) if losses else None,
                 "val_recall@1": round(recall_at_1(vectors, val_rows, label_ids, project), 5)}
        if scorer is not None:
            got = scorer.score(project)
            entry.update({f"eval_{k}": round(got[k], 5) for k in ("recall@1", "recall@10")})
        result.history.append(entry)
        log(f"epoch {epoch}: loss {entry['train_loss']}, " + ", ".join(f"{k} {v}" for k, v in entry.items()
                                                                      if "recall" in k))
        return (entry["eval_recall@1"], entry["eval_recall@10"]) if scorer is not None else (entry["val_recall@1"],)

    base_recall = recall_at_1(vectors, val_rows, label_ids)
    result = TrainResult(state_dict={}, config=cfg, dim_in=vectors.shape[1], base_val_recall_at_1=base_recall,
                         train_items=len(train_rows), val_items=len(held_rows), labels=len(names),
                         val_item_ids=item_ids.take(pa.array(val_rows, pa.int64())).to_pylist())
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
                base = torch.nn.functional.normalize(x[batch], dim=1)  # the batch's, never all of x again
                loss = loss + cfg.keep * keep_neighbourhood(e, base, cfg.keep_temperature)
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

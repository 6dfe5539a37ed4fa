"""Kept pixels in a run: the side this run keeps copies at, and which planned items are read from the copies another
model kept (imgest/state/pixels.py) instead of the catalogue, and why.

A model reads copies when its recorded decode side is no more than their side (`kept.fits`) and its embeddings from
copies pass the reduced-precision gate against its embeddings from the originals on the parity sample
(`parity.kept_parity`): measured once per model, source decoder and side, and recorded beside the model's state
(`state/model=<slug>/kept-gate.json`) so later runs and resumes decide alike. A model that fails it reads the
originals, with the figures in the run's summary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from imgest.encoders import EncoderSpec
from imgest.images import decoders, kept
from imgest.state import pixels
from imgest.state.aliases import read_alias
from imgest.state.clock import now_iso
from imgest.state.committed import load_state
from imgest.state.layout import kept_gate_key as gate_key
from imgest.state.models import list_models
from imgest.storage import Location, StorageError
from imgest.storage.records import RecordError
from imgest.tasks.ingest.plan import Plan, attach_kept


@dataclass
class KeptReport:
    """What a run did with kept pixels, for its summary."""

    side: int = 0  # copies kept by this run at this side (0: none)
    source: str | None = None  # the model whose copies were read
    reads: str = "catalogue"  # where the planned images come from: "kept pixels", "catalogue", or both
    why: str = ""
    planned_from_kept: int = 0  # planned items with a usable copy
    gate: dict | None = None
    from_kept: int = 0  # filled at commit: items decoded from copies
    from_catalogue: int = 0
    written: int = 0  # copies this run wrote, and their bytes
    bytes: int = 0
    faults: list[str] = field(default_factory=list)
    copy_decode_seconds: float | None = None  # core-seconds a copy's decode and preprocessing took (a sample)
    decode_seconds: float | None = None  # the run's decode cost per image with the copies: what splits the cores

    def to_dict(self) -> dict:
        return asdict(self)


def source_model(store: Location, slug: str) -> str | None:
    """The model whose copies a run of `slug` reads: the serving model when it keeps pixels, else another model of
    the store that does (the first by name); None when no other model keeps any."""
    keeping = [s for s in pixels.models_keeping(store) if s != slug]
    if not keeping:
        return None
    try:
        serving = read_alias(store, "serving")
    except (RecordError, StorageError, ValueError):
        serving = None
    if serving is not None and serving.get("slug") in keeping:
        return serving["slug"]
    known = {m["slug"] for m in list_models(store)}
    return next((s for s in sorted(keeping) if s in known), None)


def kept_gate(store: Location, slug: str, encoder, reference: decoders.Decode, source_decoder: str, side: int,
              run_id: str) -> dict:
    """The gate's verdict for `slug` reading copies of `side` made by `source_decoder`'s decode, against its own
    decode (`reference`) of the originals: the recorded one, or measured now and recorded."""
    from imgest.encoders import parity

    key = {"source_decoder": source_decoder, "reference": reference.decoder, "side": side, "codec": kept.CODEC,
           "quality": kept.QUALITY, "model_id": encoder.spec.model_id, "decode_side": reference.side}
    try:
        entries = store.read_json(gate_key(slug))
    except (FileNotFoundError, RecordError, StorageError, ValueError):
        entries = []
    entries = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    for entry in entries:
        if all(entry.get(k) == v for k, v in key.items()) and isinstance(entry.get("passed"), bool) \
                and all(isinstance(entry.get(k), float) for k in ("mean_cosine", "p1_cosine", "overlap")):
            return entry
    figures = parity.kept_parity(encoder, reference.decoder, source_decoder, side, need=reference.side or 0)
    entry = {**key, **figures.to_dict(), "run_id": run_id, "measured": now_iso()}
    store.write_json(gate_key(slug), entries[-15:] + [entry])
    return entry


def plan_kept(store: Location, spec: EncoderSpec, encoder, plan: Plan, keep_side: int, run_id: str,
              decode: decoders.Decode) -> tuple[Plan, KeptReport]:
    """Mark the planned items that are read from another model's copies (attach_kept), when this model may read
    them: its recorded decode side fits their side and it passes the gate (`decode`: the run's own JPEG decode; a
    model that decodes whole images reads no copies)."""
    report = KeptReport(side=keep_side)
    source = source_model(store, spec.slug)
    if source is None:
        report.why = "no other model in the store keeps pixels"
        return plan, report
    report.source = source
    shards = pixels.kept_shards(store, source)
    need = decode.side
    usable = [s for s in sorted(set(shards["side"].to_pylist())) if kept.fits(need, s) and s >= keep_side]
    if not usable:
        have = ", ".join(map(str, sorted(set(shards["side"].to_pylist())))) or "none"
        report.why = (f"{spec.name} decodes {f'down to a shorter side of {need}' if need else 'whole images'}"
                      f"{f' and this run keeps {keep_side}' if keep_side else ''}; model={source} keeps {have}")
        return plan, report
    source_decoder = decoders.recorded(store, source).decoder
    gate = kept_gate(store, spec.slug, encoder, decode, source_decoder, usable[0], run_id)
    report.gate = {k: gate[k] for k in ("mean_cosine", "p1_cosine", "overlap", "images", "passed", "side")
                   if k in gate}
    if not gate["passed"]:
        report.why = (f"the gate refused copies of side {usable[0]} for {spec.name}: "
                      + "; ".join(gate.get("shortfalls") or []) + " (the originals are read)")
        return plan, report
    state = load_state(store, source)
    try:
        plan = attach_kept(plan, state, shards, max(need, keep_side))
    finally:
        state.close()
    report.planned_from_kept = plan.kept_count()
    report.reads = "kept pixels" if report.planned_from_kept == plan.to_read else \
        "kept pixels and catalogue" if report.planned_from_kept else "catalogue"
    report.why = (f"copies of model={source} at side >= {max(need, keep_side)} for {report.planned_from_kept:,} of "
                  f"{plan.to_read:,} planned items (gate passed: mean cosine {gate['mean_cosine']:.4f}, "
                  f"p1 {gate['p1_cosine']:.4f}, overlap@10 {gate['overlap']:.3f}); the rest have no current copy")
    return plan, report


COST_SAMPLE = 16  # copies decoded to measure what a decode worker spends on one


def copy_cost(store: Location, source: str, plan: Plan, encoder, max_pixels: int, need: int | None) -> float | None:
    """Core-seconds per image a decode worker spends on a copy (decode and preprocess, this thread's CPU time), on up
    to COST_SAMPLE of the first shard's items planned from copies; None when none reads (the shards meet it)."""
    import time

    from imgest.images.decode import decode_image
    from imgest.tasks.ingest.encode import with_copies

    items = tuple(i for i in (plan.shards[0].items if plan.shards else ()) if i.kept_shard)[:COST_SAMPLE]
    datas = [data for _, data in with_copies(items, store, source, []) if data is not None]
    if not datas:
        return None
    start = time.thread_time()
    for data in datas:
        encoder.preprocess(decode_image(data, min(max_pixels, kept.MAX_COPY_PIXELS), need))
    return (time.thread_time() - start) / len(datas)

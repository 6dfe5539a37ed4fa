"""The run's JPEG decode: the decoder and decode side its model's store records, kept; on the model's first run there,
the model's default (decoders.DEFAULT, down to its preprocessing's side where that side passes its gate), recorded
before the first shard; another decoder only by an explicit choice that passes the gate against the recorded one
(or is forced with a reason), recorded, so a resume decodes alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from imgest.images import decoders
from imgest.images.decoders import FULL, UNRECORDED, DecoderError, Record
from imgest.state.clock import now_iso
from imgest.state.lock import Fence
from imgest.storage import Location


class DecoderGateError(DecoderError):
    """An explicit decoder whose embeddings fall outside the gate against the model's recorded one."""


@dataclass(frozen=True)
class DecoderChoice:
    """What decodes this run's JPEGs, down to which side (FULL: the whole image), and why, for its summary
    (`source`); on a switch, the gate's figures; on a first run of a gated side, the side gate's."""

    decoder: str
    source: str
    gate: dict | None = None
    side: int = FULL
    side_gate: dict | None = None


def model_side(encoder, decoder: str, gated: Callable | None = None) -> tuple[int, dict | None]:
    """The side a new record of `encoder`'s model decodes its JPEGs down to, and the side gate's figures: its
    preprocessing's side (`decode_side`); for an encoder whose reduced decode is not established for its family
    (`gated_decode_side`: a transformers model), only where the reduced decode by `decoder` passes the gate against
    the processor's own path on the whole image (`parity.side_parity`), else FULL. The gate is measured through
    the model in eager torch fp32 on the CPU, whatever the run's runtime and device: the verdict, and so the
    side, is the model's on every host."""
    need = int(getattr(encoder, "decode_side", None) or FULL)
    if not need or not getattr(encoder, "gated_decode_side", False):
        return need, None
    if gated is None:
        from imgest import encoders
        from imgest.encoders import parity

        def gated(encoder, decoder, side):
            return parity.side_parity(encoders.load(encoder.spec, "cpu", "torch", "fp32"), decoder, side)
    figures = gated(encoder, decoder, need)
    return (need if figures.passed else FULL), {**figures.figures(), "images": figures.images,
                                                 "passed": figures.passed}


def choose_decoder(store: Location, slug: str, run_id: str, asked: str | None, force: str | None, first: bool,
                   device: str, side: Callable[[str], tuple[int, dict | None]],
                   gate: Callable[[str, str, int], object], fence: Fence | None = None,
                   legacy: int = FULL) -> DecoderChoice:
    """The decode for this run of `slug`, recorded before it returns wherever the record changes.

    Without `asked`: the record's decoder and side; on the model's `first` run in the store, decoders.DEFAULT down
    to `side(DEFAULT)` (create-exclusive: two first runs at once take the same record); a model that has vectors
    but no record (made before records were kept) records Pillow, which made them, at `legacy` (the side its
    decode had then), and a record from before sides were recorded gets `legacy` written into it.
    With `asked` other than the record's: `gate(recorded, asked, side)` (a DecoderParity) must pass, else the run
    is refused (DecoderGateError) unless `force` gives a reason; the record then names `asked` from this run on,
    at the side it had."""
    record = decoders.check(store, slug, asked, force, device)
    if asked is None or (record is not None and asked == record.decoder):
        if record is not None and record.side == UNRECORDED:
            record = Record(**{**record.to_dict(), "side": legacy})
            decoders.replace_record(store, slug, record, fence)
            return DecoderChoice(record.decoder, f"recorded: {record.describe()} (its side as decoded before sides "
                                                 "were recorded, recorded now)", side=legacy)
        if record is not None:
            return DecoderChoice(record.decoder, f"recorded: {record.describe()}", side=record.side)
        if not first:
            new = Record(decoders.PILLOW, decoders.ASSUMED, run_id, now_iso(), side=legacy)
            return _created(store, slug, new, "recorded now: the model's vectors predate decoder records and were "
                                              "decoded by Pillow")
        decided, figures = side(decoders.DEFAULT)
        new = Record(decoders.DEFAULT, decoders.DEFAULTED, run_id, now_iso(), side=decided, side_gate=figures)
        return _created(store, slug, new, "the model's default, recorded")
    if record is None:  # nothing made yet (or an unreadable record, forced): the explicit choice is the record
        decided, figures = side(asked) if first else (legacy, None)
        new = Record(asked, decoders.FORCED if force else decoders.EXPLICIT, run_id, now_iso(),
                     gate={"forced": force} if force else None, side=decided, side_gate=figures)
        if force:
            decoders.replace_record(store, slug, new, fence)
            return DecoderChoice(asked, f"explicit, forced ({force}), recorded", new.gate, decided, figures)
        return _created(store, slug, new, "explicit, recorded as the model's decoder", asked=asked)
    kept_side = legacy if record.side == UNRECORDED else record.side
    if force:
        figures = {"forced": force}
        how = f"explicit, forced past the gate against {record.decoder} ({force}), recorded"
    else:
        parity = gate(record.decoder, asked, kept_side)
        if not parity.passed:
            raise DecoderGateError(f"--decoder {asked}: {parity.reason()}; the model's vectors were made with "
                                   f"{record.decoder}: keep it, or switch anyway with --force-decoder REASON")
        figures = {**parity.figures(), "images": parity.images}
        how = f"explicit, passed the gate against {record.decoder}, recorded"
    new = Record(asked, decoders.FORCED if force else decoders.EXPLICIT, run_id, now_iso(), previous=record.decoder,
                 gate=figures, side=kept_side, side_gate=record.side_gate)
    decoders.replace_record(store, slug, new, fence)
    return DecoderChoice(asked, how, figures, kept_side)


def _created(store: Location, slug: str, new: Record, source: str, asked: str | None = None) -> DecoderChoice:
    kept = decoders.create_record(store, slug, new)
    if kept is not new and asked is not None and kept.decoder != asked:
        raise DecoderError(f"--decoder {asked}: a run at the same time recorded {kept.describe()} for model={slug}; "
                           "run again to switch (the gate then applies)")
    if kept is not new:  # another run recorded the model's decoder first: this run takes it
        return DecoderChoice(kept.decoder, f"recorded by a run at the same time: {kept.describe()}",
                             side=kept.side if kept.side != UNRECORDED else new.side)
    return DecoderChoice(kept.decoder, source, side=new.side, side_gate=new.side_gate)

"""The run's JPEG decoder: the one its model's store records, kept; timed and recorded before the first shard when the
model first encodes there; another only by an explicit choice that passes the gate against the recorded one (or
is forced with a reason), recorded as the model's decoder before the first shard, so a resume decodes alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from imgest.images import decoders
from imgest.images.decoders import DecoderError, Record
from imgest.lock import Fence
from imgest.state.clock import now_iso
from imgest.storage import Location


class DecoderGateError(DecoderError):
    """An explicit decoder whose embeddings fall outside the gate against the model's recorded one."""


@dataclass(frozen=True)
class DecoderChoice:
    """What decodes this run's JPEGs, and why, for its summary (`source`) and, on a switch, the gate's figures."""

    decoder: str
    source: str
    gate: dict | None = None
    measured: dict[str, float] | None = None  # a first run: each decoder timed, core-seconds per image


def choose_decoder(store: Location, slug: str, run_id: str, asked: str | None, force: str | None, first: bool,
                   device: str, measure: Callable[[Sequence[str]], tuple[str, dict[str, float]]],
                   gate: Callable[[str, str], object], fence: Fence | None = None,
                   inherit: tuple[str, str] | None = None) -> DecoderChoice:
    """The decoder for this run of `slug`, recorded before it returns wherever the record changes.

    Without `asked`: the record's decoder; on the model's `first` run in the store, `measure(names)` times the CPU
    decoders installed and the fastest is recorded (create-exclusive: two first runs at once take the same one);
    a model that has vectors but no record (made before records were kept) records Pillow, which made them.
    With `asked` other than the record's: `gate(recorded, asked)` (a DecoderParity) must pass, else the run is
    refused (DecoderGateError) unless `force` gives a reason; the record then names `asked` from this run on.
    With `inherit` (a decoder and the model whose kept pixels this one will read), a first run records that decoder
    instead of timing them, when it runs here: a copy is that decoder's DCT-scaled pixels, and the originals this
    model still reads then decode alike."""
    record = decoders.check(store, slug, asked, force, device)
    if asked is None or (record is not None and asked == record.decoder):
        if record is not None:
            return DecoderChoice(record.decoder, f"recorded: {record.describe()}")
        if not first:
            new = Record(decoders.PILLOW, decoders.ASSUMED, run_id, now_iso())
            return _created(store, slug, new, "recorded now: the model's vectors predate decoder records and were "
                                              "decoded by Pillow")
        if inherit is not None and decoders.unusable(inherit[0], device) is None:
            new = Record(inherit[0], decoders.INHERITED, run_id, now_iso(), gate={"kept_pixels_of": inherit[1]})
            return _created(store, slug, new, f"the decoder of model={inherit[1]}, whose kept pixels it reads, "
                                              "recorded")
        chosen, measured = measure(decoders.timed())
        new = Record(chosen, decoders.MEASURED, run_id, now_iso(), measured)
        return _created(store, slug, new, "the fastest measured on the model's first run in this store, recorded",
                        measured)
    if record is None:  # nothing made yet (or an unreadable record, forced): the explicit choice is the record
        new = Record(asked, decoders.FORCED if force else decoders.EXPLICIT, run_id, now_iso(),
                     gate={"forced": force} if force else None)
        if force:
            decoders.replace_record(store, slug, new, fence)
            return DecoderChoice(asked, f"explicit, forced ({force}), recorded", new.gate)
        return _created(store, slug, new, "explicit, recorded as the model's decoder", asked=asked)
    if force:
        figures = {"forced": force}
        how = f"explicit, forced past the gate against {record.decoder} ({force}), recorded"
    else:
        parity = gate(record.decoder, asked)
        if not parity.passed:
            raise DecoderGateError(f"--decoder {asked}: {parity.reason()}; the model's vectors were made with "
                                   f"{record.decoder}: keep it, or switch anyway with --force-decoder REASON")
        figures = {**parity.figures(), "images": parity.images}
        how = f"explicit, passed the gate against {record.decoder}, recorded"
    new = Record(asked, decoders.FORCED if force else decoders.EXPLICIT, run_id, now_iso(), previous=record.decoder,
                 gate=figures)
    decoders.replace_record(store, slug, new, fence)
    return DecoderChoice(asked, how, figures)


def _created(store: Location, slug: str, new: Record, source: str, measured: dict[str, float] | None = None,
             asked: str | None = None) -> DecoderChoice:
    kept = decoders.create_record(store, slug, new)
    if kept is not new and asked is not None and kept.decoder != asked:
        raise DecoderError(f"--decoder {asked}: a run at the same time recorded {kept.describe()} for model={slug}; "
                           "run again to switch (the gate then applies)")
    if kept is not new:  # another run recorded the model's decoder first: this run takes it
        return DecoderChoice(kept.decoder, f"recorded by a run at the same time: {kept.describe()}")
    return DecoderChoice(kept.decoder, source, measured=measured)

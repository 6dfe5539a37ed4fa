"""JPEG decoders: each one's scale, pixels and orientation, their cost, the fallbacks; and a model's decode (its
default decoder and side, a transformers model's side behind its gate) recorded in its store and kept: by later runs
and resumes, by its shards, against hostile records, behind the gate (tasks/ingest/decoder.py)."""

import sys
import time

import numpy as np
import pytest

from imgest.images import decoders
from imgest.images.decode import DecodeError, decode_image
from imgest.state import layout
from tests.helpers import gradient, hostile_files, jpeg_bytes

OTHERS = [name for name, decoder in decoders.REGISTRY.items() if decoder is not None and not decoder.gpu]  # the CPU's


@pytest.fixture(autouse=True)
def _fresh_registry():
    decoders.installed.cache_clear()
    yield
    decoders.installed.cache_clear()


def test_every_decoder_is_installed_here():
    """The test extras install all three (PyTurboJPEG with Debian's libturbojpeg0), so every path below runs."""
    assert decoders.installed() == (decoders.PILLOW, "simplejpeg", "turbojpeg")


@pytest.mark.parametrize("name", OTHERS)
def test_libjpeg_turbo_decoders_reach_eighths_where_pillow_halves(name):
    big = jpeg_bytes(gradient(3, (1200, 900)))
    # shorter side 900, 256 needed: 2/8 leaves 225 (< 256), 3/8 leaves ceil(337.5) = 338; Pillow's next is 1/2
    assert decode_image(big, min_side=256, decoder=name).size == (450, 338)
    assert decode_image(big, min_side=256).size == (600, 450)
    # 113 needed: 1/8 leaves 113 (900 / 8 = 112.5 -> 113); a portrait keeps its shorter side, the width
    assert decode_image(big, min_side=113, decoder=name).size == (150, 113)
    tall = jpeg_bytes(gradient(3, (800, 1200)))
    assert decode_image(tall, min_side=256, decoder=name).size == (300, 450)  # 3/8 of 800 = 300
    assert decode_image(big, decoder=name).size == (1200, 900)  # without a side: the whole image


@pytest.mark.slow("real weights")
@pytest.mark.parametrize("name", OTHERS)
def test_decoders_give_pillows_embeddings_on_product_photos(name):
    """Real photos at product size, a fifth sideways by EXIF, a tenth PNG cut-outs (Pillow's own): each decoder's
    reduced decode is upright and gives Lite0 embeddings close to Pillow's full decode, as Pillow's reduced
    decode does (its bound in test_decode.py)."""
    from imgest import encoders
    from imgest.images.demo import product_photos

    encoder = encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")
    files = list(product_photos(20, seed=3, sides=(1000, 1400)).values())
    full, fast = [], []
    for data in files:
        whole, reduced = decode_image(data), decode_image(data, min_side=encoder.decode_side, decoder=name)
        assert abs(whole.width / whole.height - reduced.width / reduced.height) < 0.02  # upright, as Pillow's
        assert min(reduced.size) >= encoder.decode_side
        full.append(encoder.preprocess(whole))
        fast.append(encoder.preprocess(reduced))
    cosines = np.sum(encoder.encode_images(np.stack(full)) * encoder.encode_images(np.stack(fast)), axis=1)
    assert cosines.min() >= 0.97 and cosines.mean() >= 0.995, cosines


@pytest.mark.parametrize("name", OTHERS)
def test_what_a_decoder_cannot_decode_goes_to_pillow(name):
    files = hostile_files()
    assert decode_image(files["cmyk.jpg"], decoder=name).mode == "RGB"  # CMYK: Pillow converts it
    assert decode_image(files["rotated.jpg"], decoder=name).size == (20, 40)  # EXIF rotation kept
    with pytest.raises(DecodeError, match=r"^OSError"):  # a truncated JPEG: Pillow's reason, as without it
        decode_image(files["truncated.jpg"], decoder=name)


def test_a_missing_decoder_is_left_out_never_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # as if the package were not installed
    assert "not installed" in decoders.get("simplejpeg").missing()
    assert "simplejpeg" not in decoders.installed()
    chosen, measured = decoders.fastest([b"x"], lambda data, name: None, names=("simplejpeg",))
    assert (chosen, list(measured)) == (decoders.PILLOW, [decoders.PILLOW])
    big = jpeg_bytes(gradient(3, (1200, 900)))
    assert decode_image(big, min_side=256, decoder="simplejpeg").size == (600, 450)  # Pillow decoded it


def test_an_unknown_decoder_is_refused_naming_the_known():
    with pytest.raises(ValueError, match="unknown JPEG decoder 'libjpeg'; known: pillow, simplejpeg, turbojpeg, "
                                         "nvjpeg"):
        decoders.get("libjpeg")


def test_the_decoders_are_timed_in_cpu_time_for_the_runs_cost_never_to_choose_one():
    def work(data, name):  # Pillow made to cost ~5 ms of CPU an image, the others nothing
        if name == decoders.PILLOW:
            end = time.thread_time() + 0.005
            while time.thread_time() < end:
                pass

    chosen, measured = decoders.fastest([b"a", b"b"], work)
    assert chosen != decoders.PILLOW and measured[decoders.PILLOW] >= 0.005
    assert set(measured) == set(decoders.timed())  # the CPU decoders installed: nvJPEG is never timed
    assert decoders.fastest([], work) == (decoders.PILLOW, {})


def test_the_registry_is_the_configs_vocabulary_and_nvjpeg_is_never_timed():
    from imgest.names import DECODERS

    assert tuple(decoders.REGISTRY) == DECODERS
    assert decoders.NVJPEG not in decoders.timed()
    # no GPU here: nvJPEG says why it cannot run (torchvision missing, or no CUDA device), and off CUDA it never can
    assert decoders.get(decoders.NVJPEG).missing() is not None
    assert "decodes on the GPU" in decoders.unusable(decoders.NVJPEG, "cpu")
    assert decoders.unusable("simplejpeg", "cpu") is None and decoders.unusable(decoders.PILLOW, "cuda:0") is None


# -- a model's decoder, recorded in its store ---------------------------------------------------------------------
SLUG = "m-1234abcd"


def _store(tmp_path):
    from imgest.storage import Location

    return Location(str(tmp_path / "store"))


def _choose(store, asked=None, force=None, first=True, side=None, gate=None, run_id="r00000001-x", legacy=0):
    from imgest.tasks.ingest.decoder import choose_decoder

    def no_gate(recorded, asked, side):
        raise AssertionError("the gate ran")

    def model_side(name):  # the model's preprocessing decodes down to 256 (no gate)
        return 256, None

    return choose_decoder(store, SLUG, run_id, asked, force, first, "cpu", side or model_side, gate or no_gate,
                          legacy=legacy)


def test_a_first_run_records_the_models_default_decode_and_later_runs_keep_it(tmp_path):
    store = _store(tmp_path)
    first = _choose(store)  # the model's first run in the store: its default, recorded before any shard
    record = decoders.read_record(store, SLUG)
    assert (first.decoder, first.side) == (record.decoder, record.side) == (decoders.DEFAULT, 256)
    assert record.how == decoders.DEFAULTED and record.run_id == "r00000001-x" and not record.measured
    for later in (True, False):  # a resume (no snapshot yet: "first" again) and a later run, whatever they'd pick
        kept = _choose(store, first=later, side=lambda name: (0, None))
        assert (kept.decoder, kept.side) == (decoders.DEFAULT, 256) and kept.source.startswith(
            f"recorded: {decoders.DEFAULT} (default, run r00000001-x), down to a shorter side of 256 px")
    # and its queries decode alike
    assert decoders.recorded(store, SLUG) == decoders.Decode(decoders.DEFAULT, 256)


def test_a_record_from_before_the_default_keeps_its_decoder_and_gets_its_side_recorded(tmp_path):
    """A store whose first run timed the decoders (or inherited one) keeps that decoder: switching stays behind the
    gate. Its side, unrecorded then, is the one its vectors were made at (`legacy`), recorded by the next run."""
    store = _store(tmp_path)
    store.write_json(layout.decoder_key(SLUG), {"decoder": "turbojpeg", "how": "measured", "run_id": "r00000001-x",
                                                 "measured": {"pillow": 0.002, "turbojpeg": 0.001}})
    old = decoders.read_record(store, SLUG)
    assert old.side == decoders.UNRECORDED and old.decode(None) != decoders.default_decode(None)

    class Lite:  # an encoder's attributes only: what resolves a side from before sides were recorded
        decode_side = 256

    class Transformers:
        decode_side, legacy_decode_side = 224, None

    assert old.decode(Lite()) == decoders.Decode("turbojpeg", 256)
    assert old.decode(Transformers()) == decoders.Decode("turbojpeg", None)  # decoded whole before
    kept = _choose(store, first=False, legacy=256)
    record = decoders.read_record(store, SLUG)
    assert (kept.decoder, kept.side) == ("turbojpeg", 256) and "recorded now" in kept.source
    assert (record.decoder, record.how, record.side, record.measured) == ("turbojpeg", "measured", 256, old.measured)
    assert _choose(store, legacy=0).side == 256  # recorded: no longer resolved


def test_two_first_runs_at_once_agree_the_loser_takes_the_winners_record(tmp_path):
    store = _store(tmp_path)
    winner = decoders.Record("simplejpeg", decoders.MEASURED, "r00000001-a")
    assert decoders.create_record(store, SLUG, winner) is winner
    loser = decoders.create_record(store, SLUG, decoders.Record("turbojpeg", decoders.MEASURED, "r00000001-b"))
    assert (loser.decoder, loser.run_id) == ("simplejpeg", "r00000001-a")
    # a first run that finds the record written meanwhile decodes with it
    assert _choose(store).decoder == "simplejpeg"


def test_a_model_with_vectors_from_before_records_keeps_pillow_and_an_old_record_is_the_record(tmp_path):
    store = _store(tmp_path)
    chosen = _choose(store, first=False, legacy=256)  # its vectors were Pillow's, at the side it had then
    assert (chosen.decoder, chosen.side) == (decoders.PILLOW, 256)
    assert decoders.read_record(store, SLUG).how == decoders.ASSUMED
    old = _store(tmp_path / "old")
    old.write_json(layout.decoder_key(SLUG), {"decoder": "simplejpeg", "run_id": "r00000003-x"})  # written after a run
    assert decoders.read_record(old, SLUG).how == decoders.EARLIER
    assert _choose(old).decoder == decoders.recorded(old, SLUG).decoder == "simplejpeg"


@pytest.mark.parametrize("hostile", [{"decoder": "os.system"}, {"decoder": ["simplejpeg"]}, {"other": 1}, [1, 2],
                                     {"decoder": "simplejpeg", "how": "exec"},
                                     {"decoder": "simplejpeg", "gate": {"k": "x" * 500}},
                                     {"decoder": "simplejpeg", "measured": {"__import__('os')": 1.0}},
                                     {"decoder": "simplejpeg", "side": "256"}, {"decoder": "simplejpeg", "side": 10**9},
                                     {"decoder": "simplejpeg", "side": True}, "not json"])
def test_a_garbled_or_planted_record_is_never_trusted(tmp_path, hostile, caplog):
    import json
    import logging

    store = _store(tmp_path)
    path = tmp_path / "store" / layout.decoder_key(SLUG)
    path.parent.mkdir(parents=True)
    path.write_text(hostile if isinstance(hostile, str) else json.dumps(hostile))
    with pytest.raises(decoders.DecoderError, match=r"decoder\.json does not read as a decoder record"):
        decoders.read_record(store, SLUG)
    with caplog.at_level(logging.WARNING, logger="imgest"):
        assert decoders.recorded(store, SLUG).decoder == decoders.PILLOW  # a query warns and decodes with Pillow
    assert "queries decode with Pillow" in caplog.text
    # a run refuses before any work, saying how to go on; a forced explicit choice replaces the record
    with pytest.raises(decoders.DecoderError, match="--decoder NAME --force-decoder REASON"):
        _choose(store)
    with pytest.raises(decoders.DecoderError):
        _choose(store, asked="simplejpeg")  # explicit, but nothing to gate against: forced only
    chosen = _choose(store, asked="simplejpeg", force="the record was damaged")
    assert chosen.decoder == "simplejpeg" and decoders.read_record(store, SLUG).how == decoders.FORCED


def test_a_recorded_decoder_missing_here_is_refused_in_one_line_before_any_work(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from imgest.cli import app
    from tests.helpers import small_catalogue, write_files

    store = _store(tmp_path)
    write_files(str(tmp_path / "catalogue"), small_catalogue(3))
    slug = __import__("imgest.encoders", fromlist=["resolve"]).resolve("efficientnet-lite0").slug
    decoders.create_record(store, slug, decoders.Record("simplejpeg", decoders.MEASURED, "r00000001-x"))
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # as if the package were not installed on this machine
    decoders.installed.cache_clear()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = CliRunner().invoke(app, ["ingest", "--catalogue", str(tmp_path / "catalogue"), "--store",
                                      str(tmp_path / "store"), "--model", "efficientnet-lite0"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("imgest: error: the vectors of model=")
    assert "made with JPEGs decoded by simplejpeg, which cannot run here (the simplejpeg package is not installed" \
        in lines[0] and "install it" in lines[0] and "--decoder NAME" in lines[0]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing listed, locked, written
    # an explicit choice cannot be gated without the recorded decoder: forced only, and then it goes on
    with pytest.raises(decoders.DecoderError, match="cannot run here to measure the gate"):
        decoders.check(store, slug, decoders.PILLOW, None, "cpu")
    assert decoders.check(store, slug, decoders.PILLOW, "moved to hosts without simplejpeg", "cpu").decoder == \
        "simplejpeg"
    with pytest.raises(decoders.DecoderError, match="--decoder nvjpeg cannot decode here"):
        decoders.check(store, slug, decoders.NVJPEG, "x", "cpu")


@pytest.fixture(scope="module")
def gate_files():
    """Files for the gate, fewer than the parity sample's 256: real photos at 300-500 px, JPEG and PNG cut-outs."""
    from imgest.images.demo import product_photos

    return tuple(product_photos(24, seed=5, sides=(300, 500)).values())


class Negative:
    """A decoder outside any gate: simplejpeg's pixels, inverted (a registry entry of the test's, not a mock)."""

    name, gpu = "negative", False

    def missing(self):
        return None

    def scaled(self, data, size, min_side):
        return 255 - decoders.get("simplejpeg").scaled(data, size, min_side)


def test_an_explicit_decoder_outside_the_gate_is_refused_and_one_inside_switches_the_model(tmp_path, tiny_models,
                                                                                          gate_files, monkeypatch):
    from imgest import encoders
    from imgest.encoders import parity
    from imgest.tasks.ingest.decoder import DecoderGateError

    encoder = encoders.load(encoders.resolve(f"hf:{tiny_models['clip']}"), "cpu")
    monkeypatch.setitem(decoders.REGISTRY, Negative.name, Negative())
    decoders.installed.cache_clear()
    store = _store(tmp_path)
    decoders.create_record(store, SLUG, decoders.Record("simplejpeg", decoders.MEASURED, "r00000001-x"))

    def gate(recorded, asked, side):
        return parity.decoder_parity(encoder, recorded, asked, gate_files, side)

    with pytest.raises(DecoderGateError, match=r"--decoder negative: JPEGs decoded by negative against simplejpeg on "
                                               r"24 images of the parity sample: mean cosine .* below the 0.998"):
        _choose(store, asked="negative", gate=gate)
    assert decoders.read_record(store, SLUG).decoder == "simplejpeg"  # refused: nothing changed
    # the same libjpeg-turbo at the same scale: inside the gate, the model switches, its figures recorded
    inside = _choose(store, asked="turbojpeg", gate=gate, run_id="r00000002-x")
    record = decoders.read_record(store, SLUG)
    assert inside.decoder == record.decoder == "turbojpeg" and inside.source.startswith("explicit, passed the gate")
    assert (record.how, record.previous, record.run_id) == (decoders.EXPLICIT, "simplejpeg", "r00000002-x")
    assert record.gate["mean_cosine"] >= 0.998 and record.gate["overlap@10"] >= 0.9 and record.gate["images"] == 24
    # forced past the gate: switched, the reason kept with the decoder before
    forced = _choose(store, asked="negative", force="a test of the force", run_id="r00000003-x")
    record = decoders.read_record(store, SLUG)
    assert forced.decoder == record.decoder == "negative" and record.gate == {"forced": "a test of the force"}
    assert record.previous == "turbojpeg" and "forced past the gate against turbojpeg" in forced.source


def test_a_transformers_models_reduced_decode_is_recorded_where_it_passes_its_gate(tmp_path, tiny_models,
                                                                                   gate_files, monkeypatch):
    """A transformers processor's resize target is the side its JPEGs may decode down to (the shortest edge; for
    DINOv2 256, not the crop), and a first run records it only where the reduced decode passes the gate against the
    processor's own path on whole images; else it records whole images, with the figures."""
    from transformers import BitImageProcessor, SiglipImageProcessor

    from imgest import encoders
    from imgest.encoders import parity
    from imgest.encoders.hf import _decode_side
    from imgest.tasks.ingest.decoder import model_side

    assert _decode_side(BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224})) == 256
    assert _decode_side(SiglipImageProcessor(size={"height": 224, "width": 384})) == 384  # squashed: both sides
    assert _decode_side(SiglipImageProcessor(do_resize=False)) is None
    encoder = encoders.load(encoders.resolve(f"hf:{tiny_models['clip']}"), "cpu")
    assert encoder.decode_side == 32 and encoder.gated_decode_side and decoders.legacy_side(encoder) == 0
    monkeypatch.setitem(decoders.REGISTRY, Negative.name, Negative())
    decoders.installed.cache_clear()

    def gated(encoder, decoder, side):
        return parity.side_parity(encoder, decoder, side, gate_files)

    side, figures = model_side(encoder, decoders.DEFAULT, gated)
    assert side == 32 and figures["passed"] and figures["images"] == len(gate_files)
    assert figures["mean_cosine"] >= parity.REDUCED_MEAN_COSINE
    store = _store(tmp_path)  # a decode outside the gate: the first run records whole images, and why
    chosen = _choose(store, side=lambda name: model_side(encoder, Negative.name, gated))
    record = decoders.read_record(store, SLUG)
    assert chosen.side == record.side == decoders.FULL and not record.side_gate["passed"]
    assert record.decode(encoder) == decoders.Decode(decoders.DEFAULT, None)
    from imgest.retrieval.status import model_decoder

    shown = model_decoder(store, SLUG)
    assert shown["side"] == 0 and "whole images: the reduced decode failed its gate" in shown["describe"]


def test_each_shard_names_its_decoder_and_the_same_bytes_give_the_same_vector(tmp_path, tiny_models, monkeypatch):
    from imgest import encoders
    from imgest.images.demo import product_photos
    from imgest.state.shards import UNRECORDED, embedding_matrix, shard_decoder
    from imgest.storage import Location
    from imgest.tasks.ingest.encode import encode_shard
    from imgest.tasks.ingest.plan import ShardPlan, WorkItem
    from tests.helpers import write_files

    encoder = encoders.load(encoders.resolve(f"hf:{tiny_models['clip']}"), "cpu")
    photos = list(product_photos(4, seed=2, sides=(300, 400)).values())
    files = {**{f"a/{i}.jpg": d for i, d in enumerate(photos)}, **{f"b/{i}.jpg": d for i, d in enumerate(photos)}}
    write_files(str(tmp_path / "cat"), files)
    cat = Location(str(tmp_path / "cat"))

    def encoded(run: str, keys: list[str], decoder: str):
        items = tuple(WorkItem(k, cat.uri(k), len(files[k]), None, None, None) for k in keys)
        store = Location(str(tmp_path / decoder))
        result = encode_shard(ShardPlan(run, 0, items), encoder, cat, store, 2, decode_workers=1, decoder=decoder)
        table = store.read_table(f"embeddings/model={encoder.spec.slug}/part-{run}-00000.parquet")
        assert result.decoder == shard_decoder(table.schema.metadata) == decoder
        return embedding_matrix(table, encoder.spec.dim)

    first = encoded("r00000001-x", sorted(k for k in files if k.startswith("a/")), "simplejpeg")
    later = encoded("r00000002-x", sorted(k for k in files if k.startswith("b/")), "simplejpeg")
    assert np.abs(first - later).max() < 1e-6  # a later run with the recorded decoder: the same vectors
    assert shard_decoder({b"imgest.decoder": b"os.system"}) == shard_decoder(None) == UNRECORDED
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # a worker without the run's decoder fails its shard
    with pytest.raises(decoders.DecoderError, match="decodes JPEGs with simplejpeg, which cannot run in this worker"):
        encoded("r00000003-x", ["a/0.jpg"], "simplejpeg")

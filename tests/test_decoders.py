"""JPEG decoders: each one's scale, pixels and orientation, the run's choice by measurement, and the fallbacks."""

import sys
import time

import numpy as np
import pytest

from imgest.images import decoders
from imgest.images.decode import DecodeError, decode_image
from tests.helpers import gradient, hostile_files, jpeg_bytes

OTHERS = [name for name in decoders.REGISTRY if name != decoders.PILLOW]


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
    from imgest.demo import product_photos

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
    with pytest.raises(ValueError, match="unknown JPEG decoder 'libjpeg'; known: pillow, simplejpeg, turbojpeg"):
        decoders.get("libjpeg")


def test_the_cheapest_decoder_is_chosen_by_cpu_time():
    def work(data, name):  # Pillow made to cost ~5 ms of CPU an image, the others nothing
        if name == decoders.PILLOW:
            end = time.thread_time() + 0.005
            while time.thread_time() < end:
                pass

    chosen, measured = decoders.fastest([b"a", b"b"], work)
    assert chosen != decoders.PILLOW and measured[decoders.PILLOW] >= 0.005
    assert set(measured) == set(decoders.installed())
    assert decoders.fastest([], work) == (decoders.PILLOW, {})


def test_the_models_decoder_is_kept_for_its_queries_and_a_record_names_only_an_installed_one(tmp_path):
    from imgest.storage import Location

    store = Location(str(tmp_path / "store"))
    assert decoders.recorded(store, "m-1234abcd") == decoders.PILLOW  # nothing recorded yet
    decoders.record(store, "m-1234abcd", "simplejpeg", "r1")
    assert decoders.recorded(store, "m-1234abcd") == "simplejpeg"
    for hostile in ({"decoder": "os.system"}, {"decoder": ["simplejpeg"]}, {"other": 1}):
        store.write_json(decoders.record_key("m-1234abcd"), hostile)
        assert decoders.recorded(store, "m-1234abcd") == decoders.PILLOW, hostile
    (tmp_path / "store" / decoders.record_key("m-1234abcd")).write_text("not json")
    assert decoders.recorded(store, "m-1234abcd") == decoders.PILLOW


def test_a_store_that_refuses_the_decoder_record_costs_a_warning_not_the_run(tmp_path, monkeypatch, caplog):
    import logging

    from imgest.storage import Location, StorageError

    store = Location(str(tmp_path / "store"))

    def refuse(key, value):
        raise StorageError("AccessDenied: PutObject")

    monkeypatch.setattr(store, "write_json", refuse)
    with caplog.at_level(logging.WARNING, logger="imgest"):
        assert decoders.record(store, "m-1234abcd", "simplejpeg", "r1") is False
    assert "queries decode with Pillow" in caplog.text
    assert decoders.recorded(store, "m-1234abcd") == decoders.PILLOW

"""Encoder registry: the packaged Lite0 weights on real photos, and the hf: path with tiny random models."""

import shutil

import numpy as np
import pytest

from imgest import encoders
from imgest.encoders import EncoderError
from imgest.images.decode import to_rgb
from imgest.images.demo import photo
from imgest.storage import Location
from imgest.tasks.ingest.batch_size import cached_or_tuned, tune_batch_size


def test_unknown_model_lists_the_registry():
    with pytest.raises(EncoderError, match=r"unknown model 'clip-big'; known: efficientnet-lite0, "
                                           r"efficientnet-lite0-gem, efficientnet-lite0-gem-ms, efficientnet-lite1, "
                                           r"efficientnet-lite1-gem, efficientnet-lite1-gem-ms, efficientnet-lite2, "
                                           r"efficientnet-lite2-gem, efficientnet-lite2-gem-ms, minilm-l6, hf:"):
        encoders.resolve("clip-big")


def test_unknown_device_lists_allowed():
    with pytest.raises(EncoderError, match="allowed: auto, cpu, cuda"):
        encoders.resolve_device("tpu")


def test_raw_pixels_at_another_side_is_a_model_of_its_own(tmp_path):
    """`raw-pixels-<side>`: the same baseline shrunk to side x side (the scale rehearsal's 48-d encoder), its own
    model id and slug, stored under its name and read back from the store like any built-in; `raw-pixels` is the
    16 x 16 one it always was."""
    default, small = encoders.resolve("raw-pixels"), encoders.resolve("raw-pixels-4")
    assert (default.dim, small.dim) == (768, 48)
    assert default.model_id == encoders.resolve("raw-pixels-16").model_id.replace("raw-pixels-16", "raw-pixels")
    assert small.model_id != default.model_id and small.slug.startswith("raw-pixels-4-")
    encoder = encoders.load(small, "cpu")
    image = photo("astronaut").resize((64, 64))
    vector = encoder.encode_images(encoder.preprocess(image)[None])
    assert vector.shape == (1, 48) and np.isclose(np.linalg.norm(vector), 1.0)
    assert encoders.resolve_recorded("raw-pixels-4", Location(str(tmp_path)), "model.json").dim == 48
    for name in ("raw-pixels-1", "raw-pixels-33", "raw-pixels-04", "raw-pixels-"):
        with pytest.raises(EncoderError, match=r"unknown model .*raw-pixels-<side> \(2-32\)"):
            encoders.resolve(name)



def _embed(encoder, images):
    return encoder.encode_images(np.stack([encoder.preprocess(to_rgb(im)) for im in images]))


def test_lite0_spec_pins_weights_and_preprocessing():
    spec = encoders.resolve("efficientnet-lite0")
    assert spec.dim == 1280 and spec.modalities == ("image",)
    assert spec.model_id.startswith("efficientnet-lite0@" + spec.revision[:16])
    assert "+pre." in spec.model_id and spec.slug.startswith("efficientnet-lite0-")


def test_lite0_real_photo_and_its_crop_are_nearest(lite0):
    astronaut, coffee, chelsea = photo("astronaut"), photo("coffee"), photo("chelsea")
    w, h = astronaut.size
    crop = astronaut.crop((w // 10, h // 10, w - w // 10, h - h // 10))
    vectors = _embed(lite0, [astronaut, crop, coffee, chelsea])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    sims = vectors @ vectors.T
    assert sims[0, 1] > sims[0, 2] and sims[0, 1] > sims[0, 3]
    assert sims[0, 1] > sims[2, 3]  # photo vs its crop beats any two different photos


def test_gem_pooling_worked_out_by_hand():
    import torch

    from imgest.encoders.efficientnet import GEM_EPS, gem

    # one image, two channels of a 2x2 map. Channel 0: (1^3 + 2^3 + 3^3 + 4^3) / 4 = 100 / 4 = 25, and
    # 25^(1/3) = 2.9240 where the average is 2.5. Channel 1: three zeros clamped to eps and one 8:
    # (3 eps^3 + 512) / 4 = 128, and 128^(1/3) = 5.0397 where the average is 2: the salient cell dominates.
    fmap = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]], [[0.0, 0.0], [0.0, 8.0]]]])
    np.testing.assert_allclose(gem(fmap, 3.0).numpy(), [[25 ** (1 / 3), ((3 * GEM_EPS ** 3 + 512) / 4) ** (1 / 3)]],
                               rtol=1e-6)
    np.testing.assert_allclose(gem(fmap, 1.0).numpy(), [[2.5, 2.0]], rtol=1e-5)  # p = 1 is the average


@pytest.mark.slow("real weights")
def test_gem_model_is_a_model_of_its_own_on_the_same_weights(lite0):
    avg, gem_spec = encoders.resolve("efficientnet-lite0"), encoders.resolve("efficientnet-lite0-gem")
    assert gem_spec.revision == avg.revision and gem_spec.family == avg.family
    assert gem_spec.preprocessing == {**avg.preprocessing, "pooling": "gem", "gem_p": 3.0}
    assert gem_spec.model_id != avg.model_id and gem_spec.slug.startswith("efficientnet-lite0-gem-")
    assert encoders.recorded("efficientnet-lite0-gem", None, "test") == "efficientnet-lite0-gem"  # a built-in
    pooled = encoders.load(gem_spec, "cpu")
    images = [photo("astronaut"), photo("coffee"), photo("chelsea")]
    a, g = _embed(lite0, images), _embed(pooled, images)
    assert np.allclose(np.linalg.norm(g, axis=1), 1.0, atol=1e-5)
    same = (a * g).sum(1)
    assert np.all(same < 0.999) and np.all(same > 0.5), same  # another pooling of the same feature maps
    w, h = images[0].size
    crop = _embed(pooled, [images[0].crop((w // 10, h // 10, w - w // 10, h - h // 10))])[0]
    assert g[0] @ crop > max(g[0] @ g[1], g[0] @ g[2])  # a photo's crop is still its nearest


def test_lite0_has_no_text_tower(lite0):
    with pytest.raises(EncoderError, match="no text tower"):
        lite0.encode_texts(["a red shoe"])


@pytest.mark.parametrize("kind,dim,text", [("clip", 24, True), ("siglip", 32, True), ("dinov2", 32, False)])
def test_hf_path_loads_local_folders(tiny_models, kind, dim, text):
    spec = encoders.resolve(f"hf:{tiny_models[kind]}")
    assert spec.dim == dim and spec.extra["model_type"] == kind
    encoder = encoders.load(spec, "cpu")
    vectors = _embed(encoder, [photo("coffee"), photo("camera"), photo("logo")])
    assert vectors.shape == (3, dim)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    if text:
        texts = encoder.encode_texts(["a red shoe", "photo of a blue bag"])
        assert texts.shape == (2, dim) and np.allclose(np.linalg.norm(texts, axis=1), 1.0, atol=1e-5)
    else:
        with pytest.raises(EncoderError, match="image-only"):
            encoder.encode_texts(["a red shoe"])


def test_model_id_changes_with_weights(tiny_models, tmp_path):
    import torch
    from transformers import AutoModel

    copy = tmp_path / "clip-copy"
    shutil.copytree(tiny_models["clip"], copy)
    same = encoders.resolve(f"hf:{copy}")
    model = AutoModel.from_pretrained(copy)
    with torch.no_grad():
        model.visual_projection.weight.add_(0.01)
    model.save_pretrained(copy)
    changed = encoders.resolve.__wrapped__(f"hf:{copy}")
    assert same.model_id != changed.model_id and same.slug != changed.slug


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(EncoderError, match="no config.json"):
        encoders.resolve(f"hf:{tmp_path}")


def test_tuning_picks_the_measured_best_and_caches_it(tiny_models, tmp_path, compiled_cache, monkeypatch):
    from imgest.tasks.ingest import batch_size

    monkeypatch.setattr(batch_size, "MIN_SECONDS", 0.05)  # how long each size is timed is not what is tested
    encoder = encoders.load(encoders.resolve(f"hf:{tiny_models['dinov2']}"), "cpu")
    tuning = tune_batch_size(encoder, candidates=(1, 2, 4, 8), min_seconds=0.05)
    assert tuning.batch_size == max(tuning.measured, key=tuning.measured.get)
    assert all(rate > 0 for rate in tuning.measured.values())
    store = Location(str(tmp_path))
    first, cached = cached_or_tuned(store, encoder)
    key = f"tuning/model={encoder.spec.slug}/{tuning.device_key}-torch-fp32-batch-auto.json"
    assert store.exists(key) and not cached
    assert cached_or_tuned(store, encoder) == (first, True)  # read back, not measured again


def test_a_second_store_on_the_host_reads_the_first_ones_measurement(tiny_models, tmp_path, compiled_cache,
                                                                      monkeypatch):
    """A batch size is about the hardware, the runtime and the model: measured once on a host (kept beside its
    compiled models), then read by every store there; a damaged host record is measured again, never believed."""
    from imgest.tasks.ingest import batch_size

    encoder = encoders.load(encoders.resolve(f"hf:{tiny_models['dinov2']}"), "cpu")
    measured = []
    real = batch_size.tune_batch_size
    monkeypatch.setattr(batch_size, "MIN_SECONDS", 0.05)
    monkeypatch.setattr(batch_size, "tune_batch_size",
                        lambda enc, candidates=None: measured.append(candidates) or real(enc, candidates))
    first, cached = cached_or_tuned(Location(str(tmp_path / "one")), encoder, fixed=2)
    assert not cached and measured == [(2,)]
    second, cached = cached_or_tuned(Location(str(tmp_path / "two")), encoder, fixed=2)
    assert (second, cached) == (first, True) and measured == [(2,)]  # not measured again
    assert Location(str(tmp_path / "two")).exists(  # and the store still says what its runs were chosen by
        batch_size.tuning_key(encoder.spec.slug, first.device_key, "torch", "fp32", 2))
    (record,) = compiled_cache.glob("tuning/*/*.json")
    record.write_text('{"batch_size": 64, "measured": {"64": "fast"}}')
    third, cached = cached_or_tuned(Location(str(tmp_path / "three")), encoder, fixed=2)
    assert not cached and measured == [(2,), (2,)] and third.batch_size == 2

"""Multi-scale GeM descriptors (`-gem-ms`): what they are made of, the decode they need, and a run through them."""

from __future__ import annotations

import numpy as np
import pytest

from imgest import encoders
from imgest.encoders import efficientnet
from tests.helpers import ingest_into

MULTISCALE = ("efficientnet-lite0-gem-ms", "efficientnet-lite1-gem-ms", "efficientnet-lite2-gem-ms")


def _normalised(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_the_registry_lists_a_multiscale_variant_of_each_backbone():
    assert set(MULTISCALE) <= set(encoders.KNOWN_NAMES)
    ids = {encoders.resolve(name).model_id for name in (*MULTISCALE, "efficientnet-lite0-gem", "efficientnet-lite0")}
    assert len(ids) == 5  # its own fingerprint: a store never mixes its vectors with one scale's


@pytest.mark.parametrize("name,sides,short", [
    # the backbone's side over and times sqrt(2), rounded to even: 224 / 1.4142 = 158.4 -> 158, 224 * 1.4142 =
    # 316.8 -> 316; 240: 169.7 -> 170, 339.4 -> 340; 260: 183.8 -> 184, 367.7 -> 368. The decode gives the largest
    # crop, its shorter side at 8/7 of it (316 * 8 / 7 = 361.1)
    ("efficientnet-lite0-gem-ms", [158, 224, 316], 361),
    ("efficientnet-lite1-gem-ms", [170, 240, 340], 389),
    ("efficientnet-lite2-gem-ms", [184, 260, 368], 421),
])
def test_each_scale_is_a_multiple_of_the_backbones_side_and_the_decode_gives_the_largest(name, sides, short):
    spec = encoders.resolve(name)
    assert spec.preprocessing["scales"] == sides and spec.preprocessing["pooling"] == "gem"
    assert (spec.preprocessing["center_crop"], spec.preprocessing["resize_shorter"]) == (sides[-1], short)


@pytest.mark.slow("real weights")
def test_a_multiscale_embedding_is_the_normalised_sum_of_its_single_scale_gem_embeddings():
    """Computed here: the largest scale's crop resized to each side, GeM-pooled by the network, each
    normalised, summed and normalised; and the base scale's part is the single-scale `-gem` descriptor of the
    same window (Pillow's own resample against the graph's, so near, not equal)."""
    import torch
    import torch.nn.functional as F

    from imgest.images.demo import photo

    multi = encoders.load(encoders.resolve("efficientnet-lite0-gem-ms"), "cpu")
    single = encoders.load(encoders.resolve("efficientnet-lite0-gem"), "cpu")
    images = [photo(name).convert("RGB") for name in ("chelsea", "coffee", "astronaut", "rocket")]
    pixels = np.stack([multi.preprocess(image) for image in images])
    assert pixels.shape == (4, 3, 316, 316) and pixels.dtype == np.uint8

    per_scale = {}
    with torch.inference_mode():
        largest = torch.from_numpy(pixels).float()
        for side in (158, 224, 316):
            scaled = largest if side == 316 else F.interpolate(largest, size=(side, side), mode="bicubic",
                                                               antialias=True, align_corners=False).clamp(0, 255)
            features = single.model.extract_features((scaled - 127.0) / 128.0)
            per_scale[side] = _normalised(efficientnet.gem(features, 3.0).numpy())
    expected = _normalised(per_scale[158] + per_scale[224] + per_scale[316])
    got = multi.encode_images(pixels)
    assert np.abs(got - expected).max() < 1e-5

    one_scale = single.encode_images(np.stack([single.preprocess(image) for image in images]))
    assert (per_scale[224] * one_scale).sum(1).min() > 0.99  # the same centre window at the base side
    assert (got * one_scale).sum(1).max() < 0.999  # and the larger scale adds something of its own


def test_a_run_encodes_at_every_scale_through_the_compiled_graph(prefect_harness, tmp_path, host_measured_nothing,
                                                                 monkeypatch):
    """An ingest with the multi-scale model: OpenVINO's graph passes parity, the batch size is measured on the
    largest scale's input, and each stored vector is the model's embedding of that image as the run decoded it."""
    import pyarrow.parquet as pq

    from imgest.images.decode import decode_image
    from imgest.tasks.ingest import batch_size
    from tests.helpers import small_catalogue, write_files

    # which sizes are tried and for how long is not what is tested (tests/test_encoders.py)
    monkeypatch.setattr(batch_size, "CPU_CANDIDATES", (1, 2))
    monkeypatch.setattr(batch_size, "MIN_SECONDS", 0.1)

    name = "efficientnet-lite0-gem-ms"
    files = small_catalogue(5)
    write_files(str(tmp_path / "catalogue"), files)
    summary = ingest_into(tmp_path / "catalogue", tmp_path / "store", model=name, runtime="openvino", precision="fp32",
                          batch_size="auto")
    spec = encoders.resolve(name)
    assert summary["model_id"] == spec.model_id and summary["encoded"] == 5
    assert summary["encoding"]["parity"] >= 0.99999 and summary["batch_size_source"].startswith("auto, measured")
    table = pq.read_table(next((tmp_path / "store" / "embeddings" / f"model={summary['slug']}").glob("*.parquet")))
    rows = dict(zip(table.column("item_id").to_pylist(), table.column("embedding").to_numpy(zero_copy_only=False)))
    encoder = encoders.load(spec, "cpu")
    decoder = summary["encoding"]["decoder"]
    for key, data in files.items():
        image = decode_image(data, min_side=encoder.decode_side, decoder=decoder)
        expected = encoder.encode_images(encoder.preprocess(image)[None])[0]
        assert float(np.dot(np.asarray(rows[key], np.float32), expected)) >= 0.9999, key

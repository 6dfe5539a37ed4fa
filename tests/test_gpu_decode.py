"""The GPU JPEG path (tasks/ingest/gpu_decode.py): which objects take it, the encoder's tensor preprocessing, and
a batch that mixes GPU-decoded JPEGs, Pillow fallbacks and files neither can read. nvJPEG itself needs a
GPU (bench/gpu_check.py); here torchvision's decoder runs on the CPU when it is installed, otherwise a
Pillow decoder with decode_jpeg's contract (a list in, one tensor each, the whole call fails on one bad
image) stands in for it."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
from PIL import Image

from imgest import encoders
from imgest.demo import PHOTOS, photo
from imgest.images.decode import decode_image
from imgest.state.shards import embedding_matrix
from imgest.storage import Location
from imgest.tasks.ingest.encode import encode_shard
from imgest.tasks.ingest.gpu_decode import BatchJpegDecoder, plain_jpeg
from imgest.tasks.ingest.plan import ShardPlan, WorkItem
from tests.helpers import gradient, jpeg_bytes, png_bytes, write_files


def _jpeg(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def lite0():
    return encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")


def test_only_plain_jpegs_take_the_gpu_path():
    rgb = gradient(1, (64, 48))
    assert plain_jpeg(jpeg_bytes(rgb), 10**6) and plain_jpeg(_jpeg(rgb.convert("L")), 10**6)
    assert plain_jpeg(_jpeg(rgb, progressive=True), 10**6)
    assert not plain_jpeg(_jpeg(rgb.convert("CMYK")), 10**6)  # nvJPEG would not give Pillow's RGB
    assert not plain_jpeg(png_bytes(rgb), 10**6) and not plain_jpeg(b"\xff\xd8\xff broken", 10**6)
    assert not plain_jpeg(jpeg_bytes(rgb), 64 * 48 - 1)  # over --max-pixels: Pillow's path rejects it


def test_tensor_preprocessing_gives_the_embeddings_of_pillows(lite0):
    import torch

    full, tensor = [], []
    for name in PHOTOS:
        image = decode_image(_jpeg(photo(name).convert("RGB")))
        full.append(lite0.preprocess(image))
        chw = torch.from_numpy(np.asarray(image).transpose(2, 0, 1).copy())
        tensor.append(lite0.preprocess_tensor(chw).numpy())
    diff = np.abs(np.stack(full).astype(int) - np.stack(tensor))
    assert diff.max() <= 1 and diff.mean() < 0.02  # Pillow's resample, to its fixed-point rounding
    cos = np.sum(lite0.encode_images(np.stack(full)) * lite0.encode_images(np.stack(tensor)), axis=1)
    assert cos.min() >= 0.999, cos


def _decoder(lite0, max_pixels=10**8):
    try:
        return BatchJpegDecoder("cpu", lite0.preprocess_tensor, lite0.preprocess, max_pixels, lite0.decode_side)
    except ImportError:
        pass
    import torch

    def decode_jpeg(data, mode, device, apply_exif_orientation):
        if isinstance(data, list):
            return [decode_jpeg(d, mode, device, apply_exif_orientation) for d in data]
        try:
            image = decode_image(data.numpy().tobytes())
        except ValueError as exc:
            raise RuntimeError(f"decode failed: {exc}") from exc
        return torch.from_numpy(np.asarray(image).transpose(2, 0, 1).copy())

    decoder = BatchJpegDecoder.__new__(BatchJpegDecoder)
    decoder.device, decoder._decode, decoder._rgb = "cpu", decode_jpeg, "RGB"
    decoder.preprocess_tensor, decoder.preprocess = lite0.preprocess_tensor, lite0.preprocess
    decoder.max_pixels, decoder.min_side, decoder.gpu_decoded, decoder.fallbacks = max_pixels, lite0.decode_side, 0, 0
    return decoder


def test_a_batch_mixes_gpu_decodes_pillow_fallbacks_and_rejects(tmp_path, lite0):
    photos = {f"p/{i}.jpg": _jpeg(photo(name).convert("RGB"), progressive=i % 2 == 1)
              for i, name in enumerate(PHOTOS[:5])}
    sideways = photo("chelsea").convert("RGB").transpose(Image.Transpose.ROTATE_90)
    exif = Image.Exif()
    exif[0x0112] = 6
    files = {**photos, "p/side.jpg": _jpeg(sideways, exif=exif), "p/cut.png": png_bytes(gradient(7, (300, 300))),
             "p/cmyk.jpg": _jpeg(photo("coffee").convert("CMYK")),
             "p/bad.jpg": b"\xff\xd8\xff\xd9" + jpeg_bytes(gradient(3, (40, 40)))[4:],
             "p/trunc.jpg": jpeg_bytes(gradient(4, (400, 300)))[:300]}
    write_files(str(tmp_path / "cat"), files)
    cat = Location(str(tmp_path / "cat"))
    items = tuple(WorkItem(k, cat.uri(k), len(v), None, None, None) for k, v in sorted(files.items()))
    decoder = _decoder(lite0)

    gpu = encode_shard(ShardPlan("r00000001-gpu", 0, items), lite0, cat, Location(str(tmp_path / "a")), 4,
                       jpeg_decoder=decoder)
    full = copy.copy(lite0)  # nvJPEG decodes at full size: against Pillow's full decode, not its reduced one
    full.decode_side = None
    cpu = encode_shard(ShardPlan("r00000001-cpu", 0, items), full, cat, Location(str(tmp_path / "b")), 4,
                       jpeg_decoder=None)

    assert gpu.rejected == cpu.rejected and [i for i, _ in cpu.rejected] == ["p/bad.jpg", "p/trunc.jpg"]
    assert gpu.encoded == cpu.encoded == len(files) - 2
    # the 5 photos and the sideways one decode on the "GPU"; bad.jpg fails the batch call, then alone, then
    # Pillow rejects it; the PNG, the CMYK JPEG and the header-less truncated one never leave Pillow
    assert (decoder.gpu_decoded, decoder.fallbacks) == (6, 1)
    a, b = (Location(str(tmp_path / d)).read_table(f"embeddings/model={lite0.spec.slug}/part-r00000001-{r}-00000"
                                                   ".parquet") for d, r in (("a", "gpu"), ("b", "cpu")))
    assert a.column("item_id").to_pylist() == b.column("item_id").to_pylist()
    cos = np.sum(embedding_matrix(a, 1280) * embedding_matrix(b, 1280), axis=1)
    assert cos.min() >= 0.995, dict(zip(a.column("item_id").to_pylist(), cos))

"""The GPU JPEG path (tasks/ingest/gpu_decode.py), run on the CPU: a CPU decoder with nvJPEG's contract stands in
for it (`stand_in`: a list of JPEGs in, each whole, RGB and as stored, no EXIF turn; one bad image fails the call;
torchvision's own wheels are CUDA builds that do not load beside the CPU build of torch the suite runs), and
everything after it is the device code itself on CPU tensors.
Which objects take the path; its pixels against the CPU path's, for Lite0 and transformers processors; the decoder
gate through Lite0 and a transformers model; a batch that mixes device decodes, fallbacks and files neither path can
read; the pixel budget; an out-of-memory error splitting a part. nvJPEG itself: bench/gpu_check.py."""

from __future__ import annotations

import functools
import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from imgest import encoders
from imgest.encoders import efficientnet, hf, parity
from imgest.images import decoders, tensors
from imgest.images.decode import DecodeError, decode_image
from imgest.images.demo import PHOTOS, photo, product_photos
from imgest.state.shards import embedding_matrix
from imgest.storage import Location
from imgest.tasks.ingest.encode import encode_shard
from imgest.tasks.ingest.gpu_decode import BYTES_PER_PIXEL, DEVICE_SHARE, BatchJpegDecoder, plain_jpeg
from imgest.tasks.ingest.plan import ShardPlan, WorkItem
from tests.helpers import gradient, jpeg_bytes, png_bytes, write_files

ROOMY = 1 << 40  # free device memory for the tests that are not about the budget


def _jpeg(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _turned(image: Image.Image, orientation: int) -> bytes:
    """`image` stored as a camera stores a turned shot: pixels as shot, the turn in the EXIF header."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    inverse = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270,
               2: Image.Transpose.FLIP_LEFT_RIGHT, 4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
               7: Image.Transpose.TRANSVERSE}
    return _jpeg(image.transpose(inverse[orientation]) if orientation in inverse else image, exif=exif)


def stand_in(raw: list, device: str) -> list:
    """nvJPEG's contract, on the CPU (libjpeg-turbo through simplejpeg): each JPEG whole, RGB, as stored."""
    import simplejpeg

    return [torch.from_numpy(simplejpeg.decode_jpeg(t.numpy().tobytes(), colorspace="RGB").transpose(2, 0, 1)
                             .copy()).to(device) for t in raw]


def _cpu_reference(data: bytes, preprocess, min_side: int | None = None) -> np.ndarray:
    """What the tensor path must give: the stand-in's decode of the whole image (reduced to the eighths the CPU
    decoders keep for `min_side`, as nvjpeg's decode reduces it), turned upright by Pillow's exif_transpose, through
    the model's CPU preprocessing."""
    pixels = stand_in([torch.frombuffer(bytearray(data), dtype=torch.uint8)], "cpu")[0]
    pixels = tensors.dct_scaled(pixels, decoders.eighths((pixels.shape[2], pixels.shape[1]), min_side)[0])
    image = Image.fromarray(pixels.permute(1, 2, 0).numpy())
    header = Image.open(io.BytesIO(data))
    if "exif" in header.info:
        image.info["exif"] = header.info["exif"]
    return preprocess(ImageOps.exif_transpose(image))


def _decoder(plan, preprocess, min_side=None, max_pixels=10**8, free=ROOMY, decode_fn=stand_in) -> BatchJpegDecoder:
    return BatchJpegDecoder("cpu", plan, preprocess, max_pixels, min_side, decode_fn=decode_fn,
                            free_memory=lambda: free)


@functools.lru_cache(maxsize=1)
def _photos() -> tuple[bytes, ...]:
    """Product-sized photos in both orientations and every EXIF turn, progressive and baseline, colour and grey."""
    shots = list(product_photos(6, seed=3).values())
    files = [s for s in shots if s[:3] == b"\xff\xd8\xff"][:4]
    base = photo("chelsea").convert("RGB").resize((900, 600))
    files += [_turned(base, value) for value in range(1, 9)]
    files += [_jpeg(base.convert("L")), _jpeg(photo("coffee").convert("RGB"), progressive=True)]
    return tuple(files)


def _processor(tmp_path, kind: str):
    """A processor with its checkpoints' published settings (transformers' defaults for the class), saved and
    loaded as imgest loads one (Pillow backend)."""
    from transformers import BitImageProcessor, CLIPImageProcessor, SiglipImageProcessor

    made = {"clip": CLIPImageProcessor, "dinov2": BitImageProcessor, "siglip": SiglipImageProcessor}[kind]()
    folder = tmp_path / kind
    made.save_pretrained(folder)
    return hf._processor(str(folder))


def test_only_plain_jpegs_take_the_gpu_path():
    rgb = gradient(1, (64, 48))
    assert plain_jpeg(jpeg_bytes(rgb), 10**6) and plain_jpeg(_jpeg(rgb.convert("L")), 10**6)
    assert plain_jpeg(_jpeg(rgb, progressive=True), 10**6)
    assert not plain_jpeg(_jpeg(rgb.convert("CMYK")), 10**6)  # nvJPEG would not give Pillow's RGB
    assert not plain_jpeg(png_bytes(rgb), 10**6) and not plain_jpeg(b"\xff\xd8\xff broken", 10**6)
    assert not plain_jpeg(jpeg_bytes(rgb), 64 * 48 - 1)  # over --max-pixels: the CPU path rejects it


@pytest.mark.parametrize("side", [None, 256])  # the whole image, and reduced to Lite0's decode side
def test_lite_pixels_are_the_cpu_paths_for_every_photo_and_turn(side):
    preprocess = efficientnet.preprocess
    decoder = _decoder(efficientnet.resample_plan, preprocess, side)
    files = _photos()
    out = decoder.decode(files)
    assert decoder.gpu_decoded == len(files) and decoder.fallbacks == 0
    for data, got in zip(files, out):
        assert isinstance(got, torch.Tensor) and got.shape == (3, 224, 224)
        assert np.array_equal(got.numpy(), _cpu_reference(data, preprocess, side))


def test_the_dct_reduction_of_a_whole_decode_is_near_libjpegs_scaled_decode():
    import simplejpeg

    for data in _photos()[:6]:
        whole = simplejpeg.decode_jpeg(data, colorspace="RGB")
        h, w = whole.shape[:2]
        for eighths in (1, 2, 3, 4, 6):
            ours = tensors.dct_scaled(torch.from_numpy(whole.transpose(2, 0, 1).copy()), eighths).numpy()
            theirs = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-h * eighths // 8),
                                            min_width=-(-w * eighths // 8)).transpose(2, 0, 1)
            assert ours.shape == theirs.shape, (eighths, ours.shape, theirs.shape)
            assert np.abs(ours.astype(int) - theirs).mean() < 1.5, eighths  # of 255: chroma and rounding


@pytest.mark.parametrize("kind", ["clip", "dinov2", "siglip"])
def test_transformers_pixels_are_their_processors_own(tmp_path, kind):
    processor = _processor(tmp_path, kind)
    decoder = _decoder(lambda h, w: hf._resample_plan(processor, h, w), lambda image: hf._pixels(processor, image))
    files = _photos()
    out = decoder.decode(files)
    assert decoder.gpu_decoded == len(files)
    for data, got in zip(files, out):
        expected = _cpu_reference(data, lambda image: hf._pixels(processor, image))
        assert got.shape == expected.shape and np.array_equal(got.numpy(), expected)


def test_a_processor_the_tensor_path_cannot_follow_sends_its_images_to_the_cpu_path(tmp_path):
    from transformers import CLIPImageProcessor

    lanczos = CLIPImageProcessor(resample=Image.Resampling.LANCZOS)
    lanczos.save_pretrained(tmp_path / "lanczos")
    processor = hf._processor(str(tmp_path / "lanczos"))
    assert hf._resample_plan(processor, 600, 900) is None
    decoder = _decoder(lambda h, w: hf._resample_plan(processor, h, w), lambda image: hf._pixels(processor, image))
    data = _photos()[0]
    out = decoder.decode([data])
    assert decoder.fallbacks == 1 and decoder.gpu_decoded == 0
    assert np.array_equal(out[0], hf._pixels(processor, decode_image(data)))



def _gate(encoder, files: list[bytes]) -> dict:
    """The decoder gate's figures of the tensor path (a whole decode, made ready on the device) against the
    model's CPU path (its default decoder, down to its decode side), through `encoder`."""
    side = decoders.min_side(encoder, None)
    decoder = _decoder(encoder.resample_plan, encoder.preprocess, side)
    device = np.stack([t.numpy() for t in decoder.decode(files)])
    cpu = np.stack([encoder.preprocess(decode_image(d, min_side=side, decoder=decoders.DEFAULT)) for d in files])
    return parity.paired(encoder.encode_images(cpu), encoder.encode_images(device))


@pytest.mark.slow("real weights")
def test_the_tensor_path_passes_the_decoder_gate_for_lite0(lite0):
    files = [f for f in parity._files() if f[:3] == b"\xff\xd8\xff"][:48]
    figures = _gate(lite0, files)
    assert parity.passes(figures, "bf16"), figures


@pytest.mark.slow("the parity sample: 256 product photos made")
def test_the_tensor_path_passes_the_decoder_gate_for_a_transformers_model(tiny_models):
    encoder = encoders.load(encoders.resolve(f"hf:{tiny_models['dinov2']}"), "cpu", "torch", "fp32")
    files = [f for f in parity._files() if f[:3] == b"\xff\xd8\xff"][:48]
    figures = _gate(encoder, files)
    assert parity.passes(figures, "bf16"), figures


def _counting(calls: list):
    """The stand-in, each call's pixels noted."""
    def decode(raw, device):
        images = stand_in(raw, device)
        calls.append(sum(int(i.shape[1]) * int(i.shape[2]) for i in images))
        return images

    return decode


def test_a_decode_call_never_holds_more_pixels_than_the_budget():
    files = _photos()
    sizes = [Image.open(io.BytesIO(d)).size for d in files]
    budget_pixels = 3 * max(w * h for w, h in sizes)  # room for about three photos a call
    free = int(budget_pixels * BYTES_PER_PIXEL / DEVICE_SHARE) + BYTES_PER_PIXEL
    calls: list[int] = []
    decoder = _decoder(efficientnet.resample_plan, efficientnet.preprocess, free=free, decode_fn=_counting(calls))
    assert decoder.budget() >= budget_pixels
    out = decoder.decode(files)
    assert len(calls) > 1 and max(calls) <= decoder.budget() and decoder.largest_part <= decoder.budget()
    reference = _decoder(efficientnet.resample_plan, efficientnet.preprocess).decode(files)
    assert all(torch.equal(a, b) for a, b in zip(out, reference))  # parts change nothing but the calls

    # an image above the whole budget is decoded by the CPU path, the rest on the device
    small = _decoder(efficientnet.resample_plan, efficientnet.preprocess,
                     free=int(min(w * h for w, h in sizes) * BYTES_PER_PIXEL / DEVICE_SHARE) + BYTES_PER_PIXEL)
    out = small.decode(files)
    assert small.over_budget > 0 and small.gpu_decoded + small.over_budget == len(files)
    assert sum(isinstance(o, np.ndarray) for o in out) == small.over_budget


def test_an_out_of_memory_error_splits_the_part_and_one_image_alone_goes_to_the_cpu_path():
    files = _photos()[:6]
    limit = [2]  # a call of more images than this runs out of device memory

    def tight(raw, device):
        if len(raw) > limit[0]:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return stand_in(raw, device)

    decoder = _decoder(efficientnet.resample_plan, efficientnet.preprocess, decode_fn=tight)
    out = decoder.decode(files)
    reference = _decoder(efficientnet.resample_plan, efficientnet.preprocess).decode(files)
    assert decoder.splits >= 2 and decoder.gpu_decoded == len(files) and decoder.fallbacks == 0
    assert all(torch.equal(a, b) for a, b in zip(out, reference))

    limit[0] = 0  # not even one image fits: each goes to the CPU path, none is lost
    alone = _decoder(efficientnet.resample_plan, efficientnet.preprocess, decode_fn=tight)
    out = alone.decode(files[:2])
    assert alone.over_budget == 2 and all(isinstance(o, np.ndarray) and o.shape == (3, 224, 224) for o in out)


@pytest.mark.slow("real weights")
def test_a_batch_mixes_device_decodes_cpu_fallbacks_and_rejects(tmp_path, lite0):
    photos = {f"p/{i}.jpg": _jpeg(photo(name).convert("RGB"), progressive=i % 2 == 1)
              for i, name in enumerate(PHOTOS[:5])}
    files = {**photos, "p/side.jpg": _turned(photo("chelsea").convert("RGB"), 6),
             "p/cut.png": png_bytes(gradient(7, (300, 300))),
             "p/cmyk.jpg": _jpeg(photo("coffee").convert("CMYK")),
             "p/bad.jpg": b"\xff\xd8\xff\xd9" + jpeg_bytes(gradient(3, (40, 40)))[4:],
             "p/trunc.jpg": jpeg_bytes(gradient(4, (400, 300)))[:300]}
    write_files(str(tmp_path / "cat"), files)
    cat = Location(str(tmp_path / "cat"))
    items = tuple(WorkItem(k, cat.uri(k), len(v), None, None, None) for k, v in sorted(files.items()))
    decoder = _decoder(lite0.resample_plan, lite0.preprocess, lite0.decode_side)

    gpu = encode_shard(ShardPlan("r00000001-gpu", 0, items), lite0, cat, Location(str(tmp_path / "a")), 4,
                       jpeg_decoder=decoder)
    cpu = encode_shard(ShardPlan("r00000001-cpu", 0, items), lite0, cat, Location(str(tmp_path / "b")), 4,
                       jpeg_decoder=None, decoder=decoders.DEFAULT)  # the model's CPU path, down to its side

    assert gpu.rejected == cpu.rejected and [i for i, _ in cpu.rejected] == ["p/bad.jpg", "p/trunc.jpg"]
    assert gpu.encoded == cpu.encoded == len(files) - 2
    # the 5 photos and the sideways one decode on the "device"; bad.jpg fails the batch call, then alone, then
    # the CPU path rejects it; the PNG, the CMYK JPEG and the header-less truncated one never leave the CPU path
    assert (decoder.gpu_decoded, decoder.fallbacks) == (6, 1)
    a, b = (Location(str(tmp_path / d)).read_table(f"embeddings/model={lite0.spec.slug}/part-r00000001-{r}-00000"
                                                   ".parquet") for d, r in (("a", "gpu"), ("b", "cpu")))
    assert a.column("item_id").to_pylist() == b.column("item_id").to_pylist()
    cos = np.sum(embedding_matrix(a, 1280) * embedding_matrix(b, 1280), axis=1)
    assert cos.min() >= 0.99, dict(zip(a.column("item_id").to_pylist(), cos))  # the decoder gate's 1st percentile


def test_an_unreadable_header_takes_the_cpu_path_and_gets_its_reason():
    decoder = _decoder(efficientnet.resample_plan, efficientnet.preprocess)
    out = decoder.decode([b"\xff\xd8\xff not a jpeg at all"])
    assert isinstance(out[0], DecodeError)

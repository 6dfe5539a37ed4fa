"""Decoded images as tensors, made model-ready on their device: a whole decode reduced as libjpeg reduces in the
DCT domain (`dct_scaled`: the CPU path decodes JPEGs down to the model's side that way), the EXIF orientation
applied as flips and rotations, then each image resized and cropped as Pillow would (its bicubic or bilinear
filter as two matrix products in its fixed point), images of one size in one batched product.

The GPU path's second half: nvJPEG decodes a batch whole on the GPU and ignores EXIF, this does the rest there.
Nothing here is GPU-only, so the suite runs it on CPU tensors. The orientation is read from the JPEG's header on
the CPU (`orientation`), as Pillow reads it; what an encoder's preprocessing does to an image of a given size is a
`Resample` (the encoder's `resample_plan`)."""

from __future__ import annotations

import dataclasses
import io
import warnings

from PIL import Image

ORIENTATION = 0x0112  # the EXIF tag Pillow's ImageOps.exif_transpose reads
BICUBIC, BILINEAR = int(Image.Resampling.BICUBIC), int(Image.Resampling.BILINEAR)
_SUPPORT = {BICUBIC: 2.0, BILINEAR: 1.0}  # each filter's half-width at scale 1, as Pillow's
PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images (libImaging/Resample.c)
ONE, HALF = float(1 << PRECISION_BITS), float(1 << (PRECISION_BITS - 1))


def orientation(data: bytes) -> int:
    """The EXIF orientation (1-8) a JPEG's header declares, as Pillow's `exif_transpose` reads it; 1 (upright)
    when there is none or it cannot be read. Parses the header only, no pixel."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as image:
                value = image.getexif().get(ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - a header Pillow cannot read is upright here; the decode decides the rest
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def orient(image, value: int):
    """A CHW tensor turned upright by EXIF orientation `value`, as `ImageOps.exif_transpose` turns a Pillow
    image: 2 mirrored, 3 half-turned, 4 flipped, 5 transposed, 6 turned clockwise, 7 transversed, 8 turned
    anticlockwise. A view where torch gives one."""
    import torch

    h, w = 1, 2
    if value == 2:
        return image.flip(w)
    if value == 3:
        return image.flip(h, w)
    if value == 4:
        return image.flip(h)
    if value == 5:
        return image.transpose(h, w)
    if value == 6:
        return torch.rot90(image, -1, (h, w))
    if value == 7:
        return image.transpose(h, w).flip(h, w)
    if value == 8:
        return torch.rot90(image, 1, (h, w))
    return image


def _scaler(n: int):
    """The n x 8 map from an 8-pixel row of a block to the n pixels of libjpeg's n/8 scaled decode: the inverse
    n-point DCT of the block's n lowest frequencies (orthonormal DCT-II matrices), scaled so a flat block stays
    flat."""
    import numpy as np

    def dct(size: int):
        k, x = np.arange(size)[:, None], np.arange(size)[None, :]
        matrix = np.sqrt(2.0 / size) * np.cos(np.pi * (2 * x + 1) * k / (2 * size))
        matrix[0] /= np.sqrt(2.0)
        return matrix

    return np.sqrt(n / 8) * dct(n).T @ dct(8)[:n, :]


def dct_scaled(image, eighths: int):
    """A whole decode (CHW uint8, as stored: before any EXIF turn) reduced to `eighths`/8 of its size as libjpeg's
    scaled decode reduces it (simplejpeg's and the other CPU decoders' reduced decode): each 8x8 block of the
    image grid to eighths x eighths pixels through `_scaler`, one linear map per block; the edge blocks padded by
    repeating the last row and column, as encoders pad them; the size ceil(side * eighths / 8), as libjpeg's. Not
    libjpeg's bits (its chroma is scaled before upsampling, and it rounds once, at the end): on 48 photos of the
    parity sample, Lite0's embeddings of the whole decode reduced this way against simplejpeg's reduced decode,
    mean cosine 0.9993, 1st percentile 0.9972 (a whole decode resized by Pillow alone: 0.9962, 0.9892, outside the
    decoder gate)."""
    import torch

    if eighths >= 8:
        return image
    c, h, w = image.shape
    padded_h, padded_w = -(-h // 8) * 8, -(-w // 8) * 8
    x = torch.nn.functional.pad(image.double()[None], (0, padded_w - w, 0, padded_h - h), mode="replicate")[0]
    m = torch.from_numpy(_scaler(eighths)).to(x.device)
    blocks = x.reshape(c, padded_h // 8, 8, padded_w // 8, 8)
    y = torch.einsum("ai,chiwj,bj->chawb", m, blocks, m).reshape(c, padded_h // 8 * eighths, padded_w // 8 * eighths)
    return y[:, :-(-h * eighths // 8), :-(-w * eighths // 8)].add_(0.5).floor_().clamp_(0, 255).to(torch.uint8)


@dataclasses.dataclass(frozen=True)
class Resample:
    """What a preprocessing does to one image: the window `box` (left, top, right, bottom, in source pixels,
    fractional) resized to `size` (height, width) with `resample` (Pillow's filter number), then the integer
    window `crop` (top, left, height, width) of that taken, or all of it."""

    box: tuple[float, float, float, float]
    size: tuple[int, int]
    resample: int = BICUBIC
    crop: tuple[int, int, int, int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.crop[2], self.crop[3]) if self.crop else self.size


def weights(size: int, start: float, stop: float, out: int, resample: int = BICUBIC, device=None):
    """The (out x size) matrix of Pillow's resampling of [start, stop) onto `out` pixels, built on `device`, as
    Pillow's 8-bit passes use it: its filter (bicubic with a = -0.5, or the triangle), widened by the scale when
    shrinking (antialiasing), each output pixel's window as Pillow bounds it, each row normalised, then in
    PRECISION_BITS fixed point (whole numbers, float64)."""
    import torch

    scale = (stop - start) / out
    widen = max(scale, 1.0)
    support = _SUPPORT[resample] * widen
    centres = start + (torch.arange(out, dtype=torch.float64, device=device) + 0.5) * scale
    pixels = torch.arange(size, dtype=torch.float64, device=device)
    x = ((pixels[None, :] - centres[:, None] + 0.5) / widen).abs()
    if resample == BICUBIC:
        a = -0.5
        w = torch.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                        torch.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, torch.zeros_like(x)))
    else:
        w = (1 - x).clamp(min=0)
    low = (centres - support + 0.5).trunc().clamp(min=0)  # C's int(): towards zero, as Pillow
    high = (centres + support + 0.5).trunc().clamp(max=size)
    w = w * ((pixels[None, :] >= low[:, None]) & (pixels[None, :] < high[:, None]))
    w = w / w.sum(dim=1, keepdim=True)
    return (w * ONE + w.sign() * 0.5).trunc()  # Pillow's normalize_coeffs_8bpc


def resample(images, plan: Resample):
    """A uint8 (N)CHW tensor of images of one size resampled by `plan`, on its device: uint8 of `plan.shape`.
    Pillow's two passes (horizontal, then vertical), each in its fixed point and ending in 8 bits: in float64,
    whose 53 bits hold every sum exactly, so the pixels are Pillow's."""
    import torch

    batch = images if images.dim() == 4 else images[None]
    _, _, h, w = batch.shape
    left, top, right, bottom = plan.box
    out_h, out_w = plan.size
    rows = weights(h, top, bottom, out_h, plan.resample, batch.device)
    cols = weights(w, left, right, out_w, plan.resample, batch.device)
    across = _eight_bits(torch.matmul(batch.double(), cols.T))
    out = _eight_bits(torch.matmul(rows, across)).to(torch.uint8)
    if plan.crop:
        top_, left_, ch, cw = plan.crop
        out = out[..., top_:top_ + ch, left_:left_ + cw]
    return out if images.dim() == 4 else out[0]


def _eight_bits(sums):
    """A pass's fixed-point sums as Pillow ends them: plus a half, shifted down, clipped to 0-255."""
    return sums.add_(HALF).div_(ONE).floor_().clamp_(0, 255)


def model_ready(images: list, plans: list[Resample]):
    """Each CHW uint8 tensor through its plan, stacked: one NCHW uint8 batch on the images' device. Images of the
    same size and plan are resampled together, one batched product each."""
    import torch

    out: list = [None] * len(images)
    groups: dict = {}
    for i, (image, plan) in enumerate(zip(images, plans)):
        groups.setdefault((tuple(image.shape), plan), []).append(i)
    for (_, plan), members in groups.items():
        done = resample(torch.stack([images[i] for i in members]), plan)
        for j, i in enumerate(members):
            out[i] = done[j]
    return torch.stack(out)

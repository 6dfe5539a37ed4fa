"""Decode cost per core on product photos, and what each reduced decode does to the embeddings.

    .venv/bin/python bench/bench_decode.py [--images 60] [--side 1200]

JPEGs of real photo content (`imgest.images.demo.product_photos`, JPEG objects only) rescaled so their longer
side is `--side` px, quality 85-95, a third progressive. On one core, one run, the same images: decode +
Lite0 preprocessing (resize and centre crop to 224) img/s for
  - full: a full Pillow decode (the baseline),
  - 2x: the reduced decode imgest used until 2026-12-02 (DCT-domain scaling while the shorter side stays
    >= 2 x 256),
  - shipped: the reduced decode imgest uses (DCT-domain scaling down to 1 x 256),
  - 1/4 and 1/8: libjpeg's 1/4 and 1/8 scaled decodes, whatever size they leave (what "decode to the model
    size" would mean; below 256 px the preprocessing upsamples).
For each, the cosine of its Lite0 embedding with the full decode's (min and mean): the quality price.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=60)
    parser.add_argument("--side", type=int, default=1200, help="longer side of every JPEG, px")
    args = parser.parse_args()

    import torch
    from PIL import Image, ImageOps

    from imgest import encoders
    from imgest.images import decode as decode_module
    from imgest.images.decode import decode_image, to_rgb
    from imgest.images.demo import product_photos

    torch.set_num_threads(1)
    encoder = encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")
    side = encoder.decode_side
    rng = np.random.default_rng(1)
    jpegs = []
    for key, data in product_photos(args.images * 2).items():
        if not key.endswith(".jpg") or len(jpegs) == args.images:
            continue
        image = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
        scale = args.side / max(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        image.save(buf, "JPEG", quality=int(rng.integers(85, 96)), progressive=len(jpegs) % 3 == 0)
        jpegs.append(buf.getvalue())
    shapes = [Image.open(io.BytesIO(b)).size for b in jpegs]
    print(f"{len(jpegs)} JPEGs, {np.mean([len(b) for b in jpegs]) / 1e3:.0f} kB mean, "
          f"shorter side {min(min(s) for s in shapes)}-{max(min(s) for s in shapes)} px, longer {args.side} px")

    def scaled(factor: int):
        def decode(data: bytes):
            image = Image.open(io.BytesIO(data))
            image.draft("RGB", (image.width // factor, image.height // factor))
            image.load()
            return to_rgb(ImageOps.exif_transpose(image))
        return decode

    def to_side(gap: int):
        def decode(data: bytes):
            decode_module.JPEG_REDUCING_GAP = gap  # the rule of each variant, restored below
            try:
                return decode_image(data, min_side=side)
            finally:
                decode_module.JPEG_REDUCING_GAP = shipped
        return decode

    shipped = decode_module.JPEG_REDUCING_GAP
    variants = {"full": decode_image, "2x (>= 2 x 256, before)": to_side(2),
                f"shipped (>= {shipped} x 256)": to_side(shipped), "1/4 scale": scaled(4), "1/8 scale": scaled(8)}
    pixels, rates = {}, {}
    for name, decode in variants.items():
        decode(jpegs[0])  # warm
        start = time.perf_counter()
        pixels[name] = [encoder.preprocess(decode(b)) for b in jpegs]
        rates[name] = len(jpegs) / (time.perf_counter() - start)
    reference = encoder.encode_images(np.stack(pixels["full"]))
    print(f"{'decode + preprocess, one core':30s} {'img/s':>7s} {'x full':>7s} {'cos min':>8s} {'cos mean':>8s}")
    for name in variants:
        cos = np.sum(reference * encoder.encode_images(np.stack(pixels[name])), axis=1)
        print(f"{name:30s} {rates[name]:7.1f} {rates[name] / rates['full']:7.2f} {cos.min():8.4f} {cos.mean():8.4f}")


if __name__ == "__main__":
    main()

"""A demo catalogue of real images that can be had offline: Fashion-MNIST and scikit-image's photos."""

from __future__ import annotations

import gzip
import io
import os

import numpy as np
from PIL import ExifTags, Image, ImageDraw

FASHION_DIR = "/usr/share/datasets/fashion-mnist"  # Debian package dataset-fashion-mnist
FASHION_CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                   "ankle-boot")
PHOTOS = ("astronaut", "brick", "camera", "chelsea", "coffee", "coins", "colorwheel", "grass", "gravel",
          "horse", "hubble_deep_field", "immunohistochemistry", "logo", "moon", "page", "retina", "rocket", "text")


def read_fashion_mnist(split: str = "t10k", folder: str = FASHION_DIR) -> tuple[np.ndarray, np.ndarray]:
    """(N, 28, 28) uint8 images and (N,) labels from the IDX files."""
    images_path = os.path.join(folder, f"{split}-images-idx3-ubyte.gz")
    labels_path = os.path.join(folder, f"{split}-labels-idx1-ubyte.gz")
    if not os.path.exists(images_path):
        raise FileNotFoundError(f"{images_path} not found: install the Debian package dataset-fashion-mnist "
                                "(infra/setup.sh does)")
    with gzip.open(images_path) as fh:
        images = np.frombuffer(fh.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(labels_path) as fh:
        labels = np.frombuffer(fh.read(), np.uint8, offset=8)
    return images, labels


def photo(name: str) -> Image.Image:
    import skimage.data

    array = np.asarray(getattr(skimage.data, name)(), dtype=None)
    if array.dtype == bool:
        array = array.astype(np.uint8) * 255
    if array.dtype != np.uint8:
        array = (255 * (array - array.min()) / max(float(np.ptp(array)), 1e-9)).astype(np.uint8)
    return Image.fromarray(array)


def build_demo_catalogue(root: str, fashion_per_class: int = 60, seed: int = 0) -> dict[str, int]:
    """Write the demo catalogue below ``root`` (a local folder); returns counts by kind.

    Layout: ``fashion/<class>/<index>.png``, ``photos/<name>.jpg``, plus a README and one corrupt
    file, so a first run shows skipping and rejection too.
    """
    rng = np.random.default_rng(seed)
    images, labels = read_fashion_mnist()
    counts = {"fashion": 0, "photos": 0, "other": 0}
    for label, cls in enumerate(FASHION_CLASSES):
        folder = os.path.join(root, "fashion", cls)
        os.makedirs(folder, exist_ok=True)
        picks = rng.choice(np.flatnonzero(labels == label), size=fashion_per_class, replace=False)
        for index in sorted(picks):
            Image.fromarray(images[index]).save(os.path.join(folder, f"{index:05d}.png"))
            counts["fashion"] += 1
    os.makedirs(os.path.join(root, "photos"), exist_ok=True)
    for name in PHOTOS:
        image = photo(name)
        if image.mode == "RGBA":  # keep the alpha channel: decoding composites it on white
            image.save(os.path.join(root, "photos", f"{name}.png"))
        else:
            image.save(os.path.join(root, "photos", f"{name}.jpg"), quality=92)
        counts["photos"] += 1
    with open(os.path.join(root, "README.txt"), "w") as fh:
        fh.write("imgest demo catalogue: Fashion-MNIST test images by class, and scikit-image photos.\n")
    buffer = io.BytesIO()
    photo("coffee").save(buffer, "JPEG")
    with open(os.path.join(root, "photos", "truncated.jpg"), "wb") as fh:
        fh.write(buffer.getvalue()[:2000])  # cut mid-scan: recorded as rejected, the run goes on
    counts["other"] = 2
    return counts


def product_photos(n: int, seed: int = 0) -> dict[str, bytes]:
    """A product catalogue from real photos: scaled to 800-2000 px, cropped, JPEG at quality 85-95.

    Like a real one it is mixed: every third JPEG is progressive, every fifth object is stored sideways with
    an EXIF orientation tag (decoders must turn it upright), and every tenth is a PNG cut-out with an alpha
    channel (the product on a transparent background).
    """
    rng = np.random.default_rng(seed)
    bases = [photo(name).convert("RGB") for name in PHOTOS]
    out = {}
    for i in range(n):
        image = bases[i % len(bases)]
        side = int(rng.integers(800, 2001))
        scaled = image.resize((side, max(1, int(side * image.height / image.width))), Image.Resampling.BICUBIC)
        w, h = scaled.size
        left, top = int(rng.integers(0, max(1, w // 10))), int(rng.integers(0, max(1, h // 10)))
        crop = scaled.crop((left, top, w - left, h - top))
        buf = io.BytesIO()
        if i % 10 == 7:
            mask = Image.new("L", crop.size, 0)
            ImageDraw.Draw(mask).ellipse((crop.width // 10, crop.height // 10, crop.width * 9 // 10,
                                          crop.height * 9 // 10), fill=255)
            crop.putalpha(mask)
            crop.save(buf, "PNG")
            out[f"p/{i:05d}.png"] = buf.getvalue()
            continue
        exif = Image.Exif()
        if i % 5 == 1:  # stored turned a quarter anticlockwise; orientation 6 says: turn 90 clockwise to show
            crop, exif[ExifTags.Base.Orientation] = crop.transpose(Image.Transpose.ROTATE_90), 6
        crop.save(buf, "JPEG", quality=int(rng.integers(85, 96)), progressive=bool(i % 3 == 0), exif=exif)
        out[f"p/{i:05d}.jpg"] = buf.getvalue()
    return out

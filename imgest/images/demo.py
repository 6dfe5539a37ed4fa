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


def write_demo_metadata(root: str, path: str) -> int:
    """The demo catalogue's text, as a shop keeps it beside its images: one CSV row per image under ``root``
    with a `title` (the class and the picture's number, "ankle boot 03217"; a photo's name) and a `category`
    (the Fashion-MNIST class; "photo"). Returns the rows written."""
    import csv

    rows = []
    for cls in FASHION_CLASSES:
        for name in sorted(os.listdir(os.path.join(root, "fashion", cls))):
            rows.append({"item_id": f"fashion/{cls}/{name}", "title": f"{cls.replace('-', ' ')} {name.split('.')[0]}",
                         "category": cls})
    for name in sorted(os.listdir(os.path.join(root, "photos"))):
        rows.append({"item_id": f"photos/{name}", "title": name.split(".")[0].replace("_", " "), "category": "photo"})
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=("item_id", "title", "category"))
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)


def product_photos(n: int, seed: int = 0, sides: tuple[int, int] = (800, 2000)) -> dict[str, bytes]:
    """A product catalogue from real photos: scaled to `sides` (800-2000 px), cropped, JPEG at quality 85-95.

    Like a real one it is mixed: every third JPEG is progressive, every fifth object is stored sideways with
    an EXIF orientation tag (decoders must turn it upright), and every tenth is a PNG cut-out with an alpha
    channel (the product on a transparent background).
    """
    rng = np.random.default_rng(seed)
    bases = [photo(name).convert("RGB") for name in PHOTOS]
    out = {}
    for i in range(n):
        image = bases[i % len(bases)]
        side = int(rng.integers(sides[0], sides[1] + 1))
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


# What a product title says beside the class: composed so titles are specific (a class name alone is too
# coarse to search by), with words a shopper would use that the class name does not contain.
COLOURS = ("black", "white", "red", "navy", "olive", "beige", "grey", "mustard")
MATERIALS = {"t-shirt": ("cotton", "organic cotton", "linen"), "trouser": ("denim", "chino", "wool"),
             "pullover": ("merino", "cashmere", "cotton knit"), "dress": ("silk", "jersey", "linen"),
             "coat": ("wool", "down-filled", "waxed cotton"), "sandal": ("leather", "cork", "rubber"),
             "shirt": ("oxford cotton", "flannel", "poplin"), "sneaker": ("canvas", "mesh", "suede"),
             "bag": ("leather", "nylon", "canvas"), "ankle-boot": ("suede", "leather", "waterproof leather")}
DETAILS = {"t-shirt": ("crew neck, short sleeves", "v-neck tee", "graphic print tee"),
           "trouser": ("slim fit pants", "wide-leg pants", "tapered trousers"),
           "pullover": ("crew neck jumper", "cable knit sweater", "roll neck sweater"),
           "dress": ("midi dress", "wrap dress", "summer maxi dress"),
           "coat": ("parka with hood", "double-breasted overcoat", "winter jacket"),
           "sandal": ("open-toe sandal", "strappy flat sandal", "slide sandal"),
           "shirt": ("button-down shirt", "long-sleeve shirt", "work shirt"),
           "sneaker": ("low-top trainers", "running shoes", "lace-up trainers"),
           "bag": ("tote bag", "crossbody bag", "backpack"),
           "ankle-boot": ("chelsea boot", "lace-up ankle boot", "heeled bootie")}


def product_metadata(labels: dict[str, int], images_per_product: int = 2, seed: int = 0) -> list[dict]:
    """Metadata rows for catalogue items of known Fashion-MNIST classes: product_id (consecutive items of a
    class share one), a title composed from colour, material and a detail, a caption, category and price."""
    rng = np.random.default_rng(seed)
    rows, by_class = [], {}
    for item, label in sorted(labels.items()):
        cls = FASHION_CLASSES[label]
        n = by_class.setdefault(cls, [0])
        product = f"{cls}-{n[0] // images_per_product:04d}"
        if n[0] % images_per_product == 0:
            colour, material = COLOURS[rng.integers(len(COLOURS))], MATERIALS[cls][rng.integers(3)]
            detail, price = DETAILS[cls][rng.integers(3)], round(float(rng.uniform(9, 240)), 2)
            by_class[cls + "/current"] = (colour, material, detail, price)
        colour, material, detail, price = by_class[cls + "/current"]
        view = ("front view", "back view", "detail shot", "on a model")[n[0] % 4]
        article = "an" if colour[0] in "aeiou" else "a"
        rows.append({"item_id": item, "product_id": product, "title": f"{colour} {material} {detail}",
                     "caption": f"{view} of {article} {colour} {cls.replace('-', ' ')}", "category": cls,
                     "price": price})
        n[0] += 1
    return rows


def planted_duplicates(kind: str, originals: int, copies: int,
                       seed: int = 0) -> tuple[dict[str, bytes], dict[str, str]]:
    """A catalogue with copies planted in it, for measuring duplicate detection: (files by key, the original
    key of each copy's key). The copies are the kinds a shop's catalogue collects, in turn: a JPEG re-encode at
    quality 60-70 (alpha composited on white), a resize to 0.5-2x, a crop of 3-8% per side.

    kind "photos": distinct product-sized photos (scikit-image's, and the halves of the wider ones), 800-1600 px
    JPEGs, every fourth a PNG cut-out with an alpha channel. kind "art": 64 px product art with transparency
    (Fashion-MNIST items coloured, the background transparent), PNGs."""
    rng = np.random.default_rng(seed)
    if kind == "photos":
        bases = []
        for name in PHOTOS:
            image = photo(name).convert("RGB")
            bases.append(image)
            if image.width >= 1.3 * image.height:  # a wide photo's two halves are two pictures
                bases += [image.crop((0, 0, image.width // 2, image.height)),
                          image.crop((image.width // 2, 0, image.width, image.height))]
        if originals > len(bases):
            raise ValueError(f"at most {len(bases)} distinct photos, asked for {originals}")
        pictures = []
        for i, image in enumerate(bases[:originals]):
            side = int(rng.integers(800, 1601))
            scaled = image.resize((side, max(1, round(side * image.height / image.width))), Image.Resampling.BICUBIC)
            if i % 4 == 3:
                mask = Image.new("L", scaled.size, 0)
                ImageDraw.Draw(mask).ellipse((scaled.width // 12, scaled.height // 12, scaled.width * 11 // 12,
                                              scaled.height * 11 // 12), fill=255)
                scaled.putalpha(mask)
            pictures.append(scaled)
    elif kind == "art":
        images, labels = read_fashion_mnist()
        picks = [int(i) for label in range(len(FASHION_CLASSES))
                 for i in rng.choice(np.flatnonzero(labels == label), size=-(-originals // len(FASHION_CLASSES)),
                                     replace=False)][:originals]
        pictures = []
        for index in picks:
            alpha = Image.fromarray(images[index]).resize((64, 64), Image.Resampling.BICUBIC)
            colour = tuple(int(c) for c in rng.integers(0, 200, size=3))
            art = Image.new("RGBA", (64, 64), colour + (255,))
            art.putalpha(alpha)
            pictures.append(art)
    else:
        raise ValueError(f"kind must be photos or art, got {kind!r}")

    def save(image: Image.Image, jpeg_quality: int | None = None) -> tuple[bytes, str]:
        buf = io.BytesIO()
        if jpeg_quality is None and (image.mode == "RGBA" or kind == "art"):
            image.save(buf, "PNG")
            return buf.getvalue(), "png"
        if image.mode == "RGBA":
            white = Image.new("RGBA", image.size, (255, 255, 255, 255))
            image = Image.alpha_composite(white, image)
        image.convert("RGB").save(buf, "JPEG", quality=jpeg_quality or 92)
        return buf.getvalue(), "jpg"

    files, planted = {}, {}
    keys = []
    for i, image in enumerate(pictures):
        data, ext = save(image)
        keys.append(f"{kind}/{i:04d}.{ext}")
        files[keys[-1]] = data
    for c in range(copies):
        i = int(c * len(pictures) / copies) if copies <= len(pictures) else c % len(pictures)
        image, how = pictures[i], ("jpeg", "resize", "crop")[c % 3]
        if how == "jpeg":
            data, ext = save(image, int(rng.integers(60, 71)))
        elif how == "resize":
            scale = float(rng.uniform(0.5, 2.0))
            data, ext = save(image.resize((max(8, round(image.width * scale)), max(8, round(image.height * scale))),
                                          Image.Resampling.LANCZOS))
        else:
            w, h = image.size
            box = [round(f * s) for f, s in zip(rng.uniform(0.03, 0.08, size=4), (w, h, w, h))]
            data, ext = save(image.crop((box[0], box[1], w - box[2], h - box[3])))
        key = f"{kind}/copies/{c:04d}-{how}.{ext}"
        files[key], planted[key] = data, keys[i]
    return files, planted

"""Decoding: every mode to RGB, EXIF orientation, and a named reason for every bad file."""

import numpy as np
import pytest

from imgest.images.decode import DecodeError, decode_image
from tests.helpers import gradient, hostile_files, jpeg_bytes, png_bytes

FILES = hostile_files()


@pytest.mark.parametrize("name", ["ok.jpg", "cmyk.jpg", "alpha.png", "palette.png", "palette-transparent.png",
                                  "sixteen-bit.png", "animated.gif", "rotated.jpg", "grey.png"])
def test_every_mode_decodes_to_rgb(name):
    image = decode_image(FILES[name])
    assert image.mode == "RGB"
    assert image.size[0] > 0 and image.size[1] > 0


def test_exif_orientation_is_applied():
    assert decode_image(FILES["rotated.jpg"]).size == (20, 40)


def test_transparent_pixels_become_white():
    assert np.asarray(decode_image(FILES["alpha.png"])).min() == 255
    assert np.asarray(decode_image(FILES["palette-transparent.png"])).min() == 255


def test_sixteen_bit_is_scaled_not_clipped():
    # 32768 of 65535 is mid grey: 32768 / 65535 * 255 = 127.5 -> 128; Pillow's convert("RGB") clips to 255
    assert np.asarray(decode_image(FILES["sixteen-bit.png"])).mean() == 128


def test_animated_gives_first_frame():
    pixel = np.asarray(decode_image(FILES["animated.gif"]))[0, 0]
    assert pixel[0] > 200 and pixel[2] < 50  # red, not the blue second frame


@pytest.mark.parametrize("name,expected", [
    ("empty.jpg", "EmptyFile"),
    ("truncated.jpg", "OSError"),
    ("not-an-image.png", "UnidentifiedImageError"),
])
def test_bad_files_raise_with_class_and_message(name, expected):
    with pytest.raises(DecodeError) as err:
        decode_image(FILES[name])
    assert str(err.value).startswith(expected)


def test_decompression_bomb_limit():
    with pytest.raises(DecodeError, match=r"DecompressionBombError: 400x400 = 160000 pixels exceeds the limit"):
        decode_image(FILES["huge.png"], max_pixels=100_000)
    assert decode_image(FILES["huge.png"], max_pixels=200_000).size == (400, 400)


@pytest.mark.slow("real weights")
def test_reduced_jpeg_decode_gives_nearly_the_same_embeddings_on_real_photos():
    """Product-sized JPEGs (real photos scaled to 1000-1700 px; baseline and progressive, one with an EXIF
    rotation; fine textures included) decoded at reduced size in the DCT domain give nearly the embeddings
    of the full decode with the packaged Lite0 weights (dense fine textures move most); retrieval across a
    real shift is unchanged (bench/bench_runtimes.py), so the fast path is not part of the model id."""
    import io

    from PIL import Image

    from imgest import encoders
    from imgest.images.demo import PHOTOS, photo

    encoder = encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")
    full, fast, sizes = [], [], []
    for n, name in enumerate(PHOTOS):
        image = photo(name).convert("RGB")
        side = 1000 + 50 * n
        image = image.resize((side, int(side * image.height / image.width)), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        exif = Image.Exif()
        if n == 3:
            exif[0x0112] = 6  # rotate 90: the reduced decode must be rotated the same way
        image.save(buf, "JPEG", quality=85 + n % 11, progressive=n % 2 == 1, exif=exif.tobytes())
        data = buf.getvalue()
        reduced = decode_image(data, min_side=encoder.decode_side)
        sizes.append((decode_image(data).size, reduced.size))
        assert min(reduced.size) >= encoder.decode_side
        full.append(encoder.preprocess(decode_image(data)))
        fast.append(encoder.preprocess(reduced))
    # every photo whose shorter side is at least 2 x 256 was reduced
    assert all(r[0] < f[0] for f, r in sizes if min(f) >= 2 * encoder.decode_side)
    assert sum(r[0] < f[0] for f, r in sizes) >= 16
    a, b = encoder.encode_images(np.stack(full)), encoder.encode_images(np.stack(fast))
    cosines = np.sum(a * b, axis=1)
    assert cosines.min() >= 0.97 and cosines.mean() >= 0.995, (cosines, sizes)


def test_reduced_decode_keeps_the_needed_side_and_only_touches_jpegs():
    big = jpeg_bytes(gradient(3, (1200, 800)))
    assert decode_image(big, min_side=256).size == (600, 400)  # 1/2; 1/4 would leave less than 256
    assert decode_image(big, min_side=128).size == (300, 200)  # 1/4: 200 >= 128; 1/8 would leave 100
    assert decode_image(big, min_side=64).size == (150, 100)  # 1/8, the most libjpeg scales
    assert decode_image(big, min_side=401).size == (1200, 800)  # 1/2 would leave less than 401
    png = png_bytes(gradient(3, (1200, 800)))
    assert decode_image(png, min_side=256).size == (1200, 800)


def test_the_product_catalogue_is_mixed_like_a_real_one():
    """The benchmark catalogue has what real ones have: product-sized JPEGs, progressive ones, sideways
    ones with an EXIF orientation, PNG cut-outs with alpha; each decodes upright onto white."""
    import io

    from PIL import Image

    from imgest.images.demo import product_photos

    files = product_photos(12)
    assert [k for k in files if k.endswith(".png")] == ["p/00007.png"]
    for key, data in files.items():
        stored, decoded = Image.open(io.BytesIO(data)), decode_image(data)
        assert 800 <= max(decoded.size) <= 2000 and decoded.mode == "RGB"
        sideways = stored.getexif().get(0x0112) == 6
        assert sideways == (int(key[2:7]) % 5 == 1 and key.endswith(".jpg"))
        assert decoded.size == (stored.size[::-1] if sideways else stored.size)
        if key.endswith(".png"):
            assert stored.mode == "RGBA" and decoded.getpixel((0, 0)) == (255, 255, 255)
        else:
            assert bool(stored.info.get("progressive")) == (int(key[2:7]) % 3 == 0)

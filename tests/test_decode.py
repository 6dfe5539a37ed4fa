"""Decoding: every mode to RGB, EXIF orientation, and a named reason for every bad file."""

import numpy as np
import pytest

from imgest.tasks.decode import DecodeError, decode_image
from tests.helpers import hostile_files

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

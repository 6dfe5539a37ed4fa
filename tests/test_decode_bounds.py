"""Decoding stays bounded on hostile images: a 16-bit 8000 x 8000 PNG (under 1 MB on disk) costs its decoded
size plus the output, not a float copy of the whole image; a declared size over the limit is refused before
any pixel is decoded, with a message naming the limit."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image

from imgest.images.decode import DecodeError, decode_image, to_rgb
from imgest.names import DEFAULT_MAX_PIXELS
from tests.helpers import png_bytes

SIDE = 8000
MB = 1 << 20


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header(width: int, height: int, depth: int = 16, rows: int = 0) -> bytes:
    """A greyscale PNG declaring width x height; `rows` rows of a left-to-right ramp (0 to the top value),
    compressed as they are written, so even 8000 x 8000 x 16 bits costs the test a few MB."""
    dtype = ">u2" if depth == 16 else "u1"
    row = b"\x00" + np.linspace(0, 2 ** depth - 1, width).astype(dtype).tobytes()
    deflate, idat = zlib.compressobj(9), bytearray()
    for _ in range(rows):
        idat += deflate.compress(row)
    idat += deflate.flush()
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, 0, 0, 0, 0))
            + _chunk(b"IDAT", bytes(idat)) + _chunk(b"IEND", b""))


# The subprocess imports imgest.images.decode only; the peak RSS it adds while decoding is the measure.
PROBE = """
import json, resource, sys
import numpy as np
from imgest.images.decode import decode_image
data = open(sys.argv[1], "rb").read()
min_side = int(sys.argv[2]) or None
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
image = decode_image(data, min_side=min_side)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
row = np.asarray(image)[image.height // 2]
print(json.dumps({"mode": image.mode, "size": image.size, "added_mb": (after - before) / 1024,
                  "left": row[0].tolist(), "middle": row[len(row) // 2].tolist(), "right": row[-1].tolist()}))
"""


def _decode_in_subprocess(path, min_side: int | None) -> dict:
    env = {**os.environ, "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", "Haswell")}
    done = subprocess.run([sys.executable, "-c", PROBE, str(path), str(min_side or 0)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def sixteen_bit_8000(tmp_path_factory):
    path = tmp_path_factory.mktemp("bounds") / "ramp16.png"
    path.write_bytes(png_header(SIDE, SIDE, 16, rows=SIDE))
    assert path.stat().st_size < 2 * MB
    return path


@pytest.mark.parametrize("min_side, expected_size, limit_mb", [
    # The encoder's path: reduced by 8000 // (2 x 256) = 15 to 533 x 533 while scaled to 8 bits. Pillow's
    # decoded I;16 image (8000^2 x 2 B = 122 MB) is the cost; 300 MB is the stated limit (was +1.6 GB: a
    # float64 copy of the whole image and its temporaries).
    (256, [533, 533], 300),
    # No min_side: the full-size RGB output (8000^2 x 3 B = 183 MB) + the decoded I;16 (122 MB) + the 8-bit
    # grey between them (61 MB) = 366 MB; 600 MB is the stated limit.
    (None, [SIDE, SIDE], 600),
])
@pytest.mark.slow("a subprocess")
def test_a_16_bit_8000_square_png_decodes_within_a_stated_peak(sixteen_bit_8000, min_side, expected_size, limit_mb):
    result = _decode_in_subprocess(sixteen_bit_8000, min_side)
    assert result["mode"] == "RGB" and result["size"] == expected_size
    assert result["added_mb"] < limit_mb, result
    # a ramp from 0 to 65535 scaled, not clipped: black, mid grey, white
    assert result["left"] == [0, 0, 0] and result["right"] == [255, 255, 255]
    assert all(abs(v - 128) <= 1 for v in result["middle"])


def test_the_reduced_16_bit_image_is_the_full_one_box_averaged():
    ramp = np.linspace(0, 65535, 2048)[None, :] * np.linspace(0.2, 1.0, 1024)[:, None]
    data = png_bytes(Image.fromarray(ramp.astype(np.uint16)))
    full = decode_image(data)
    reduced = decode_image(data, min_side=128)  # 1024 // (2 x 128) = 4: 512 x 256, shorter side 2 x 128
    assert full.size == (2048, 1024) and reduced.size == (512, 256) and reduced.mode == "RGB"
    expected = np.asarray(full.convert("L").reduce(4), np.int16)
    assert np.abs(np.asarray(reduced.convert("L"), np.int16) - expected).max() <= 1
    assert decode_image(data, min_side=512).size == (2048, 1024)  # 1024 < 4 x 512: left as it is


@pytest.mark.parametrize("mode, dtype, top", [("I;16", np.uint16, 65535), ("I", np.int32, 65535),
                                              ("I", np.int32, 255), ("F", np.float32, 255)])
def test_wide_samples_are_scaled_band_by_band_as_one_array_would_be(mode, dtype, top):
    rng = np.random.default_rng(0)
    array = rng.integers(0, top + 1, (1100, 1000)).astype(dtype)  # 1.1M pixels: two bands of 2^20
    image = Image.fromarray(array) if mode != "I;16" else Image.frombytes("I;16", (1000, 1100), array.tobytes())
    assert image.mode == mode
    expected = np.clip(array.astype(np.float64) / (65535.0 if top > 255 else 255.0) * 255.0 + 0.5, 0, 255)
    assert (np.asarray(to_rgb(image))[..., 0] == expected.astype(np.uint8)).all()


def test_pillows_guard_stays_set_to_imgests_limit():
    assert Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS >= DEFAULT_MAX_PIXELS


@pytest.mark.parametrize("width, height", [(100_000, 100_000), (12_000, 12_000)])
def test_a_bomb_is_refused_from_its_header_naming_the_limit(width, height):
    """100k x 100k is past Pillow's own guard (twice its MAX_IMAGE_PIXELS, refused inside open()); 12k x 12k
    passes Pillow's and meets imgest's. Neither file holds any pixel data: a decode that started would fail
    on the missing rows with another message."""
    with pytest.raises(DecodeError, match=rf"^DecompressionBombError: .*limit of {DEFAULT_MAX_PIXELS}.*--max-pixels"):
        decode_image(png_header(width, height, 8))
    with pytest.raises(DecodeError, match=r"^DecompressionBombError: .*limit of 1000000 "):
        decode_image(png_header(width, height, 8), max_pixels=1_000_000)


@pytest.mark.slow("a subprocess")
def test_a_larger_max_pixels_raises_pillows_guard_with_it():
    code = ("from PIL import Image; from imgest.images.decode import decode_image; "
            "from tests.helpers import png_bytes, solid; "
            "decode_image(png_bytes(solid(1, (8, 8), 'L')), max_pixels=300_000_000); "
            "print(Image.MAX_IMAGE_PIXELS)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == 300_000_000

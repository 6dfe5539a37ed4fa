"""Whether two images are the same picture: one is the other re-encoded, resized, padded or cropped by up to a
fifth of each side. Calibration uses it to keep copies a catalogue already holds out of its "different item"
pairs (a perceptual hash misses crops); a calibrated run uses it to confirm each near pair before joining it.

Both pictures are reduced to their content (tasks/duplicates/hashes.py), the wider-placed one to SIDE pixels
wide, and the other is slid over it at each scale of SCALES (skimage's match_template: normalised
cross-correlation at every placement), both ways round. The best correlation decides the shape: on
scikit-image's photos and on Fashion-MNIST art, copies scored 0.96-1.0 and every pair of different pictures
at most 0.93. Correlation is blind to colour, so the two pictures' median colours must also agree within
COLOUR (of 255) per channel: the same shirt in red and in navy is two products.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from imgest.tasks.duplicates.hashes import content

SIDE = 48
SCALES = tuple(round(0.8 + 0.02 * n, 2) for n in range(11))  # the copy's width as a share of the original's: 0.80-1.0
SAME = 0.95  # correlation at or above which two images are one shape
COLOUR = 40  # largest difference of the median colours, per channel (copies of photos measured up to 32)


def correlation(a: Image.Image, b: Image.Image) -> float:
    """The best normalised cross-correlation of one image's content placed inside the other's."""
    from skimage.feature import match_template

    best = -1.0
    a, b = content(a), content(b)
    for outer, inner in ((a, b), (b, a)):
        height = max(4, round(SIDE * outer.height / outer.width))
        frame = np.asarray(outer.resize((SIDE, height), Image.Resampling.BILINEAR), np.float32)
        for scale in SCALES:
            width = max(4, round(SIDE * scale))
            inner_height = max(4, round(width * inner.height / inner.width))
            if inner_height > height:
                continue
            patch = np.asarray(inner.resize((width, inner_height), Image.Resampling.BILINEAR), np.float32)
            if patch.std() == 0 or frame.std() == 0:
                continue  # a blank picture correlates with nothing
            best = max(best, float(match_template(frame, patch).max()))
    return best


def colour_gap(a: Image.Image, b: Image.Image) -> float:
    """The largest per-channel difference of the two pictures' median colours (0-255) over their non-margin
    pixels: the product's colour, whatever margin or crop surrounds it."""
    medians = []
    for image in (a, b):
        rgb = np.asarray(image.convert("RGB"), np.float32).reshape(-1, 3)
        ink = rgb[np.asarray(image.convert("L")).reshape(-1) < 255 - 32]
        medians.append(np.median(ink if len(ink) else rgb, axis=0))
    return float(np.abs(medians[0] - medians[1]).max())


def same_picture(a: Image.Image, b: Image.Image) -> bool:
    return colour_gap(a, b) <= COLOUR and correlation(a, b) >= SAME

"""How kept pixels are stored: each codec, quality and shape of copy against the originals, on the parity sample.

    .venv/bin/python bench/bench_kept_codec.py [--model efficientnet-lite0-gem] [--decoder simplejpeg] [--side 256]

For each candidate: the 256 product photos of the parity sample (`imgest.encoders.parity`: real photos at 800-2000
px, JPEG and PNG cut-outs) are decoded as an ingest decodes them for the model (its decode side, the given JPEG
decoder), a copy is made from those pixels, and the model's embeddings from the copies are compared with its
embeddings from the originals by the reduced-precision gate (mean cosine >= 0.998, 1st percentile >= 0.99, mean
overlap@10 >= 0.90); beside them, the copies' mean bytes and the core-ms a decode worker spends on one (decode and
preprocess, this thread's CPU time). Torch fp32, one process.

Candidates: the decode's own pixels (DCT-scaled, not resampled) as JPEG at several qualities and chroma
subsamplings, and as lossless WebP; the same resampled to exactly the side (Lanczos) as JPEG and lossless PNG.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CANDIDATES = [  # (shape, format, save options)
    ("as decoded", "JPEG", {"quality": 90, "subsampling": "4:2:0"}),
    ("as decoded", "JPEG", {"quality": 90, "subsampling": "4:4:4"}),
    ("as decoded", "JPEG", {"quality": 95, "subsampling": "4:4:4"}),
    ("as decoded", "JPEG", {"quality": 97, "subsampling": "4:4:4"}),
    ("as decoded", "JPEG", {"quality": 98, "subsampling": "4:4:4"}),
    ("as decoded", "WEBP", {"lossless": True, "method": 1}),
    ("resampled to the side", "JPEG", {"quality": 97, "subsampling": "4:4:4"}),
    ("resampled to the side", "PNG", {}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet-lite0-gem")
    parser.add_argument("--decoder", default="simplejpeg")
    parser.add_argument("--side", type=int, default=256)
    args = parser.parse_args()
    from PIL import Image

    from imgest import encoders
    from imgest.encoders import parity
    from imgest.images import kept
    from imgest.images.decode import decode_image

    encoder = encoders.load(encoders.resolve(args.model), "cpu")
    need, files = encoder.decode_side, parity._files()

    def embed(images) -> np.ndarray:
        return np.concatenate([encoder.encode_images(np.stack([encoder.preprocess(i) for i in images[j:j + 8]]))
                               for j in range(0, len(images), 8)])

    reference = embed([decode_image(d, min_side=need, decoder=args.decoder) for d in files])
    decoded = [decode_image(d, min_side=max(need, args.side), decoder=args.decoder) for d in files]
    rows = []
    for shape, fmt, options in CANDIDATES:
        copies = []
        for image in decoded:
            if shape == "as decoded":
                factor = kept.reduction(image.size, args.side)
                small = image.reduce(factor) if factor > 1 else image
            else:
                scale = args.side / min(image.size)
                small = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                                     Image.Resampling.LANCZOS) if scale < 1 else image
            out = io.BytesIO()
            small.save(out, fmt, **options)
            copies.append(out.getvalue())
        start = time.thread_time()
        images = [decode_image(c, min_side=need) for c in copies]
        pixels = [encoder.preprocess(i) for i in images]
        decode_ms = (time.thread_time() - start) * 1e3 / len(copies)
        ours = embed(images)
        cosines = parity._cosines(reference, ours)
        figures = {"mean_cosine": round(float(cosines.mean()), 5),
                   "p1_cosine": round(float(np.percentile(cosines, 1)), 5),
                   "overlap": round(parity.neighbour_overlap(reference, ours), 4)}
        del pixels
        row = {"shape": shape, "format": fmt, "options": options, **figures,
               "passes": parity.passes(figures, "bf16"),
               "kB_per_copy": round(sum(map(len, copies)) / len(copies) / 1024, 1),
               "decode_core_ms": round(decode_ms, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"model": args.model, "decoder": args.decoder, "side": args.side, "images": len(files),
                      "candidates": rows}))


if __name__ == "__main__":
    main()

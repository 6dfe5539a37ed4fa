"""Thumbnails of served items for the search page: read by the service under the model's catalogue root (the
browser needs no credentials and never names a URL), size-capped, and kept in a small cache."""

from __future__ import annotations

import io
import threading
from collections import OrderedDict

from imgest.images.decode import decode_image
from imgest.state.catalogue_images import CatalogueImages
from imgest.storage import Location

MAX_SOURCE_BYTES = 50 << 20  # a catalogue image larger than this gets no thumbnail
MAX_SOURCE_PIXELS = 100_000_000
SIDE = 256  # the longer side of a thumbnail
KEEP_BYTES = 64 << 20  # thumbnails kept, in JPEG bytes


class Thumbnails:
    """JPEG thumbnails by (model, item uri), the least recently shown dropped past KEEP_BYTES."""

    def __init__(self, store: Location, side: int = SIDE, keep_bytes: int = KEEP_BYTES):
        self.store, self.side, self.keep_bytes = store, side, keep_bytes
        self._readers: dict[str, CatalogueImages] = {}
        self._kept: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, slug: str, uri: str) -> bytes:
        """The thumbnail of one of a model's items; the catalogue's errors (no recorded root, a uri outside it,
        too large, not an image) propagate for the caller to answer."""
        with self._lock:
            if (slug, uri) in self._kept:
                self._kept.move_to_end((slug, uri))
                return self._kept[(slug, uri)]
        if slug not in self._readers:
            self._readers[slug] = CatalogueImages(self.store, slug)
        image = decode_image(self._readers[slug].read(uri, limit=MAX_SOURCE_BYTES), MAX_SOURCE_PIXELS,
                             min_side=self.side)
        image.thumbnail((self.side, self.side))
        out = io.BytesIO()
        image.save(out, "JPEG", quality=85)
        data = out.getvalue()
        with self._lock:
            if (slug, uri) not in self._kept:
                self._kept[(slug, uri)] = data
                self._bytes += len(data)
            while self._bytes > self.keep_bytes and self._kept:
                self._bytes -= len(self._kept.popitem(last=False)[1])
        return data

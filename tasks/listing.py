"""List a catalogue through fsspec and keep the image files, counting what is skipped."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

from imgest.storage import Location, ObjectInfo, StorageError, open_location, redact

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".jpe", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff"})


@dataclass
class Listing:
    catalogue: str
    objects: list[ObjectInfo]
    skipped: int = 0  # not an image by its extension
    skipped_examples: list[str] = field(default_factory=list)
    not_regular: int = 0  # FIFOs, devices, sockets, dangling links: never read (a read could block for ever)
    not_regular_examples: list[str] = field(default_factory=list)


def is_image_key(key: str) -> bool:
    return posixpath.splitext(key)[1].lower() in IMAGE_EXTENSIONS


def list_catalogue(catalogue_url: str) -> Listing:
    """Every image object below the catalogue root; the item id is its key relative to the root."""
    loc: Location = open_location(catalogue_url, must_exist=True, what="catalogue")
    listing = Listing(catalogue=loc.url, objects=[])
    for obj in loc.walk():
        if not obj.regular:
            listing.not_regular += 1
            if len(listing.not_regular_examples) < 10:
                listing.not_regular_examples.append(obj.key)
        elif is_image_key(obj.key):
            listing.objects.append(obj)
        else:
            listing.skipped += 1
            if len(listing.skipped_examples) < 10:
                listing.skipped_examples.append(obj.key)
    return listing


def check_apart(catalogue: Location, store: Location) -> None:
    """Refuse a store inside its own catalogue (or the reverse): its files would be listed as images."""
    a, b = catalogue.uri().rstrip("/") + "/", store.uri().rstrip("/") + "/"
    if b.startswith(a) or a.startswith(b):
        raise StorageError(f"store {redact(store.url)} and catalogue {redact(catalogue.url)} overlap: the store's "
                           "own files would be listed as catalogue images; put the store outside the catalogue")

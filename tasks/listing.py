"""List a catalogue through fsspec and keep the image files, counting what is skipped."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

from prefect import task
from prefect.cache_policies import NO_CACHE

from imgest.storage import Location, ObjectInfo, open_location
from imgest.tasks.policy import IO_RETRIES, LIST_TIMEOUT_S

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".jpe", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff"})


@dataclass
class Listing:
    catalogue: str
    objects: list[ObjectInfo]
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)


def is_image_key(key: str) -> bool:
    return posixpath.splitext(key)[1].lower() in IMAGE_EXTENSIONS


def list_catalogue(catalogue_url: str) -> Listing:
    """Every image object below the catalogue root; the item id is its key relative to the root."""
    loc: Location = open_location(catalogue_url, must_exist=True, what="catalogue")
    objects, skipped, examples = [], 0, []
    for obj in loc.walk():
        if is_image_key(obj.key):
            objects.append(obj)
        else:
            skipped += 1
            if len(examples) < 10:
                examples.append(obj.key)
    return Listing(catalogue=loc.url, objects=objects, skipped=skipped, skipped_examples=examples)


@task(name="list-catalogue", cache_policy=NO_CACHE, timeout_seconds=LIST_TIMEOUT_S, **IO_RETRIES)
def list_catalogue_task(catalogue_url: str) -> Listing:
    return list_catalogue(catalogue_url)

"""JPEG decode on the GPU, batched: nvJPEG (`torchvision.io.decode_jpeg(..., device="cuda")`, the optional extra
`imgest[gpu]`) decodes, the tensor path (imgest/images/tensors.py) does the rest on the device.

On when a run's recorded decoder is nvjpeg and its encoder runs on CUDA. Decode threads still read and hash every
object; a plain JPEG (8-bit RGB or grey, within --max-pixels) ships its bytes to the encoder's thread, which
decodes the batch here, whole (nvJPEG has no scaled decode): each image reduced in the DCT domain to the eighths
the CPU decoders would decode it at for the model's decode side, its EXIF orientation read from its header on the
CPU (nvJPEG ignores it) and applied on the device as flips and turns, then resized and cropped as the model's
preprocessing does (`resample_plan`: Pillow's filter in its fixed point). The same pixels as nvjpeg's decode of
one image (imgest/images/decoders.py) through the CPU preprocessing, which is what the decoder gate measures for
it. Only the decode call needs a GPU: the suite runs the rest, and this class, on CPU tensors.

Device memory is budgeted: a batch is decoded in parts whose pixels fit what the device has free (less a share
for the allocator), an image too large for it alone is decoded on the CPU, and an out-of-memory error splits the
part in two instead of giving up on it. Everything nvJPEG refuses (PNG, CMYK, a damaged stream) is decoded by
the CPU path as before, one image at a time, so one odd file never fails the batch.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

from PIL import Image

from imgest.images import decoders, tensors
from imgest.images.decode import JPEG_REDUCING_GAP, DecodeError, decode_image

# Device bytes a decoded pixel can hold while the part is made ready: its RGB bytes (3), the float64 copies the DCT
# scaling pads and maps (2 x 24), and a margin for the passes' outputs and the allocator's rounding.
BYTES_PER_PIXEL = 64
DEVICE_SHARE = 0.8  # of the free device memory, what one decode may take


def plain_jpeg(data: bytes, max_pixels: int) -> bool:
    """A JPEG nvJPEG decodes to the RGB Pillow would give: 8-bit YCbCr/RGB or grey, not CMYK or 12-bit.
    Reads the header only; anything doubtful answers False and takes the CPU path."""
    if data[:3] != b"\xff\xd8\xff":
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data))
            return (image.format == "JPEG" and image.mode in ("RGB", "L")
                    and image.width * image.height <= max_pixels)
    except Exception:  # noqa: BLE001 - a header Pillow cannot read is the CPU path's to reject
        return False


def _header(data: bytes) -> tuple[int, int, int]:
    """(height, width, EXIF orientation) from a JPEG's header: the size as decoded, before any turn."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            turn = image.getexif().get(tensors.ORIENTATION, 1)
    return height, width, turn if isinstance(turn, int) and 1 <= turn <= 8 else 1  # as tensors.orientation


def free_device_memory(device: str) -> int:
    """Bytes a decode may use on `device`: what the driver has free, and what torch's allocator holds unused."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _release(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


class BatchJpegDecoder:
    """Decodes a batch of JPEG bytes on `device` and makes each model-ready with the encoder's `resample_plan`.

    `decode_fn(list of uint8 tensors, device) -> list of CHW uint8 tensors` is torchvision's decode_jpeg (nvJPEG on
    CUDA, libjpeg-turbo on the CPU); `free_memory()` the bytes the device has for it (`free_device_memory`)."""

    def __init__(self, device: str, plan: Callable, preprocess: Callable, max_pixels: int, min_side: int | None,
                 decode_fn: Callable | None = None, free_memory: Callable[[], int] | None = None):
        self.device, self.plan, self.preprocess = device, plan, preprocess
        self.max_pixels, self.min_side = max_pixels, min_side
        self._reduced_to = min_side and JPEG_REDUCING_GAP * min_side  # as decode_image asks the CPU decoders
        self._decode = decode_fn or _torchvision_decoder()
        self.free_memory = free_memory or (lambda: free_device_memory(device))
        self.gpu_decoded = self.fallbacks = self.over_budget = self.splits = 0
        self.largest_part = 0  # the most pixels one decode call held

    @classmethod
    def for_encoder(cls, encoder, max_pixels: int) -> BatchJpegDecoder | None:
        """One for a CUDA encoder with a tensor path (`resample_plan`) when torchvision decodes; else None."""
        device = str(getattr(encoder, "device", "cpu"))
        if not device.startswith("cuda") or not hasattr(encoder, "resample_plan"):
            return None
        try:
            return cls(device, encoder.resample_plan, encoder.preprocess, max_pixels,
                       getattr(encoder, "decode_side", None))
        except (ImportError, OSError, RuntimeError):  # no torchvision, or its image library did not load
            return None

    def budget(self) -> int:
        """The pixels one decode call may hold now."""
        return int(self.free_memory() * DEVICE_SHARE) // BYTES_PER_PIXEL

    def decode(self, blobs: list[bytes]) -> list:
        """Model-ready pixels for each blob, in order: a CHW uint8 tensor on `device`, a NumPy array (the CPU
        path's), or a DecodeError when neither path can read it."""
        out: list = [None] * len(blobs)
        heads: dict[int, tuple[int, int, int]] = {}
        for i, data in enumerate(blobs):
            try:
                heads[i] = _header(data)
            except Exception:  # noqa: BLE001 - a header Pillow cannot read: the CPU path gives the reason
                out[i] = self._cpu(data)
        budget = self.budget()
        part: list[int] = []
        held = 0
        for i, (h, w, _) in heads.items():
            if h * w > budget:  # alone above what the device has free: the CPU path decodes it
                self.over_budget += 1
                out[i] = self._cpu(blobs[i])
                continue
            if part and held + h * w > budget:
                self._part(blobs, heads, part, out)
                part, held = [], 0
            part.append(i)
            held += h * w
        if part:
            self._part(blobs, heads, part, out)
        return out

    def _part(self, blobs: list[bytes], heads: dict, part: list[int], out: list) -> None:
        """Decode and make ready `part` (indices into blobs) in one call; on running out of device memory, each
        half in turn (one image alone: the CPU path)."""
        import torch

        try:
            ready = self._ready([blobs[i] for i in part], [heads[i] for i in part])
        except torch.OutOfMemoryError:
            _release(self.device)
            if len(part) == 1:
                self.over_budget += 1
                out[part[0]] = self._cpu(blobs[part[0]])
                return
            self.splits += 1
            half = len(part) // 2
            self._part(blobs, heads, part[:half], out)
            self._part(blobs, heads, part[half:], out)
            return
        self.largest_part = max(self.largest_part, sum(heads[i][0] * heads[i][1] for i in part))
        for i, image in zip(part, ready):
            if image is None:
                self.fallbacks += 1
                out[i] = self._cpu(blobs[i])
            else:
                self.gpu_decoded += 1
                out[i] = image

    def _ready(self, datas: list[bytes], heads: list[tuple[int, int, int]]) -> list:
        """The part decoded in one call (one by one when the call refuses one image) and made model-ready; None
        for an image the decoder refused or whose plan needs the CPU path."""
        import torch

        raw = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
        try:
            images = self._decode(raw, self.device)
        except torch.OutOfMemoryError:
            raise
        except Exception:  # noqa: BLE001 - one bad image fails the whole call: one by one to find it
            images = [self._one(t) for t in raw]
        upright, plans, where = [], [], []
        for k, (image, (height, width, turn)) in enumerate(zip(images, heads)):
            if image is None:
                continue
            image = tensors.dct_scaled(image, decoders.eighths((width, height), self._reduced_to)[0])
            image = tensors.orient(image, turn)
            plan = self.plan(int(image.shape[1]), int(image.shape[2]))
            if plan is not None:
                upright.append(image)
                plans.append(plan)
                where.append(k)
        result: list = [None] * len(datas)
        if upright:
            for k, ready in zip(where, tensors.model_ready(upright, plans).unbind(0)):
                result[k] = ready
        return result

    def _one(self, raw):
        import torch

        try:
            return self._decode([raw], self.device)[0]
        except torch.OutOfMemoryError:
            raise
        except Exception:  # noqa: BLE001 - the decoder refused it: the CPU path decides
            return None

    def _cpu(self, data: bytes):
        try:
            return self.preprocess(decode_image(data, self.max_pixels, self.min_side))
        except DecodeError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - the model's preprocessing refused it, as in prepare()
            return DecodeError(f"{type(exc).__name__} in preprocessing: {exc}")


def _torchvision_decoder() -> Callable:
    from torchvision.io import ImageReadMode, decode_jpeg

    def decode(raw: list, device: str) -> list:
        return decode_jpeg(raw, mode=ImageReadMode.RGB, device=device)

    return decode

"""Test data builders: hostile image files, small real catalogues, tiny transformers models; a served app."""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import time
from collections.abc import Iterator

import numpy as np
from PIL import Image


def jpeg_bytes(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", **kw)
    return buf.getvalue()


def png_bytes(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG", **kw)
    return buf.getvalue()


def solid(colour, size=(64, 48), mode="RGB") -> Image.Image:
    return Image.new(mode, size, colour)


def gradient(seed: int, size=(64, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    return Image.fromarray(base).resize(size, Image.Resampling.BILINEAR)


def exif_rotated_jpeg() -> bytes:
    """A 40x20 image whose EXIF says 'rotate 90': decoded it must be 20x40."""
    image = gradient(1, (40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW
    return jpeg_bytes(image, exif=exif.tobytes())


def animated_gif() -> bytes:
    frames = [solid((255, 0, 0), (32, 32)).convert("P"), solid((0, 0, 255), (32, 32)).convert("P")]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buf.getvalue()


def hostile_files() -> dict[str, bytes]:
    """Every decoding case the pipeline promises to handle, keyed by file name."""
    cmyk = solid((0, 255, 255, 0), mode="CMYK")  # CMYK red
    rgba = Image.new("RGBA", (32, 32), (255, 0, 0, 0))  # fully transparent: must become white
    palette = solid((0, 128, 0)).convert("P")
    palette_t = Image.new("P", (16, 16), 0)
    palette_t.putpalette([0, 0, 0] * 256)
    palette_t.info["transparency"] = 0
    sixteen = Image.fromarray(np.full((16, 16), 32768, np.uint16))  # mid grey in 16 bits
    good = jpeg_bytes(gradient(7))
    return {
        "ok.jpg": good,
        "cmyk.jpg": jpeg_bytes(cmyk),
        "alpha.png": png_bytes(rgba),
        "palette.png": png_bytes(palette),
        "palette-transparent.png": png_bytes(palette_t, transparency=0),
        "sixteen-bit.png": png_bytes(sixteen),
        "animated.gif": animated_gif(),
        "rotated.jpg": exif_rotated_jpeg(),
        "grey.png": png_bytes(solid(128, mode="L")),
        "empty.jpg": b"",
        "truncated.jpg": good[: len(good) // 2],
        "not-an-image.png": b"this is text, not a PNG\n",
        "huge.png": png_bytes(solid((1, 2, 3), (400, 400))),  # a bomb under max_pixels=100_000
    }


def write_files(root: str, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        path = os.path.join(root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)


def small_catalogue(n: int, seed: int = 0, prefix: str = "img") -> dict[str, bytes]:
    return {f"{prefix}/{i:04d}.jpg": jpeg_bytes(gradient(seed * 10_000 + i)) for i in range(n)}


def ingest_into(catalogue, store, **options) -> dict:
    """One ingest flow run of `catalogue` into `store` (folders or URLs), `options` as IngestConfig's fields: what
    `imgest ingest` runs, called as the Python API is. Returns the run's summary."""
    from imgest.config import IngestConfig
    from imgest.flows.ingest import ingest

    return ingest(IngestConfig(catalogue=str(catalogue), store=str(store), **options))


SENTENCEPIECE_VOCAB = 100  # the phrases below make 111 pieces at most


def train_sentencepiece(path: str) -> str:
    """A unigram SentencePiece model of SENTENCEPIECE_VOCAB pieces trained on product phrases, offline, its special
    pieces where SigLIP's (T5's) are: <pad> 0, </s> 1, <unk> 2, no <s>. Written to `path`."""
    import itertools

    import sentencepiece

    colours = ("red", "blue", "green", "black", "white", "brown", "grey", "pink", "navy", "beige", "olive", "cream")
    materials = ("leather", "canvas", "wool", "cotton", "suede", "denim", "linen", "silk", "velvet", "nylon")
    products = ("shoe", "sneaker", "boot", "sandal", "loafer", "bag", "tote", "backpack", "wallet", "jacket", "coat",
                "dress", "shirt", "scarf", "hat", "skirt", "trousers", "sweater", "hoodie", "belt")
    styles = ("vintage", "waterproof", "oversized", "slim", "striped", "quilted", "knitted", "embroidered", "sporty",
              "classic", "summer", "winter", "evening", "casual", "formal", "running", "hiking", "ankle",
              "crossbody", "mini")
    phrases = [f"a {c} {m} {p}" for c, m, p in itertools.product(colours, materials, products)]
    phrases += [f"{s} {p} in {c}" for s, p, c in itertools.product(styles, products, colours)]
    phrases += [f"a photo of a {c} {p}" for c, p in itertools.product(colours, products)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(phrases), model_writer=model, vocab_size=SENTENCEPIECE_VOCAB, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
        num_threads=1, minloglevel=2)
    with open(path, "wb") as fh:
        fh.write(model.getvalue())
    return path


def make_tiny_hf_model(kind: str, folder: str, tokenizer: str = "word-level") -> str:
    """Random-weight CLIP/SigLIP/DINOv2 saved as a transformers folder, with a word-level tokenizer. A SigLIP with
    tokenizer="sentencepiece" is laid out as the real checkpoints are: a SentencePiece model (spiece.model) read by
    SiglipTokenizer, which returns input_ids only (as transformers' conversion of them saves it)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        Dinov2Config,
        Dinov2Model,
        PreTrainedTokenizerFast,
        SiglipConfig,
        SiglipImageProcessor,
        SiglipModel,
    )

    if tokenizer not in ("word-level", "sentencepiece") or (tokenizer == "sentencepiece" and kind != "siglip"):
        raise ValueError(f"{kind} with a {tokenizer} tokenizer")
    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  image_size=32, patch_size=8)
    text = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=SENTENCEPIECE_VOCAB if tokenizer == "sentencepiece" else 64, max_position_embeddings=16)
    size = {"height": 32, "width": 32}
    if kind == "clip":
        model = CLIPModel(CLIPConfig(text_config={**text, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2},
                                     vision_config=vision, projection_dim=24))
        processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=size)
    elif kind == "siglip":
        model = SiglipModel(SiglipConfig(text_config=text, vision_config=vision))
        processor = SiglipImageProcessor(size=size)
    elif kind == "dinov2":
        model = Dinov2Model(Dinov2Config(**vision))
        processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=size)
    else:
        raise ValueError(kind)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    if tokenizer == "sentencepiece":
        from transformers import SiglipTokenizer

        SiglipTokenizer(vocab_file=train_sentencepiece(os.path.join(folder, "spiece.model")),
                        model_input_names=["input_ids"], model_max_length=16).save_pretrained(folder)
    elif kind != "dinov2":
        words = ["[BOS]", "[EOS]", "[PAD]", "[UNK]", "a", "red", "blue", "shoe", "bag", "photo", "of"]
        tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                model_max_length=16).save_pretrained(folder)
    return folder


# Prepended to a subprocess script: its run hangs after the first shard commits (as a stuck GPU or a slow store
# would), so a test can act mid-run and kill it however fast the machine is.
HANG_AFTER_FIRST_SHARD = """
import time
import imgest.tasks.ingest.writer

_flush = imgest.tasks.ingest.writer.ShardWriter.flush
def _flush_then_hang(self):
    result = _flush(self)
    time.sleep(3600)
    return result
imgest.tasks.ingest.writer.ShardWriter.flush = _flush_then_hang
"""


def task_runs_named(prefix: str, expected: int, timeout: float = 60.0, flow_run_id=None) -> list:
    """The server's task runs whose names start with `prefix` (in one flow run if given), once `expected` of
    them are there and final.

    Filtered on the server: an unfiltered read returns one page (200 runs by default), and the session's
    shared server holds more than that. Polled: Prefect 3 records task runs from events, asynchronously, so a
    flow can return before the server has written the runs its workers reported.
    """
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId, TaskRunFilterName

    wanted = TaskRunFilter(name=TaskRunFilterName(like_=prefix),
                           flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]) if flow_run_id else None)
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = [r for r in client.read_task_runs(task_run_filter=wanted) if r.name.startswith(prefix)]
            if (len(runs) >= expected and all(r.state and r.state.is_final() for r in runs)) \
                    or time.monotonic() > deadline:
                return runs
            time.sleep(0.5)


class TcpProxy:
    """A TCP proxy on loopback in front of a real server (the S3 endpoint), which a test can cut (every open
    connection closed, new ones refused) and restore on the same port: a dropped network, for real."""

    def __init__(self, upstream: tuple[str, int]):
        import socket
        import threading

        self.upstream, self._socket, self._threading = upstream, socket, threading
        self._lock = threading.Lock()
        self._conns: list = []
        self._server = None
        self.port = 0
        self.restore()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        server = self._socket.socket()
        server.setsockopt(self._socket.SOL_SOCKET, self._socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self.port, self._server = server.getsockname()[1], server
        self._threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            conns, self._conns = self._conns, []
        if server is not None:
            server.close()
        for conn in conns:
            try:
                conn.shutdown(self._socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _accept(self, server) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # cut
            try:
                upstream = self._socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._server is not server:
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                self._threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.close()
                except OSError:
                    pass


def preprocess_or_die(image):
    """Lite0's preprocessing, except that a 301 x 201 image kills the process it runs in (a decoder crash,
    an OOM kill): module-level, so a spawned decode process can call it."""
    import os

    from imgest.encoders.efficientnet import preprocess

    if image.size == (301, 201):
        os._exit(1)
    return preprocess(image)


class WebhookReceiver:
    """A webhook on loopback: every POST body (JSON) it receives, in order."""

    def __init__(self):
        import http.server
        import threading

        posts = self.posts = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                posts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, text: str, timeout: float = 90.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [p for p in self.posts if text in p.get("subject", "") + p.get("body", "")]
            if found:
                return found[0]
            time.sleep(0.5)
        raise AssertionError(f"no POST mentioning {text!r} within {timeout} s; got {self.posts}")


def events_seen(names: list[str], where, since: float, timeout: float = 60.0) -> list:
    """Events of these names the session's server has recorded since `since` (epoch seconds) for which
    `where(event)` holds, once every name has one (events reach the server asynchronously: poll)."""
    from datetime import UTC, datetime

    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter

    deadline, found = time.monotonic() + timeout, []
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            page = client.read_events(filter=EventFilter(
                event=EventNameFilter(name=names),
                occurred=EventOccurredFilter(since=datetime.fromtimestamp(since - 5, UTC))), limit=50)
            found = [e for e in page.events if where(e)]
            if {e.event for e in found} >= set(names):
                return found
            time.sleep(1)
    raise AssertionError(f"events {names} not all seen within {timeout} s; seen {[e.event for e in found]}")


@contextlib.contextmanager
def served_app(app) -> Iterator[str]:
    """An ASGI app on real uvicorn on a free loopback port, for as long as the block runs; yields its URL."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def commit_markers(root, pattern: str) -> list:
    """The commit markers under `root` matching `pattern`, renamed into place: pathlib's glob also matches a
    local atomic write's hidden temp file (`.tmp-...json`), which is not a commit until its rename."""
    from imgest.storage import TEMP_PREFIX

    return [p for p in root.glob(pattern) if not p.name.startswith(TEMP_PREFIX)]


def traced(call):
    """(what `call()` returns, the peak of Python and NumPy allocations while it ran, tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mallinfo() -> MallInfo2:
    """glibc's mallinfo2 of this process: what malloc has handed out (`uordblks` from its heaps, `hblkhd` in mapped
    blocks) and holds free (`fordblks`)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2()


def heap_in_use() -> int:
    """Bytes malloc has handed out and not had back (glibc's mallinfo2: the heap's and the mapped blocks')."""
    info = mallinfo()
    return info.uordblks + info.hblkhd


def live_rows(store_url: str, model: str) -> dict[str, tuple[str, bytes]]:
    """item_id -> (content hash, embedding bytes) of every live item of `model` in the store, read back from its
    shard as a reader reaches it (its live row's shard, the row of its item id); no item twice in a shard."""
    import numpy as np

    from imgest.encoders import resolve
    from imgest.state.committed import load_state
    from imgest.storage import Location

    store = Location(str(store_url))
    slug = resolve(model).slug
    by_shard: dict[str, list] = {}
    state = load_state(store, slug)
    try:
        for item in state.live():
            by_shard.setdefault(item.shard, []).append(item)
    finally:
        state.close()
    out: dict[str, tuple[str, bytes]] = {}
    for shard, items in by_shard.items():
        table = store.read_table(f"embeddings/model={slug}/{shard}.parquet")
        ids = table.column("item_id").to_pylist()
        assert len(ids) == len(set(ids)), f"{shard} holds an item twice"
        for item in items:
            row = ids.index(item.item_id)
            assert table.column("content_hash")[row].as_py() == item.content_hash
            vector = np.asarray(table.column("embedding")[row].as_py(), np.float32)
            out[item.item_id] = (item.content_hash, vector.tobytes())
    return out

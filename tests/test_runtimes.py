"""Encoder runtimes: OpenVINO against torch, the parity gate and its fallback, the compiled-model cache, what a
run records, and the options' refusals."""

from __future__ import annotations

import json
import os
import shutil
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest

from imgest import encoders
from imgest.config import ConfigError, IngestConfig, build
from imgest.encoders import compiled, graphs, openvino_runtime, parity, precision, runtimes
from imgest.encoders.base import EncoderError
from imgest.encoders.parity import ParityError
from tests.helpers import ingest_into, small_catalogue, write_files

LITE0 = "efficientnet-lite0"


def _cosine(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.slow("real weights")
@pytest.mark.parametrize("name", [LITE0, f"{LITE0}-gem", f"{LITE0}-gem-ms"])
def test_openvino_fp32_gives_torch_fp32_embeddings_on_photos(name):
    """The run's compiled-model cache holds the model's parity record over the whole sample (made by this test or
    by whichever test of the run loaded the model first; the tests below watch a conversion happen in a cache of
    their own); a slice of the sample, photos and cut-outs, is encoded again here by both, independently."""
    spec = encoders.resolve(name)
    reference, compiled_ = encoders.load(spec, "cpu"), encoders.load(spec, "cpu", "openvino", "fp32")
    assert (compiled_.runtime, compiled_.precision) == ("openvino", "fp32")
    batch = parity.sample_batch(reference, slice(None, None, 8))  # 32 of the 256 photos, every kind it holds
    assert _cosine(reference.encode_images(batch), compiled_.encode_images(batch)).min() >= parity.FP32_MIN_COSINE
    entry = compiled.entry(spec.model_id, reference.graphs()["image"], "openvino", runtimes.get("openvino").version())
    record = compiled.read_record(entry, f"parity-fp32-{encoders.device_key('cpu', threads=False)}.json")
    assert record["passed"] and record["min_cosine"] >= 0.99999 and record["reference"] == "torch fp32"
    assert record["model_id"] == spec.model_id and record["sample"] == parity.SAMPLE


@pytest.mark.slow("the parity sample: 256 product photos made and encoded")
@pytest.mark.skipif("bf16" not in precision.native_precisions("cpu"), reason="this CPU has no native bf16")
def test_the_parity_samples_reference_is_computed_once_on_a_host(tiny_models, compiled_cache, monkeypatch):
    """torch fp32's embeddings of the sample are the reference of every check of a model: kept in the host's
    cache, read back by a later check (a new process), computed again when the kept file is damaged."""
    monkeypatch.setattr(parity, "_references", {})  # nothing computed in this process yet (as compiled_cache's)
    shutil.rmtree(compiled_cache / "references", ignore_errors=True)  # nor on this host (the run's are linked in)
    reference = encoders.load(encoders.resolve(f"hf:{tiny_models['dinov2']}"), "cpu")
    candidate = reference.compiled_as("torch", "bf16")
    calls, encode = [], reference.encode_images
    monkeypatch.setattr(reference, "encode_images", lambda batch: calls.append(len(batch)) or encode(batch))
    first = parity.measure(reference, candidate)
    assert sum(calls) == parity.SAMPLE_IMAGES
    (kept,) = compiled_cache.glob("references/image-*.npy")
    calls.clear()
    monkeypatch.setattr(parity, "_references", {})  # what a new process has in memory
    assert parity.measure(reference, candidate) == first and calls == []
    kept.write_bytes(b"not an array")
    monkeypatch.setattr(parity, "_references", {})
    assert parity.measure(reference, candidate) == first and sum(calls) == parity.SAMPLE_IMAGES


@pytest.mark.slow("an OpenVINO compile")
@pytest.mark.parametrize("kind", ["clip", "siglip", "dinov2"])
def test_transformers_towers_compile_with_openvino(compiled_cache, tiny_models, kind):
    spec = encoders.resolve(f"hf:{tiny_models[kind]}")
    reference, compiled_ = encoders.load(spec, "cpu"), encoders.load(spec, "cpu", "openvino", "fp32")
    assert set(compiled_.runners) == ({"image", "text"} if kind != "dinov2" else {"image"})
    batch = parity.sample_batch(reference, slice(None, None, 8))  # 32 of the 256 photos, every kind it holds
    assert _cosine(reference.encode_images(batch), compiled_.encode_images(batch)).min() >= 0.99999
    if kind != "dinov2":  # texts of another length than the traced example: the sequence axis is dynamic
        texts = ["a shoe", "a much longer description of a pair of red leather ankle boots with a zip"]
        assert _cosine(reference.encode_texts(texts), compiled_.encode_texts(texts)).min() >= 0.99999


def _wrong(monkeypatch, runtime_cls, scale: float = 0.3, precision_only: str | None = None):
    """Make a runtime return wrong vectors: its runner's features plus seeded noise (at one precision only:
    torch is also the fp32 reference)."""
    original = runtime_cls.compile

    def compile_noisy(self, graph, precision, device, model_id):
        run = original(self, graph, precision, device, model_id)
        if precision_only not in (None, precision):
            return run
        rng = np.random.default_rng(0)

        def noisy(*inputs):
            out = run(*inputs)
            out = np.asarray(out.float().numpy() if hasattr(out, "float") else out, np.float32)  # a torch tensor
            return out + scale * np.abs(out).mean() * rng.standard_normal(out.shape).astype(np.float32)
        return noisy
    monkeypatch.setattr(runtime_cls, "compile", compile_noisy)


@pytest.mark.slow("real weights")
def test_a_runtime_that_returns_wrong_vectors_is_refused_and_the_figure_is_kept(compiled_cache, monkeypatch):
    _wrong(monkeypatch, runtimes.OpenVINORuntime)
    spec = encoders.resolve(LITE0)
    with pytest.raises(ParityError, match=r"openvino fp32 against torch fp32 on the parity sample: min cosine "
                                          r"0\.\d+ below the 0\.99999 it needs"):
        encoders.load(spec, "cpu", "openvino", "fp32")
    record = json.loads(next(compiled_cache.glob("openvino-image-*/parity-fp32-*.json")).read_text())
    assert not record["passed"] and record["min_cosine"] < 0.99999
    # kept: a second load in a fresh process state reads the figure instead of measuring again
    monkeypatch.setattr(encoders, "_loaded", {})
    monkeypatch.setattr(parity, "measure", lambda *a: pytest.fail("measured again"))
    with pytest.raises(ParityError, match=f"min cosine {record['min_cosine']:.6g} below"):
        encoders.load(spec, "cpu", "openvino", "fp32")


def test_the_reduced_precision_gate_is_retrieval_worked_by_hand():
    """k = 1 on four unit vectors: moving x0 from beside x1 to beside x3 changes x0's nearest neighbour only,
    so 3 of 4 lists are kept: overlap 0.75. A reduced precision is gated on mean, 1st percentile and overlap;
    its min is not gated. fp32 is gated on its min alone."""
    x = np.array([[1, 0], [0.99, 0.141], [0, 1], [0.141, 0.99]])
    moved = x.copy()
    moved[0] = [0.6, 0.8]  # cosines to x1, x2, x3: 0.707, 0.8, 0.877
    assert parity.neighbour_overlap(x, moved, k=1) == 0.75
    assert parity.neighbour_overlap(x, x) == 1.0, "k is capped at the others' count (3 here)"
    good = {"min_cosine": 0.95, "mean_cosine": 0.9985, "p1_cosine": 0.991, "overlap": 0.93}
    assert parity.passes(good, "bf16"), "a low min alone does not refuse a reduced precision"
    assert not parity.passes({**good, "mean_cosine": 0.9979}, "bf16")
    assert not parity.passes({**good, "p1_cosine": 0.989}, "fp16")
    assert not parity.passes({**good, "overlap": 0.89}, "bf16")
    assert not parity.passes({**good, "min_cosine": 0.99998}, "fp32") and parity.passes(
        {**good, "min_cosine": 0.99999}, "fp32")


@pytest.mark.slow("real weights")
@pytest.mark.skipif("bf16" not in precision.native_precisions("cpu"), reason="this CPU has no native bf16")
def test_bf16_within_the_gate_is_accepted_and_one_made_to_drift_is_refused(monkeypatch, tmp_path):
    """The run's compiled-model cache holds torch bf16's parity record over the whole sample (made by this test or
    by whichever test of the run checked it first: a run's choice checks it); one made to drift, in a fresh cache,
    is measured and refused."""
    spec = encoders.resolve(LITE0)
    accepted = encoders.load(spec, "cpu", "torch", "bf16")
    assert (accepted.runtime, accepted.precision) == ("torch", "bf16")
    _, rest = accepted.graphs()["image"].parts("bf16")  # the record lives with the part run in bf16
    entry = compiled.entry(spec.model_id, rest, "torch", runtimes.get("torch").version())
    assert entry.folder.rsplit("/", 1)[-1].startswith("torch-image.rest-")
    record = compiled.read_record(entry, f"parity-bf16-{encoders.device_key('cpu', threads=False)}.json")
    assert record["passed"] and record["gate"] == {"mean_cosine": 0.998, "p1_cosine": 0.99, "overlap@10": 0.9}
    assert record["mean_cosine"] >= 0.998 and record["p1_cosine"] >= 0.99 and record["overlap"] >= 0.9
    assert record["min_cosine"] <= record["p1_cosine"] and record["sample"].startswith("256 product photos")

    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "fresh"))  # measured again, not read back
    monkeypatch.setattr(encoders, "_loaded", {})
    _wrong(monkeypatch, runtimes.TorchRuntime, scale=0.2, precision_only="bf16")
    with pytest.raises(ParityError, match=r"torch bf16 \(the stem and first block in fp32\) against torch fp32 on "
                                          r"the parity sample: mean cosine 0\.9\d+ "
                                          r"below the 0\.998 it needs"):
        encoders.load(spec, "cpu", "torch", "bf16")


@pytest.mark.slow("real weights")
def test_the_choice_falls_back_to_torch_with_one_warning(compiled_cache, monkeypatch, tmp_path, caplog):
    from imgest.tasks.ingest.batch_size import choose_encoding

    _wrong(monkeypatch, runtimes.OpenVINORuntime)
    spec = encoders.resolve(LITE0)
    with caplog.at_level("WARNING", logger="imgest"):
        chosen = choose_encoding(str(tmp_path / "store"), spec, "cpu", "openvino", "fp32", fixed=4)
    assert (chosen.runtime, chosen.precision, chosen.batch_size) == ("torch", "fp32", 4)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "runtime openvino, precision fp32 cannot encode efficientnet-lite0" in warnings[0]
    assert "min cosine" in warnings[0] and warnings[0].endswith("encoding with torch fp32 instead")
    assert chosen.warning == warnings[0] and chosen.parity == 1.0


@pytest.mark.slow("real weights")
def test_auto_measures_the_runtimes_that_pass_and_caches_each(compiled_cache, monkeypatch, tmp_path):
    from imgest.tasks.ingest.batch_size import choose_encoding

    monkeypatch.setattr(precision, "precision_candidates", lambda p, d: ("fp32",))  # fp32 only: a short test
    spec = encoders.resolve(LITE0)
    store = tmp_path / "store"
    chosen = choose_encoding(str(store), spec, "cpu", "auto", "auto", fixed=8)
    assert set(chosen.measured) == {"torch fp32", "openvino fp32"} and chosen.batch_size == 8
    assert f"{chosen.runtime} {chosen.precision}" == max(chosen.measured, key=chosen.measured.get)
    keys = sorted(p.name for p in (store / "tuning" / f"model={spec.slug}").glob("*.json"))
    assert len(keys) == 2 and all(k.endswith("-fp32-batch-8.json") for k in keys)
    assert {k.split("threads-")[1].split("-")[0] for k in keys} == {"torch", "openvino"}
    again = choose_encoding(str(store), spec, "cpu", "auto", "auto", fixed=8)
    assert again.measured == chosen.measured  # read back, not measured again


@pytest.mark.slow("a compile")
def test_an_automatic_batch_compares_the_runtimes_at_one_probe_and_tunes_the_winner_alone(
        tiny_models, compiled_cache, monkeypatch, tmp_path):
    from imgest.tasks.ingest import batch_size

    monkeypatch.setattr(precision, "precision_candidates", lambda p, d: ("fp32",))
    monkeypatch.setattr(batch_size, "CPU_CANDIDATES", (1, 2, 4))  # how long a sweep is: not what is tested
    monkeypatch.setattr(batch_size, "MIN_SECONDS", 0.05)
    spec = encoders.resolve(f"hf:{tiny_models['dinov2']}")
    store = tmp_path / "store"
    chosen = batch_size.choose_encoding(str(store), spec, "cpu", "auto", "auto")
    assert set(chosen.measured) == {"torch fp32", "openvino fp32"} and chosen.measured_at == 8
    label = f"{chosen.runtime} {chosen.precision}"
    assert label == max(chosen.measured, key=chosen.measured.get)
    keys = sorted(p.name.split("threads-")[1] for p in (store / "tuning" / f"model={spec.slug}").glob("*.json"))
    assert keys == sorted(["torch-fp32-batch-8.json", "openvino-fp32-batch-8.json",
                           f"{chosen.runtime}-fp32-batch-auto.json"])  # the loser is never swept
    assert chosen.batch_size in (1, 2, 4) and chosen.source.startswith("auto, measured img/s by batch {1: ")
    again = batch_size.choose_encoding(str(store), spec, "cpu", "auto", "auto")
    assert (again.measured, again.batch_size) == (chosen.measured, chosen.batch_size)
    assert again.source.startswith("auto, cached")


@pytest.mark.slow("real weights")
def test_converting_sends_no_telemetry(compiled_cache, monkeypatch):
    """OpenVINO's converter would fork a process to report usage; from a worker holding threads that fork can
    hang or crash, and a catalogue job does not report home."""
    from openvino_telemetry.backend import backend_ga4

    sent = []
    monkeypatch.setattr(backend_ga4.GA4Backend, "send", lambda self, message: sent.append(message))
    encoder = encoders.load(encoders.resolve(LITE0), "cpu", "openvino", "fp32")
    assert encoder.runtime == "openvino" and list(compiled_cache.glob("openvino-image-*/model.xml"))
    assert sent == []


@pytest.mark.slow("real weights")
def test_the_converted_model_is_keyed_by_revision_runtime_version_and_shape(compiled_cache, monkeypatch):
    spec = encoders.resolve(LITE0)
    graph = encoders.load(spec, "cpu").graphs()["image"]
    conversions = []

    def convert(folder):
        conversions.append(folder)
        open(f"{folder}/model.xml", "w").close()

    first = compiled.entry(spec.model_id, graph, "openvino", "2026.4")
    compiled.ensure(first, convert)
    compiled.ensure(first, convert)
    assert len(conversions) == 1  # cached
    changed_revision = spec.model_id.replace(spec.revision[:16], "0" * 16)
    for other in (compiled.entry(changed_revision, graph, "openvino", "2026.4"),
                  compiled.entry(spec.model_id, graph, "openvino", "2027.0"),
                  compiled.entry(spec.model_id, graphs.Graph("image", graph.module, (np.zeros((2, 3, 256, 256),
                                                                                              np.uint8),), ((0,),)),
                                 "openvino", "2026.4")):
        assert other.folder != first.folder
        compiled.ensure(other, convert)
    assert len(conversions) == 4
    assert not list(compiled_cache.glob("*.tmp-*"))  # converted in a temporary folder, renamed whole


@pytest.mark.slow("real weights")
def test_a_half_written_entry_is_converted_again(compiled_cache):
    spec = encoders.resolve(LITE0)
    graph = encoders.load(spec, "cpu").graphs()["image"]
    entry = compiled.entry(spec.model_id, graph, "openvino", runtimes.get("openvino").version())
    # a folder without its key file: a kill mid-way
    (compiled_cache / entry.folder.rsplit("/", 1)[-1]).mkdir(parents=True)
    runner = runtimes.get("openvino").compile(graph, "fp32", "cpu", spec.model_id)
    batch = np.zeros((2, 3, 224, 224), np.uint8)
    assert np.asarray(runner(batch)).shape == (2, 1280)



def _model_file(folder: str) -> None:
    with open(os.path.join(folder, compiled.MODEL_FILE), "w") as fh:
        fh.write("<net/>")


@pytest.mark.slow("a process waiting its turn")
def test_a_second_process_waits_for_the_conversion_under_way_and_reads_it(compiled_cache):
    """Two workers of a host loading the same model: the second waits for the first's conversion and uses its
    entry instead of converting beside it (open file descriptions lock each other as two processes do)."""
    entry = compiled.Entry(str(compiled_cache / "openvino-image-0"), {"model_id": "m@1"})
    inside, release, converted, second = threading.Event(), threading.Event(), [], []

    def convert(folder: str) -> None:
        converted.append(folder)
        inside.set()
        assert release.wait(30)
        _model_file(folder)

    first = threading.Thread(target=compiled.ensure, args=(entry, convert))
    first.start()
    assert inside.wait(30)
    waiting = threading.Thread(target=lambda: second.append(compiled.ensure(entry, convert)))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and not second, "the second converter did not wait its turn"
    release.set()
    first.join(30)
    waiting.join(30)
    assert len(converted) == 1 and second == [os.path.join(entry.folder, compiled.MODEL_FILE)]


@pytest.mark.slow("a process waiting its turn")
def test_a_turn_held_too_long_is_passed_by_with_a_warning(compiled_cache, monkeypatch, caplog):
    """A holder paused or stuck never stops the others: past TURN_WAIT_S the job is done here too."""
    monkeypatch.setattr(compiled, "TURN_WAIT_S", 0.3)
    entry = compiled.Entry(str(compiled_cache / "openvino-image-1"), {"model_id": "m@1"})
    with compiled.one_at_a_time(f"convert {entry.folder}"), caplog.at_level("WARNING", logger="imgest"):
        done = []
        waiting = threading.Thread(target=lambda: done.append(compiled.ensure(entry, _model_file)))
        waiting.start()
        waiting.join(30)
    assert done == [os.path.join(entry.folder, compiled.MODEL_FILE)]
    assert "another process has held it for 0.3 s; done here too" in caplog.text


@pytest.mark.slow("an OpenVINO compile")
def test_a_compile_waits_for_the_one_under_way_and_loads_its_blob(compiled_cache):
    """OpenVINO writes its compiled blob in place: a second process compiling the same entry beside the first
    would rewrite the file under any process that had mapped it (SIGBUS at its next inference, seen in a run of
    this suite). The second compile waits its turn, then loads the blob the first wrote."""
    import torch

    graph = graphs.Graph("image", torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4)),
                         (np.zeros((2, 3, 2, 2), np.float32),), ((0,),))
    runtime = runtimes.get("openvino")
    first = runtime.compile(graph, "fp32", "cpu", "tiny@1")
    (blob,) = compiled_cache.glob("*/blobs/*.blob")
    written = blob.stat().st_ino, blob.stat().st_mtime_ns
    done = []
    second = openvino_runtime._OpenVINORunner(first.xml, first.blobs, first.precision)
    with compiled.one_at_a_time(openvino_runtime.compile_job(first.blobs)):
        waiting = threading.Thread(target=lambda: done.append(second.request(max(1, torch.get_num_threads()))))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and not done, "the second compile did not wait its turn"
    waiting.join(30)
    assert done and (blob.stat().st_ino, blob.stat().st_mtime_ns) == written  # loaded, not written again
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2)
    np.testing.assert_allclose(second(x), first(x), rtol=1e-6)


def test_precisions_follow_the_cpu(monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert precision.native_precisions("cpu") == ("fp32",)
    assert precision.precision_candidates("auto", "cpu") == ("fp32",)
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    assert precision.precision_candidates("auto", "cpu") == ("bf16", "fp32")
    assert precision.precision_candidates("fp16", "cpu") == ("fp16",)  # named: tried, and refused if not native


@pytest.mark.slow("real weights")
def test_a_precision_the_cpu_lacks_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(encoders, "_loaded", {})
    with pytest.raises(EncoderError, match=r"^cpu does not compute in bf16 natively \(it does: fp32\); use "
                                           r"--precision auto or fp32$"):
        encoders.load(encoders.resolve(LITE0), "cpu", "openvino", "bf16")


def test_a_run_refuses_what_this_host_cannot_run_before_any_work(prefect_harness, tmp_path, monkeypatch):
    write_files(str(tmp_path / "catalogue"), small_catalogue(3))
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2"}))
    with pytest.raises(EncoderError, match=r"^precision bf16: cpu does not compute in bf16 natively"):
        ingest_into(tmp_path / "catalogue", tmp_path / "store", precision="bf16")
    monkeypatch.setattr(runtimes.OpenVINORuntime, "missing", lambda self: "the openvino package is not installed")
    with pytest.raises(EncoderError, match=r"^runtime openvino: the openvino package is not installed; use "):
        ingest_into(tmp_path / "catalogue", tmp_path / "store", runtime="openvino")
    assert not (tmp_path / "store").exists()  # nothing listed, locked or written


@pytest.mark.slow("real weights")
def test_a_model_the_runtime_cannot_compile_falls_back_with_one_warning(compiled_cache, monkeypatch, tmp_path, caplog):
    from imgest.tasks.ingest.batch_size import choose_encoding

    def cannot(graph, folder):
        raise RuntimeError("Check 'is_conversion_supported' failed: aten::some_op has no translation\nmore")
    monkeypatch.setattr(openvino_runtime, "_convert", cannot)
    with caplog.at_level("WARNING", logger="imgest"):
        chosen = choose_encoding(str(tmp_path / "store"), encoders.resolve(LITE0), "cpu", "openvino", "fp32",
                                 fixed=4)
    assert (chosen.runtime, chosen.precision) == ("torch", "fp32")
    assert "openvino cannot compile the image tower of efficientnet-lite0@" in chosen.warning
    assert "RuntimeError: Check 'is_conversion_supported' failed" in chosen.warning and "more" not in chosen.warning
    # nothing half-written: the turns' lock files (and the run's parity sample and references it started with)
    assert [p.name for p in compiled_cache.glob("*") if p.name not in ("parity-sample", "references")] == ["locks"]


@pytest.mark.slow("real weights")
def test_a_damaged_cached_model_is_converted_again(compiled_cache):
    spec = encoders.resolve(LITE0)
    first = encoders.load(spec, "cpu", "openvino", "fp32")
    xml = next(compiled_cache.glob("openvino-image-*/model.xml"))
    xml.write_text("<net>not a model")  # damaged on disk after it was written whole
    encoders._loaded.clear()
    again = encoders.load(spec, "cpu", "openvino", "fp32")
    batch = parity.sample_batch(first, slice(None, None, 8))
    assert _cosine(first.encode_images(batch), again.encode_images(batch)).min() >= 0.99999
    assert "not a model" not in xml.read_text()


def test_openvino_is_not_a_cuda_runtime():
    with pytest.raises(EncoderError, match="runtime openvino runs on cpu, not on cuda"):
        runtimes.runtime_candidates("openvino", "cuda")
    assert runtimes.runtime_candidates("auto", "cuda") == ("torch",)


@pytest.mark.parametrize("field, value, allowed", [("runtime", "tensorrt", "auto, torch, openvino"),
                                                   ("precision", "int8", "auto, fp32, bf16, fp16")])
def test_unknown_runtime_or_precision_is_refused_naming_the_allowed(tmp_path, field, value, allowed):
    with pytest.raises(ConfigError, match=rf"^{field} must be one of {allowed}; got '{value}'$"):
        build(IngestConfig, {"catalogue": str(tmp_path), "store": str(tmp_path / "s"), field: value})
    from typer.testing import CliRunner

    from imgest.cli import app

    result = CliRunner().invoke(app, ["ingest", "--catalogue", str(tmp_path), "--store", str(tmp_path / "s"),
                                      f"--{field}", value])
    assert result.exit_code == 2 and f"{field} must be one of {allowed}; got '{value}'" in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1


def test_a_run_records_its_runtime_and_precision(prefect_harness, tmp_path):
    from imgest.reports.ingest import render_summary
    from imgest.tasks.ingest.commit import RunSummary

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), small_catalogue(6))
    summary = ingest_into(cat, store, runtime="openvino", precision="fp32", batch_size="4", shard_size=3)
    assert (summary["runtime"], summary["precision"]) == ("openvino", "fp32") and summary["encoded"] == 6
    assert summary["encoding"]["parity"] >= 0.99999 and summary["encoding"]["warning"] is None
    shards = list((store / "embeddings" / f"model={summary['slug']}").glob("*.parquet"))
    assert len(shards) == 2
    for path in shards:
        meta = pq.read_schema(path).metadata
        assert (meta[b"imgest.runtime"], meta[b"imgest.precision"]) == (b"openvino", b"fp32")
    timeline = pq.read_table(store / "runs" / f"{summary['run_id']}.shards.parquet").to_pydict()
    assert set(zip(timeline["runtime"], timeline["precision"])) == {("openvino", "fp32")}
    assert json.loads((store / "runs" / f"{summary['run_id']}.json").read_text())["runtime"] == "openvino"
    assert "- runtime: **openvino fp32**, min cosine" in render_summary(RunSummary(**summary))
    # the model's default JPEG decode, recorded on its first run in the store, and only its cost measured, on the
    # run's own images (tests/test_decoders.py)
    from imgest.images import decoders

    chosen = summary["encoding"]["decoder"]
    assert (chosen, summary["encoding"]["decode_side"]) == (decoders.DEFAULT, 256)
    assert summary["encoding"]["decoder_source"] == "the model's default, recorded"
    assert list(summary["encoding"]["decoders"]) == [chosen] and summary["encoding"]["decoders"][chosen] > 0
    assert f"JPEGs decoded by {chosen}" in render_summary(RunSummary(**summary))
    assert {pq.read_schema(path).metadata[b"imgest.decoder"] for path in shards} == {chosen.encode()}


def test_the_candidates_of_a_choice_preprocess_the_sample_once_and_let_it_go_after(monkeypatch):
    """A run's choice checks each runtime at each precision against the same preprocessed sample: made once
    within `parity.shared()`, and not held after it."""
    from types import SimpleNamespace

    from PIL import Image

    monkeypatch.setattr(parity, "_photos", lambda: tuple(Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(4)))
    calls = []

    class Model:
        spec = SimpleNamespace(model_id="m@1")

        def preprocess(self, image):
            calls.append(image.getpixel((0, 0))[0])
            return np.full(3, calls[-1], np.float32)

    with parity.shared():
        first = parity.sample_batch(Model())
        assert parity.sample_batch(Model()) is first and calls == [0, 1, 2, 3]
        assert parity.sample_batch(Model(), slice(2)).tolist() == [[0.0] * 3, [1.0] * 3]  # a slice is its own
    assert parity.sample_batch(Model()) is not first and len(calls) == 10

"""Layers a reduced precision keeps in fp32: EfficientNet-Lite's stem and first block run in fp32 under bf16, on
OpenVINO and on torch, and the parity gate judges the tower as it runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from imgest import encoders
from imgest.encoders import compiled, efficientnet, parity, precision, runtimes

LITE0 = "efficientnet-lite0"
bf16_only = pytest.mark.skipif("bf16" not in precision.native_precisions("cpu"), reason="this CPU has no native bf16")


def _normalised(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _photos(encoder, n=8):
    return parity.sample_batch(encoder, slice(n))


@pytest.mark.slow("real weights")
@pytest.mark.parametrize("name", [LITE0, f"{LITE0}-gem"])
def test_the_split_tower_computes_what_the_network_does(name):
    """The tower is its fp32 head then the rest; in fp32 that is the package's own `extract_features` and the
    pooling (the multi-scale tower: tests/test_multiscale.py)."""
    encoder = encoders.load(encoders.resolve(name), "cpu")
    graph = encoder.graphs()["image"]
    assert graph.split.what == "the stem and first block" == graph.kept_fp32("bf16") and graph.kept_fp32("fp32") == ""
    pixels = _photos(encoder)
    with torch.inference_mode():
        features = encoder.model.extract_features((torch.from_numpy(pixels).float() - 127.0) / 128.0)
        pooled = efficientnet.gem(features, 3.0) if name.endswith("-gem") else features.mean(dim=(2, 3))
        (first_block,) = graph.split.head(torch.from_numpy(pixels))
    assert first_block.shape[1:] == (16, 112, 112)  # Lite0's first block: 16 channels at half the side
    assert np.abs(encoder.encode_images(pixels) - _normalised(pooled.numpy())).max() < 1e-5


@pytest.mark.slow("real weights")
@bf16_only
def test_openvino_bf16_runs_the_first_block_in_fp32_and_passes_the_gate(compiled_cache):
    spec = encoders.resolve(LITE0)
    reference, encoder = encoders.load(spec, "cpu"), encoders.load(spec, "cpu", "openvino", "bf16")
    record = json.loads(next(compiled_cache.glob("openvino-image.rest-*/parity-bf16-*.json")).read_text())
    assert record["passed"] and record["kept_fp32"] == "the stem and first block"
    assert record["p1_cosine"] >= 0.99 and record["mean_cosine"] >= 0.998 and record["overlap"] >= 0.9

    # what the CPU plugin runs: every convolution of the head in f32, every one of the rest in bf16
    chained = encoder.runners["image"]
    precisions = {}
    for part in ("head", "rest"):
        (model,) = getattr(chained, part)._compiled.values()
        precisions[part] = {op.get_rt_info()["runtimePrecision"].astype(str)
                            for op in model.get_runtime_model().get_ops()
                            if op.get_rt_info()["layerType"].astype(str) == "Convolution"}
    assert precisions == {"head": {"f32"}, "rest": {"bf16"}}
    assert sorted(p.name.split("-")[1] for p in compiled_cache.glob("openvino-image.*")) == ["image.fp32", "image.rest"]

    pixels = _photos(reference, 16)
    cosines = (reference.encode_images(pixels) * encoder.encode_images(pixels)).sum(1)
    assert cosines.min() > 0.99


@pytest.mark.slow("real weights")
@bf16_only
def test_torch_bf16_runs_the_head_outside_autocast():
    encoder = encoders.load(encoders.resolve(LITE0), "cpu", "torch", "bf16")
    split = encoder.graphs()["image"].split
    seen = {}
    hooks = [split.head.model._conv_stem.register_forward_hook(lambda m, i, o: seen.__setitem__("stem", o.dtype)),
             split.rest.model._conv_head.register_forward_hook(lambda m, i, o: seen.__setitem__("last", o.dtype))]
    try:
        encoder.encode_images(_photos(encoder, 2))
    finally:
        for hook in hooks:
            hook.remove()
    assert seen == {"stem": torch.float32, "last": torch.bfloat16}


@pytest.mark.slow("real weights")
def test_a_record_of_another_split_is_measured_again(compiled_cache, monkeypatch):
    """A parity record kept before the tower kept layers in fp32 (a cache from an earlier release, whose bf16
    was refused) is not read back for the split tower: it is measured again, and the new record kept."""
    spec = encoders.resolve(LITE0)
    reference = encoders.load(spec, "cpu")
    candidate = reference.compiled_as("torch", "bf16")  # autocast runs on any CPU; no native bf16 needed here
    figures = {"min_cosine": 0.97, "mean_cosine": 0.9995, "p1_cosine": 0.999, "overlap": 0.99}
    measured = []
    monkeypatch.setattr(parity, "measure", lambda ref, cand: measured.append(1) or figures)
    _, rest = candidate.graphs()["image"].parts("bf16")  # the record lives with the part run in bf16
    entry = compiled.entry(spec.model_id, rest, "torch", runtimes.get("torch").version())
    before = parity.Parity(spec.model_id, "torch", "bf16", "cpu", gate=parity.gate("bf16"), passed=False,
                           kept_fp32="", sample=parity.SAMPLE, reference=parity.REFERENCE, host="h",
                           created="2026-12-01T00:00:00+00:00", **{**figures, "p1_cosine": 0.988})
    compiled.write_record(entry, "parity-bf16-cpu.json", before.to_dict())
    old = before.to_dict()
    del old["kept_fp32"]  # as an earlier release wrote it
    compiled.write_record(entry, "parity-bf16-old.json", old)

    for key in ("cpu", "old"):
        assert parity.check(reference, candidate, key).passed
    assert len(measured) == 2
    kept = json.loads((compiled_cache / entry.folder.rsplit("/", 1)[-1] / "parity-bf16-cpu.json").read_text())
    assert kept["kept_fp32"] == "the stem and first block" and kept["passed"]
    parity.check(reference, candidate, "cpu")
    assert len(measured) == 2  # read back now


@pytest.mark.slow("real weights")
def test_a_heads_tower_keeps_its_bases_fp32_layers():
    from imgest.encoders.head import HeadEncoder

    base = encoders.load(encoders.resolve(LITE0), "cpu")
    torch.manual_seed(0)
    headed = HeadEncoder.__new__(HeadEncoder)  # a head's tower needs only its base and its module
    headed.__dict__.update(device="cpu", base=base, module=torch.nn.Linear(1280, 32).eval())
    graph = headed.graphs()["image"]
    assert graph.split.head is base.graphs()["image"].split.head and graph.kept_fp32("bf16") == base.graphs()[
        "image"].kept_fp32("bf16")
    pixels = torch.from_numpy(_photos(base, 4))
    with torch.inference_mode():
        whole, split = graph.module(pixels), graph.split.rest(*graph.split.head(pixels))
    assert whole.shape == (4, 32) and torch.equal(whole, split)

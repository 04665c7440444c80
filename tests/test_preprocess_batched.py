"""The batched preprocess (uint8 frames to the device, converted there a batch at a time; the
state arithmetic over the whole batch; tokenisations cached by text) against the per-sample
reference path it replaced: the same tensors, bit for bit on the CPU."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from phyai_edge.adapters.base import Observation
from phyai_edge.adapters.normalization import NormStats
from phyai_edge.adapters.pi05 import preprocess as pp

S = 224


def assert_same(a, b):
    assert a.batch_size == b.batch_size
    assert sorted(a.tensors) == sorted(b.tensors)
    for k in a.tensors:
        x, y = a.tensors[k], b.tensors[k]
        assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device, k
        assert torch.equal(x, y), f"{k}: max diff {(x.double() - y.double()).abs().max()}"


def frames(rng, hw, n=3):
    return [rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("hw", [(S, S), (480, 640), (300, 100), (97, 131), (S, 300)])
@pytest.mark.parametrize("batch", [1, 4])
def test_uniform_batches_equal_per_sample(tiny_adapter, hw, batch):
    rng = np.random.default_rng(hw[0] * 7 + batch)
    obs = [Observation(dict(zip(tiny_adapter.camera_names, frames(rng, hw))),
                       rng.uniform(-1.2, 1.2, 14).astype(np.float32), f"task {i % 2}") for i in range(batch)]
    assert_same(tiny_adapter.preprocess(obs), tiny_adapter.preprocess_per_sample(obs))


def test_mixed_batch_equals_per_sample(tiny_adapter):
    """Frame sizes differ across cameras and robots; a missing camera; float CHW and HWC,
    grayscale, a negative-stride view (BGR -> RGB) and a read-only buffer (as ZeroMQ gives)."""
    rng = np.random.default_rng(3)
    top, left, right = tiny_adapter.camera_names
    ro = np.frombuffer(rng.integers(0, 256, 60 * 80 * 3, dtype=np.uint8).tobytes(), np.uint8).reshape(60, 80, 3)
    assert not ro.flags.writeable
    obs = [
        Observation({top: frames(rng, (S, S), 1)[0], left: frames(rng, (480, 640), 1)[0], right: None},
                    rng.uniform(-1, 1, 14), "pick"),
        Observation({top: rng.random((3, 120, 90), dtype=np.float32), left: frames(rng, (480, 640), 1)[0][..., ::-1],
                     right: rng.integers(0, 256, (50, 70, 1), dtype=np.uint8)}, rng.uniform(-1, 1, 14), "place"),
        Observation({left: ro, right: rng.random((S, S, 3), dtype=np.float32)}, rng.uniform(-1, 1, 14), ""),
        Observation({top: frames(rng, (S, S), 1)[0], left: frames(rng, (S, S), 1)[0],
                     right: torch.rand(3, 64, 64)}, rng.uniform(-1, 1, 14), "pick"),
    ]
    got = tiny_adapter.preprocess(obs)
    assert_same(got, tiny_adapter.preprocess_per_sample(obs))
    assert got.tensors["image_mask"].tolist() == [[True, True, False], [True] * 3, [False, True, True], [True] * 3]
    assert torch.equal(got.tensors["images"][0, 2], torch.full((3, S, S), -1.0))


def test_frames_to_model_equals_per_image_path():
    """The conversion alone, for every uint8 value (the lookup tables) and through a resize."""
    rng = np.random.default_rng(0)
    every = np.arange(256 * 196, dtype=np.int64).reshape(S, S) % 256
    for hw, batch in (((S, S), np.stack([every.astype(np.uint8)] * 3, -1)[None]),
                      ((33, 250), rng.integers(0, 256, (5, 33, 250, 3), dtype=np.uint8))):
        got = pp.frames_to_model(torch.from_numpy(batch), S)
        ref = torch.stack([pp.to_model_range(pp.image_to_float_chw(f, "c"), S) for f in batch])
        assert got.shape == (len(batch), 3, S, S) and got.is_contiguous(), hw
        assert torch.equal(got, ref), hw
    assert torch.equal(pp._UNIT, torch.tensor([v / 255.0 for v in range(256)], dtype=torch.float32))


def test_staging_groups_by_size_and_copies(tiny_adapter, make_obs):
    a = tiny_adapter
    obs = [make_obs(a, seed=0, size=(S, S)), make_obs(a, seed=1, size=(480, 640))]
    obs[1].images = {**obs[1].images, "top": obs[0].images["top"]}
    staged = a.stage_images(obs)
    assert not staged.dense
    sizes = {tuple(f.shape[1:3]): s.tolist() for s, f in staged.groups}
    assert sizes == {(S, S): [0, 1, 2, 3], (480, 640): [4, 5]}
    # Torch owns a copy: the caller may reuse its buffers once staging returns.
    obs[0].images["top"][:] = 0
    assert staged.groups[0][1][0].max() > 0
    dense = a.stage_images([make_obs(a, seed=2, size=(S, S))] * 2)
    assert dense.dense and dense.to("cpu").dense


def test_tokens_equal_per_sample_in_every_state_mode(tiny_adapter):
    a = tiny_adapter
    rng = np.random.default_rng(5)
    img = {"top": np.zeros((8, 8, 3), np.uint8)}
    states = np.concatenate([rng.uniform(-2, 2, (6, 14)), [[np.float32(1e30)] * 14, [-1.0] * 14]]).astype(np.float32)
    obs = [Observation(img, s, p) for s, p in zip(states, ["a", "b_c", "", " d\ne ", "a", "a", "x", "y"])]
    for stats, pad in ((a.io.state_stats, False), (NormStats("mean_std", mean=rng.normal(size=14),
                                                             std=rng.uniform(0.1, 2, 14)), True)):
        a.io.state_stats, a.io.pad_state_in_prompt = stats, pad
        ids, mask = a.prompt_tokens(obs)
        ref = [a._prompt_tokens(o, i) for i, o in enumerate(obs)]
        assert ids.tolist() == [r[0] for r in ref] and mask.tolist() == [r[1] for r in ref]
        ids2, _ = a.prompt_tokens(obs)  # again, from the cache
        assert np.array_equal(ids, ids2)


def test_token_cache_is_exact_and_bounded(tiny_adapter, monkeypatch):
    a = tiny_adapter
    calls = []
    real = a.tokenizer

    class Counting:
        vocab_size = real.vocab_size

        def __call__(self, text, max_len):
            calls.append(text)
            return real(text, max_len)

    monkeypatch.setattr(a, "tokenizer", Counting())
    obs = Observation({"top": np.zeros((8, 8, 3), np.uint8)}, np.zeros(14, np.float32), "go")
    a.prompt_tokens([obs, obs, obs])
    assert len(calls) == 1
    other = Counting()
    monkeypatch.setattr(a, "tokenizer", other)  # a new tokenizer starts a new cache
    a.prompt_tokens([obs])
    assert len(calls) == 2
    monkeypatch.setattr("phyai_edge.adapters.pi05.adapter.TOKEN_CACHE_SIZE", 3)
    for k in range(6):
        a.prompt_tokens([Observation(obs.images, np.full(14, k / 10, np.float32), "go")])
    assert len(a._token_cache) == 3


def test_truncation_warns_once_with_the_cache(tiny_adapter, caplog):
    obs = Observation({"top": np.zeros((4, 4, 3), np.uint8)}, np.zeros(14), "pick up the red cube " * 40)
    with caplog.at_level(logging.WARNING):
        a = tiny_adapter.preprocess([obs, obs]).tensors
        b = tiny_adapter.preprocess_per_sample([obs, obs]).tensors
    assert torch.equal(a["tokens"], b["tokens"]) and a["token_mask"].all()
    assert sum("truncated" in r.message for r in caplog.records) == 1


def test_errors_name_the_observation(tiny_adapter, make_obs):
    good = make_obs(tiny_adapter)
    bad = make_obs(tiny_adapter, state=np.r_[np.zeros(13), np.nan])
    with pytest.raises(ValueError, match="observation 1: state has NaN"):
        tiny_adapter.preprocess([good, bad])
    missing = Observation({"top": None}, np.zeros(14), "go")
    with pytest.raises(ValueError, match="observation 2: every camera is missing"):
        tiny_adapter.preprocess([good, good, missing])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("antialias", [False, True])
@pytest.mark.parametrize("hw", [(S, S), (480, 640)])
def test_cuda_preprocess_matches_cpu_reference(tiny_adapter, hw, antialias):
    """On the GPU the lookups keep unresized frames bit-exact; a resize runs CUDA's bilinear
    kernel (antialiased for openpi checkpoints), equal to the CPU's within float rounding."""
    import copy
    import dataclasses

    tiny_adapter = copy.copy(tiny_adapter)
    tiny_adapter.io = dataclasses.replace(tiny_adapter.io, resize_antialias=antialias)
    rng = np.random.default_rng(11)
    obs = [Observation(dict(zip(tiny_adapter.camera_names, frames(rng, hw))), rng.uniform(-1, 1, 14), "go")
           for _ in range(4)]
    got = tiny_adapter.preprocess(obs, device="cuda")
    ref = tiny_adapter.preprocess_per_sample(obs)
    for k, v in ref.tensors.items():
        g = got.tensors[k]
        assert g.device.type == "cuda" and g.dtype == v.dtype and g.shape == v.shape
        if k == "images" and hw != (S, S):
            torch.testing.assert_close(g.cpu(), v, atol=1e-5, rtol=0)
        else:
            assert torch.equal(g.cpu(), v), k


def test_device_path_run_on_cpu_equals_per_sample(tiny_adapter):
    """The GPU path (stack uint8 -> copy -> lookups, batched resize) exercised on the CPU."""
    rng = np.random.default_rng(8)
    top, left, right = tiny_adapter.camera_names
    obs = [Observation({top: frames(rng, (S, S), 1)[0], left: frames(rng, (480, 640), 1)[0], right: None},
                       rng.uniform(-1, 1, 14), "a"),
           Observation({top: frames(rng, (S, S), 1)[0], left: frames(rng, (480, 640), 1)[0],
                        right: rng.random((3, 40, 40), dtype=np.float32)}, rng.uniform(-1, 1, 14), "b")]
    staged = tiny_adapter.stage_images(obs).to("cpu")
    ref = tiny_adapter.preprocess_per_sample(obs).tensors
    assert torch.equal(tiny_adapter.images_from_staged(staged), ref["images"])
    assert torch.equal(staged.present, ref["image_mask"])
    dense = [Observation(dict(zip(tiny_adapter.camera_names, frames(rng, (S, S)))), rng.uniform(-1, 1, 14), "c")
             for _ in range(3)]
    staged = tiny_adapter.stage_images(dense)
    assert staged.dense
    assert torch.equal(tiny_adapter.images_from_staged(staged), tiny_adapter.preprocess_per_sample(dense).tensors["images"])


def test_threads_sharing_an_adapter_get_their_own_answers(tiny_adapter, monkeypatch):
    """Server workers may share one adapter (and its tokenisation cache, here small enough to
    evict constantly)."""
    import threading

    monkeypatch.setattr("phyai_edge.adapters.pi05.adapter.TOKEN_CACHE_SIZE", 2)
    rng = np.random.default_rng(9)
    batches = [[Observation({"top": rng.integers(0, 256, (S, S, 3), dtype=np.uint8)},
                            rng.uniform(-1, 1, 14).astype(np.float32), f"task {k}") for _ in range(3)] for k in range(4)]
    want = [tiny_adapter.preprocess_per_sample(b) for b in batches]
    errors = []

    def work(k):
        try:
            for _ in range(5):
                assert_same(tiny_adapter.preprocess(batches[k]), want[k])
        except Exception as exc:  # surfaced below, with the thread's batch
            errors.append((k, exc))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_every_path_resizes_with_antialiasing_alike(tiny_adapter, make_obs):
    """With `RobotIO.resize_antialias` (openpi checkpoints) the per-image path, the CPU batch and
    the staged device path give the same bits, as they do without it, and differ from it."""
    import copy
    import dataclasses

    a = copy.copy(tiny_adapter)
    a.io = dataclasses.replace(tiny_adapter.io, resize_antialias=True)
    obs = [make_obs(a, seed=0, size=(480, 640)), make_obs(a, seed=1, size=(S, S)),
           make_obs(a, seed=2, size=(300, 200))]
    ref = a.preprocess_per_sample(obs).tensors["images"]
    assert torch.equal(a.preprocess(obs).tensors["images"], ref)
    assert torch.equal(a.images_from_staged(a.stage_images(obs).to("cpu")), ref)
    plain = tiny_adapter.preprocess_per_sample(obs).tensors["images"]
    assert not torch.equal(plain[0], ref[0]) and torch.equal(plain[1], ref[1])  # a square frame is not resized

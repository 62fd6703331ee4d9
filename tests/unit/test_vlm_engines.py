"""Engines with images: the hf engine generates from a prompt's images, the fsdp engine scores and
trains on them (packed rows with [4, 1, N] multimodal positions give the padded rows' log-probs),
its frozen vision tower gets no gradient, and the weight sync carries the tower to hf."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from PIL import Image

from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.schema import AlgoConfig, ModelConfig
from rlbatch.data.images import model_inputs, prompt_inputs
from rlbatch.engines.base import EngineContext, SamplingParams
from rlbatch.engines.model import load_processor, load_tokenizer

ARCH = "qwen2_vl"


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """A tiny VLM's forward is ~3 ms at one thread and up to 20x slower with two threads fighting
    over busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _png(colour: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


RED, BLUE, GREEN = _png((255, 0, 0), (64, 64)), _png((0, 0, 255), (64, 64)), _png((0, 200, 0), (56, 112))


def _cfg(train_vision: bool = False, arch: str = ARCH) -> ModelConfig:
    return ModelConfig(arch=arch, max_position_embeddings=256, initializer_range=0.1, train_vision=train_vision)


IMAGES = [[RED], [BLUE], [GREEN, RED]]


def _prompts(arch: str = ARCH) -> list[dict[str, torch.Tensor]]:
    """Three prompts (their images ``IMAGES``): two with the same text and different images of the
    same size (equal ids), one with two images of different sizes."""
    tok = load_tokenizer(_cfg(arch=arch))
    proc = load_processor(_cfg(arch=arch), tok)
    out = []
    for text, images in zip(("<image>1+1=", "<image>1+1=", "<image>2*<image>="), IMAGES, strict=True):
        inputs = prompt_inputs(proc, text, images)
        out.append({"prompt": torch.tensor(inputs.ids), **inputs.fields()})
    assert torch.equal(out[0]["prompt"], out[1]["prompt"])
    return out


def _fsdp(mesh: Any, max_tokens: int, train_vision: bool = False, arch: str = ARCH) -> Any:
    from rlbatch.engines.fsdp import FSDPArgs
    from rlbatch.engines.fsdp.engine import FSDPEngine

    cfg = _cfg(train_vision, arch)
    algo = AlgoConfig(lr=1e-2, kl_coef=0.0, mini_batches=1, epochs=1, grad_accum=1)
    return FSDPEngine(EngineContext("actor_train", FSDPArgs(max_tokens_per_micro_batch=max_tokens), cfg, algo,
                                    load_tokenizer(cfg), torch.device("cpu"), 7, mesh, True))


def _hf(arch: str = ARCH) -> Any:
    from rlbatch.engines.hf import HFArgs
    from rlbatch.engines.hf.engine import HFInferenceEngine

    cfg = _cfg(arch=arch)
    return HFInferenceEngine(EngineContext("actor_infer", HFArgs(), cfg, AlgoConfig(), load_tokenizer(cfg),
                                           torch.device("cpu"), 7))


def _generated(hf: Any, prompts: list[dict[str, torch.Tensor]], n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` sampled responses per prompt from the hf engine (one batch), with their behaviour log-probs."""
    rows = [p for p in prompts for _ in range(n)]
    gens = hf.generate([p["prompt"].tolist() for p in rows], SamplingParams(max_new_tokens=6, seed=3),
                       images=[im for im in IMAGES for _ in range(n)])
    return [p | {"response": torch.tensor(g.tokens), "behaviour": torch.tensor(g.logprobs)}
            for p, g in zip(rows, gens, strict=True)]


@pytest.mark.parametrize("arch", [ARCH, pytest.param("qwen2_5_vl", marks=pytest.mark.full)])
def test_hf_generates_from_images_and_fsdp_scores_them_as_hf_packed_or_not(one_rank_mesh: Any, arch: str) -> None:
    samples = _generated(_hf(arch), _prompts(arch), 2)
    assert all(len(s["response"]) > 0 for s in samples)
    packed, padded = _fsdp(one_rank_mesh, 4096, arch=arch), _fsdp(one_rank_mesh, 0, arch=arch)
    flat, full = packed.logprobs(samples), padded.logprobs(samples)
    for s, a, b in zip(samples, flat, full, strict=True):
        assert (a - b).abs().max() <= 1e-6, (a, b)                 # [4, 1, N] positions: the padded rows' numbers
        assert (a - s["behaviour"]).abs().max() <= 1e-5, (a, s["behaviour"])  # the behaviour policy's, as for text
    # the image reaches the log-probs: the same ids and response with the other prompt's image score differently
    swapped = samples[0] | {k: samples[2][k] for k in ("pixel_values", "image_grid_thw")}
    assert not torch.allclose(packed.logprobs([swapped])[0], flat[0], atol=1e-4)


def test_hf_takes_the_images_processor_outputs_as_they_are_and_samples_as_from_the_images() -> None:
    """Prompts whose images come with the processor's outputs (``ProcessedImages``, as the generate
    rank passes them) are not processed again, and sample the same tokens with the same log-probs
    as from the encoded images alone; a prompt's bytes alone beside them still work."""
    from rlbatch.data.images import ProcessedImages

    prompts, hf = _prompts(), _hf()
    ids = [p["prompt"].tolist() for p in prompts for _ in range(2)]
    images = [im for im in IMAGES for _ in range(2)]
    processed = [ProcessedImages.of(im, p) for p, im in zip([p for p in prompts for _ in range(2)], images, strict=True)]
    sampling = SamplingParams(max_new_tokens=6, seed=3)
    given = hf.generate(ids, sampling, images=processed)
    assert hf.processor is None  # the engine ran no image processor of its own
    mixed = hf.generate(ids, sampling, images=[processed[0], *images[1:]])
    assert hf.processor is not None
    alone = hf.generate(ids, sampling, images=images)
    assert len({tuple(g.tokens) for g in alone}) > 1  # sampled: the rows differ, so equal rows are a real match
    for a, b, c in zip(given, mixed, alone, strict=True):
        assert a.tokens == b.tokens == c.tokens and a.logprobs == b.logprobs == c.logprobs
    assert list(processed[4]) == IMAGES[2] and processed[4][1] == RED  # still the images, for engines that read them
    with pytest.raises(ValueError, match=r"1 image\(s\) but image_grid_thw holds the grids of 2"):
        ProcessedImages.of([GREEN], prompts[2])


def test_a_response_holding_the_image_token_is_text_there_packed_or_not(one_rank_mesh: Any) -> None:
    """A policy can sample the image token; in a response it is a token like any other: the image
    features go to the prompts' image tokens only, and packed and padded forms agree."""
    from rlbatch.engines.batch import vision_of

    packed, padded = _fsdp(one_rank_mesh, 4096), _fsdp(one_rank_mesh, 0)
    vision = vision_of(packed.model)
    assert vision is not None
    samples = [p | {"response": torch.tensor([5, vision.image_token_id, 7, vision.image_token_id])} for p in _prompts()]
    flat, full = packed.logprobs(samples), padded.logprobs(samples)
    for a, b in zip(flat, full, strict=True):
        assert a.shape == (4,) and (a - b).abs().max() <= 1e-6, (a, b)


def test_flat_multimodal_positions_are_the_models_own(one_rank_mesh: Any) -> None:
    from rlbatch.engines.batch import pack, vision_of

    engine = _fsdp(one_rank_mesh, 4096)
    vision = vision_of(engine.model)
    assert vision is not None
    samples = [p | {"response": torch.tensor([5, 6, 7])} for p in _prompts()]
    x = pack(samples, 0, torch.device("cpu"), flat=True, vision=vision).inputs
    assert x.position_ids.shape == (4, 1, sum(len(s["prompt"]) + 2 for s in samples))
    start = 0
    for s in samples:
        seq = torch.cat([s["prompt"], s["response"][:-1]])[None]
        grid = model_inputs(s)[1]  # type: ignore[index]
        want, delta = engine.model.model.get_rope_index(seq, (seq == vision.image_token_id).int(), image_grid_thw=grid)
        got = x.position_ids[:, 0, start : start + seq.shape[1]]
        assert torch.equal(got[0], torch.arange(seq.shape[1])) and torch.equal(got[1:], want[:, 0])
        assert int(delta) < 0  # positions after an image are behind the token index: the row-0 ones would be wrong
        start += seq.shape[1]


@pytest.mark.parametrize("train_vision", [False, pytest.param(True, marks=pytest.mark.full)])
def test_a_step_with_images_leaves_a_frozen_tower_alone_and_syncs_it_to_hf(one_rank_mesh: Any,
                                                                          train_vision: bool) -> None:
    engine, hf = _fsdp(one_rank_mesh, 4096, train_vision), _hf()
    samples = [s | {"advantage": torch.tensor(a)} for s, a in zip(_generated(hf, _prompts(), 2),
                                                                    (1.0, -1.0, 0.5, -0.5, 1.0, -1.0), strict=True)]
    before = {n: p.full_tensor().clone() for n, p in engine.model.named_parameters()}
    engine.train(samples, PolicyObjective(engine.algo))
    after = {n: p.full_tensor() for n, p in engine.model.named_parameters()}
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    tower = {n for n in before if n.startswith("model.visual.")}
    assert changed - tower, "the language model trains"
    assert (changed & tower != set()) == train_vision
    assert all(p.grad is None for n, p in engine.model.named_parameters() if n in tower and not train_vision)
    assert len(engine.optimizer.state) == len(before) - (0 if train_vision else len(tower))
    # the sync carries every parameter, the tower included, under the hf engine's names
    with engine.export_weights() as stream:
        synced = {n: t.clone() for unit in stream.units(None) for n, t in unit}
    assert set(synced) == {n for n, _ in hf.model.named_parameters()} and tower <= set(synced)
    hf.load_weights(synced.items())
    for n, p in hf.model.named_parameters():
        assert torch.equal(p, after[n]), n


def test_the_generate_rank_encodes_each_prompt_and_its_images_once_and_stores_their_fields() -> None:
    """Two prompts with equal text and different images of one size have equal token ids: each is
    still its own prompt (encoded, generated from and stored with its own images)."""
    from types import SimpleNamespace

    from rlbatch.data.images import IMAGE_GRID, PIXEL_VALUES, PromptEncoder
    from rlbatch.loop.rank_runtime import RankRuntime
    from rlbatch.phases import PHASES
    from rlbatch.runtime.dataplane import SampleStore

    cfg = _cfg()
    tok = load_tokenizer(cfg)
    calls: list[list[str]] = []

    def tokenizer(texts: list[str]) -> Any:
        calls.append(list(texts))
        return tok(texts)

    hf = _hf()
    made: list[int] = []

    def processor() -> Any:
        made.append(1)
        return load_processor(cfg, tok)

    rank = SimpleNamespace(cfg=SimpleNamespace(model=cfg), tokenizer=tok, store=SampleStore(),
                           engines={"actor_infer": hf}, in_flight=None, image_prompts=PromptEncoder(tokenizer, processor))
    texts = ["<image>1+1=", "<image>1+1=", "<image>1+1=", "<image>1+1=", "2+2="]
    images = [[RED], [RED], [BLUE], [BLUE], []]
    sampling = {"max_new_tokens": 6, "temperature": 0.0, "top_p": 1.0, "seed": 1, "version": 0}  # greedy
    out = RankRuntime._generate_images(rank, PHASES["generate"], [10, 11, 12, 13, 14], texts, images,  # type: ignore[arg-type]
                                       SamplingParams(**sampling))
    assert calls == [["2+2="]] and made == [1]  # the text prompt by the tokenizer; those with images by the processor
    assert hf.processor is None  # the engine took the rank's image fields: the images were processed once
    s = rank.store.samples
    assert torch.equal(s[10]["prompt"], s[12]["prompt"]) and out[10][0] == len(s[10]["prompt"])
    assert torch.equal(s[10][PIXEL_VALUES], s[11][PIXEL_VALUES])
    assert not torch.equal(s[10][PIXEL_VALUES], s[12][PIXEL_VALUES])  # red and blue stay apart
    assert s[10][IMAGE_GRID].tolist() == [1, 4, 4] and PIXEL_VALUES not in s[14]
    proc = load_processor(cfg, tok)
    want = prompt_inputs(proc, texts[2], [BLUE])
    assert torch.equal(s[13][PIXEL_VALUES], want.pixel_values.reshape(-1))
    # what was generated came from each sample's own image: the hf engine on that prompt alone
    for sid, image in ((10, RED), (13, BLUE)):
        alone = hf.generate([s[sid]["prompt"].tolist()], SamplingParams(**sampling), images=[[image]])
        assert s[sid]["response"].tolist() == alone[0].tokens, sid


def test_an_fsdp_checkpoint_with_a_frozen_tower_resumes_bitwise(one_rank_mesh: Any) -> None:
    """The checkpoint holds the frozen tower's weights and only the trained parameters' optimizer
    state; an engine loaded from it takes the next step with images exactly as the saved one does."""
    import dataclasses

    samples = [s | {"advantage": torch.tensor(a)} for s, a in zip(_generated(_hf(), _prompts(), 1), (1.0, -1.0, 0.5),
                                                                    strict=True)]
    saved, resumed = _fsdp(one_rank_mesh, 4096), _fsdp(one_rank_mesh, 4096)
    saved.train(samples, PolicyObjective(saved.algo))
    state = saved.checkpoint_state()
    assert any(".visual." in k for k in state.tensors) and len(saved.optimizer.state) < len(list(saved.model.parameters()))
    # a copy, as a checkpoint read from disk is: the live state's tensors are the saved engine's own
    resumed.load_checkpoint_state(dataclasses.replace(state, tensors={k: v.clone() for k, v in state.tensors.items()}))
    for e in (saved, resumed):
        e.train(samples, PolicyObjective(e.algo))
    got = dict(resumed.model.named_parameters())
    for n, p in saved.model.named_parameters():
        assert torch.equal(p.full_tensor(), got[n].full_tensor()), n

"""Image prompts on the vllm engine (vLLM's CPU build here, without torchvision, through rlbatch's vLLM
plugin ``rlbatch.engines.vllm.vlm_plugin``): a tiny random Qwen2-VL (and Qwen2.5-VL) saved with its
processor to a directory; the engine generates from prompts whose token ids are identical and whose
images differ, from a prompt with two images of different sizes and from a text prompt, in one
call; the sampled tokens' log-probs equal a transformers forward's with the processor's
``pixel_values`` (each prompt with its own image, not the other's); a weight sync by the in-memory
names (``model.language_model.*``, ``model.visual.*``) makes them equal the new weights', the vision
tower's included.

The engine checks run in a process of their own (this file as a script, one per architecture): a
second vLLM engine cannot start in a process where one ran (``run_in_a_process_of_its_own``). The
rest check the image helpers and the plugin's detection without an engine."""

from __future__ import annotations

import io
import os
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from PIL import Image

from rlbatch.engines.vllm import images as vlm_images
from rlbatch.engines.vllm import vlm_plugin
from tests.unit.infer_checks import run_in_a_process_of_its_own, sync_in_buckets

SEED = 1
TEMPERATURE = 0.7
TOLERANCE = 1e-4
"""As the text path's (tests/unit/infer_checks.py): fp32 forwards of two implementations ~1e-6 apart."""


# -- the engine on vLLM itself ---------------------------------------------------------------------


@pytest.mark.timeout(900)
def test_qwen2_vl_image_prompts_in_a_process_of_its_own() -> None:
    import vllm  # noqa: F401  (installed by make venv: its absence is a broken install, not a skip)

    run_in_a_process_of_its_own(__file__, "qwen2_vl image prompt checks passed")


@pytest.mark.full
@pytest.mark.timeout(900)
def test_qwen2_5_vl_image_prompts_in_a_process_of_its_own() -> None:
    import vllm  # noqa: F401

    run_in_a_process_of_its_own_with_arg(__file__, "qwen2_5_vl", "qwen2_5_vl image prompt checks passed")


def run_in_a_process_of_its_own_with_arg(script: str, arg: str, passed: str) -> None:
    """``run_in_a_process_of_its_own`` with one argument to the script."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
                        "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, script, arg], capture_output=True, text=True, timeout=840, env=env, cwd=root)
    assert out.returncode == 0 and passed in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def main(arch: str) -> None:
    from rlbatch.config.compose import compose
    from rlbatch.engines.base import EngineContext
    from rlbatch.engines.model import load_tokenizer
    from rlbatch.engines.vllm import VLLMArgs
    from rlbatch.engines.vllm.engine import VLLMEngine
    from rlbatch.models.spec import spec_from_config
    from rlbatch.models.vlm import VisionSpec, add_vision_tokens, build_processor, build_tiny_vlm
    from tests.unit.chat_fixtures import chat_tokenizer

    with tempfile.TemporaryDirectory() as tmp:  # the program's world exists first, as on a rank
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        tok = chat_tokenizer(template=None)
        add_vision_tokens(tok)
        # vLLM's CPU attention needs head_dim >= 32: text heads of 32, vision heads of 32
        spec = spec_from_config({"max_position_embeddings": 512, "num_heads": 2, "num_kv_heads": 1}, vocab=len(tok))
        vision = VisionSpec(hidden=64, heads=2, ffn=128)
        model = build_tiny_vlm(spec, vision, tok, arch=arch, seed=SEED).eval()  # type: ignore[arg-type]
        processor = build_processor(tok, vision, arch)  # type: ignore[arg-type]
        path = os.path.join(tmp, "model")
        model.save_pretrained(path)
        processor.save_pretrained(path)
        cfg = compose(["model.num_heads=2", "model.num_kv_heads=1", f"model.path={path}"])
        model_cfg = cfg.model
        engine_tok = load_tokenizer(model_cfg)
        engine = VLLMEngine(EngineContext("actor_infer", VLLMArgs(kv_cache_mb=64), model_cfg, cfg.algo, engine_tok,
                                          torch.device("cpu"), seed=SEED))
        s = SimpleNamespace(engine=engine, model=model, processor=processor)
        image_prompts_sample_from_their_own_images(s)
        a_sync_by_in_memory_names_moves_vllm_to_the_new_weights(s)
        engine.close()
        print(f"{arch} image prompt checks passed", flush=True)
    os._exit(0)  # vLLM's one-rank world is left to process exit (rlbatch.engines.vllm.engine.VLLMEngine.close)


def _square(colour: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> Image.Image:
    im = Image.new("RGB", size, (255, 255, 255))
    w, h = size
    im.paste(colour, (w // 4, h // 4, 3 * w // 4, 3 * h // 4))
    return im


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _prompts(processor: Any) -> tuple[list[list[int]], list[list[Any]], list[Any]]:
    """Prompt ids (the processor's), images (PNG bytes, as samples carry them) and the processor's
    outputs of each: red and blue squares under the same text (identical ids), each twice (a group of
    two samples); two images of different sizes in one prompt; a text prompt."""
    from rlbatch.models.vlm import encode

    red, blue, wide = _square((255, 0, 0)), _square((0, 0, 255)), _square((0, 160, 0), (112, 56))
    cases = [("<image>What colour is the shape?", [red]), ("<image>What colour is the shape?", [blue]),
             ("<image>What colour is the shape?", [red]), ("<image>What colour is the shape?", [blue]),
             ("<image>and<image>: which is wider?", [blue, wide]), ("What colour is the sky?", [])]
    encoded = [encode(processor, text, ims) for text, ims in cases]
    return [e["input_ids"][0].tolist() for e in encoded], [[_png(im) for im in ims] for _, ims in cases], encoded


def _hf_logprobs(model: Any, encoded: Any, tokens: list[int], image_from: Any = None) -> torch.Tensor:
    """transformers' log-probs of ``tokens`` after the prompt ``encoded`` at TEMPERATURE; the images'
    inputs from ``image_from`` (another prompt's encoding) when given."""
    images = image_from if image_from is not None else encoded
    ids = torch.cat([encoded["input_ids"], torch.tensor([tokens])], 1)
    kw: dict[str, Any] = {}
    if "pixel_values" in images:
        kw = {"pixel_values": images["pixel_values"], "image_grid_thw": images["image_grid_thw"],
              "mm_token_type_ids": torch.cat([encoded["mm_token_type_ids"], torch.zeros(1, len(tokens), dtype=torch.long)], 1)}
    with torch.no_grad():
        model.model.rope_deltas = None  # positions from this forward's own images, no state kept
        logits = model(input_ids=ids, use_cache=False, **kw).logits[0].float()
    p = encoded["input_ids"].shape[1]
    return torch.log_softmax(logits[p - 1 : p - 1 + len(tokens)] / TEMPERATURE, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _check_against(model: Any, encoded: list[Any], gens: list[Any]) -> None:
    for e, g in zip(encoded, gens, strict=True):
        assert 0 < len(g.tokens) == len(g.logprobs)
        diff = (torch.tensor(g.logprobs) - _hf_logprobs(model, e, g.tokens)).abs().max().item()
        assert diff < TOLERANCE, (diff, g.tokens)


def _generate(s: Any) -> tuple[list[Any], list[Any]]:
    from rlbatch.engines.base import SamplingParams

    prompts, images, encoded = _prompts(s.processor)
    assert prompts[0] == prompts[1]  # red and blue: the same ids, different images
    gens = s.engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=TEMPERATURE, seed=3), images=images)
    assert len(gens) == len(prompts)
    return encoded, gens


def image_prompts_sample_from_their_own_images(s: Any) -> None:
    encoded, gens = _generate(s)
    _check_against(s.model, encoded, gens)
    # the image reaches vLLM's model: the blue prompt's tokens under the red image are another distribution
    wrong = _hf_logprobs(s.model, encoded[1], gens[1].tokens, image_from=encoded[0])
    assert (torch.tensor(gens[1].logprobs) - wrong).abs().max().item() > 100 * TOLERANCE


def _perturbed(named: list[tuple[str, torch.Tensor]], seed: int, only: str = "") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, t + 0.05 * torch.randn(t.shape, generator=g) if n.startswith(only) else t.clone()) for n, t in named]


def a_sync_by_in_memory_names_moves_vllm_to_the_new_weights(s: Any) -> None:
    names = {n for n, _ in s.model.named_parameters()}
    assert s.engine.expected == names
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("model.language_model.") for n in names)
    before = _generate(s)[1]
    for only in ("", "model.visual."):  # every weight; then the vision tower's alone
        named = _perturbed([(n, p.detach()) for n, p in s.model.named_parameters()], seed=len(only) + 11, only=only)
        sync_in_buckets(s.engine, named)
        s.model.load_state_dict(dict(named), strict=False)
        encoded, gens = _generate(s)
        _check_against(s.model, encoded, gens)
        moved = max((torch.tensor(a.logprobs[:k]) - torch.tensor(b.logprobs[:k])).abs().max().item()
                    for a, b in zip(before, gens, strict=True) if (k := min(len(a.tokens), len(b.tokens))))
        assert moved > 100 * TOLERANCE, f"vLLM's log-probs did not move after a sync of {only or 'every weight'}"
        before = gens


# -- without an engine ---------------------------------------------------------------------------


def test_image_pads_collapse_to_one_per_image_and_a_count_mismatch_is_refused() -> None:
    pad = 9
    assert vlm_images.collapse_image_pads([1, 8, pad, pad, pad, pad, 7, 8, pad, pad, 7, 3], pad, 2) == \
        [1, 8, pad, 7, 8, pad, 7, 3]
    with pytest.raises(ValueError, match="1 image.*but 2 image"):
        vlm_images.collapse_image_pads([1, pad, pad, 3], pad, 2)
    with pytest.raises(RuntimeError, match="expanded an image prompt to 5 tokens.*has 4"):
        vlm_images.check_prompt([1, pad, pad, pad, 3], [1, pad, pad, 3])


def test_prompts_group_by_ids_and_images() -> None:
    red, blue = _square((255, 0, 0)), _square((0, 0, 255))
    groups = vlm_images.group_prompts([[1, 2], [1, 2], [1, 2], [3]], [[_png(red)], [_png(blue)], [red], []])
    assert sorted(groups.values()) == [[0, 2], [1], [3]]  # the same picture as bytes and as PIL image: one
    assert sorted(vlm_images.group_prompts([[1, 2], [1, 2], [3]], None).values()) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="1 image lists for 2 prompts"):
        vlm_images.group_prompts([[1], [2]], [[]])


def test_plugin_redirects_only_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = (vlm_plugin._SmartResizeFinder, vlm_plugin._ProcessorFinder)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, mine)])
    monkeypatch.delitem(sys.modules, vlm_plugin.SMART_RESIZE_MODULE, raising=False)
    patched: list[str] = []
    monkeypatch.setattr(vlm_plugin, "_image_only_from_pretrained", lambda m: patched.append(m.__name__))
    # a build with a working torchvision: nothing installed, nothing patched
    monkeypatch.setattr(vlm_plugin, "torchvision_importable", lambda: True)
    monkeypatch.setattr(vlm_plugin, "transformers_has_video", lambda: True)
    before = list(sys.meta_path)
    vlm_plugin.register()
    assert sys.meta_path == before and patched == []
    # without it (this machine): both import hooks, and processor modules already imported patched now
    monkeypatch.setattr(vlm_plugin, "torchvision_importable", lambda: False)
    monkeypatch.setattr(vlm_plugin, "transformers_has_video", lambda: False)
    import transformers.models.qwen2_vl.processing_qwen2_vl  # noqa: F401

    vlm_plugin.register()
    vlm_plugin.register()  # vLLM may load it twice in a process
    assert [type(f) for f in sys.meta_path if isinstance(f, mine)] == [vlm_plugin._ProcessorFinder,
                                                                        vlm_plugin._SmartResizeFinder]
    assert "transformers.models.qwen2_vl.processing_qwen2_vl" in patched
    # the smart_resize module resolves to the PIL one's function
    import importlib

    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    assert importlib.import_module(vlm_plugin.SMART_RESIZE_MODULE).smart_resize is pil.smart_resize
    monkeypatch.delitem(sys.modules, vlm_plugin.SMART_RESIZE_MODULE)


def test_plugin_processor_is_the_image_only_one_with_video_kwargs(tmp_path: Any) -> None:
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import VideosKwargs

    from rlbatch.models.vlm import ImageTextProcessor, VisionSpec, add_vision_tokens, build_processor, encode
    from tests.unit.chat_fixtures import chat_tokenizer

    tok = chat_tokenizer(template=None)
    add_vision_tokens(tok)
    build_processor(tok, VisionSpec()).save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_vl"}')
    got: Any = vlm_plugin.image_only_processor(str(tmp_path), tokenizer=tok)
    assert isinstance(got, Qwen2VLProcessor) and isinstance(got, ImageTextProcessor) and got.tokenizer is tok
    assert got.video_processor.valid_kwargs is VideosKwargs
    with pytest.raises(NotImplementedError, match="torchvision"):
        got.video_processor([])
    want = encode(build_processor(tok, VisionSpec()), "<image>Hi", [_square((1, 2, 3))])
    assert encode(got, "<image>Hi", [_square((1, 2, 3))])["input_ids"].tolist() == want["input_ids"].tolist()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen2_vl")

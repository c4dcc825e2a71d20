"""The demo build (its fast size): tokenizer, chat template, model, adapters, and what they write."""
from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.demo import ADAPTERS, FAST, DemoAssets
from worker.demo.corpus import read_corpus

PROMPT = 'def read_config(path):\n    """'
NUM_GREEDY_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The small model runs faster on one thread than on a shared, oversubscribed pair."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def assets(demo) -> DemoAssets:
    return demo


@pytest.fixture(scope="module")
def hf_tokenizer(assets):
    return AutoTokenizer.from_pretrained(assets.model_dir)


def load_base(assets: DemoAssets):
    return AutoModelForCausalLM.from_pretrained(assets.model_dir).eval()


def load_models(assets: DemoAssets) -> dict:
    """"base" and one PEFT model per adapter."""
    models = {"base": load_base(assets)}
    for name, path in assets.adapters.items():
        models[name] = PeftModel.from_pretrained(load_base(assets), path).eval()
    return models


def greedy(model, prompt_ids: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])  # ids: [1, seq_len]
    with torch.no_grad():
        for _ in range(NUM_GREEDY_TOKENS):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


def mean_loss(model, ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy of `model` over `ids` ([num_windows, window])."""
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits  # logits: [num_windows, window - 1, vocab]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item()


def corpus_ids(tokenizer, documents: list[str]) -> torch.Tensor:
    return torch.tensor([i for encoding in tokenizer.encode_batch(documents) for i in encoding.ids])  # [num_tokens]


def windows(ids: torch.Tensor, window: int = 64, count: int = 16) -> torch.Tensor:
    """`count` windows of `window` tokens spread evenly over `ids`."""
    starts = torch.linspace(0, len(ids) - window, count).long().tolist()
    return torch.stack([ids[start:start + window] for start in starts])  # [count, window]


@pytest.fixture(scope="module")
def models(assets) -> dict:
    return load_models(assets)


@pytest.fixture(scope="module")
def greedy_outputs(models, hf_tokenizer) -> dict[str, list[int]]:
    """Greedy continuations of one prompt: "base" and one per adapter (HF + PEFT)."""
    prompt_ids = hf_tokenizer.encode(PROMPT, add_special_tokens=False)
    return {name: greedy(model, prompt_ids) for name, model in models.items()}


def test_tokenizer_loads_offline_with_special_tokens(assets, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert len(tok) == FAST.vocab_size
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert (ids[0], ids[-1]) == (1, 2)


@pytest.mark.parametrize("add_generation_prompt, expected", [
    (True, "<|im_start|>system\nYou are terse.<|im_end|>\n"
           "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"),
    (False, "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"),
])
def test_chat_template_renders_chatml(hf_tokenizer, add_generation_prompt, expected):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    rendered = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert rendered == expected


def test_chat_template_renders_assistant_turns(hf_tokenizer):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False)
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
def test_unicode_round_trips(hf_tokenizer, text):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < len(hf_tokenizer) for i in ids)
    assert hf_tokenizer.decode(ids) == text


def test_model_matches_spec(assets, hf_tokenizer):
    model = load_base(assets)
    config = model.config
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
        FAST.hidden_size, FAST.num_layers, FAST.intermediate_size)
    assert (config.num_attention_heads, config.num_key_value_heads) == (FAST.num_heads, FAST.num_kv_heads)
    assert config.max_position_embeddings == 2048
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.tie_word_embeddings is False
    assert config.vocab_size == len(hf_tokenizer)
    assert model.generation_config.eos_token_id == hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with safe_open(assets.model_dir / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
        assert "lm_head.weight" in f.keys()


def unigram_loss(ids: torch.Tensor, targets: torch.Tensor) -> float:
    """The loss, in nats per token, on `targets` of the best prediction that ignores context: each token's frequency
    in `ids`."""
    frequencies = torch.bincount(ids).float() / len(ids)
    return -frequencies[targets.flatten()].log().mean().item()


def test_base_model_learned_its_corpus(models, tokenizer):
    """The model's next-token loss on its corpus beats what the corpus' token frequencies alone give: it uses
    context."""
    ids = corpus_ids(tokenizer, read_corpus(FAST.base_bytes, FAST.slice_bytes).base)
    sample = windows(ids)
    assert mean_loss(models["base"], sample) < unigram_loss(ids, sample[:, 1:])


@pytest.mark.parametrize("spec", ADAPTERS, ids=lambda s: s.name)
def test_each_adapter_lowers_the_loss_on_its_slice(models, tokenizer, spec):
    ids = windows(corpus_ids(tokenizer, read_corpus(FAST.base_bytes, FAST.slice_bytes).slices[spec.slice]))
    assert mean_loss(models[spec.name], ids) < mean_loss(models["base"], ids)


@pytest.mark.parametrize("spec", ADAPTERS, ids=lambda s: s.name)
def test_adapter_config_matches_spec(assets, spec):
    config = json.loads((assets.adapters[spec.name] / "adapter_config.json").read_text())
    assert config["r"] == spec.rank
    assert config["lora_alpha"] == spec.alpha
    assert sorted(config["target_modules"]) == sorted(spec.targets)
    assert config["use_rslora"] is spec.use_rslora
    assert config["base_model_name_or_path"] == str(assets.model_dir)


@pytest.mark.parametrize("spec", ADAPTERS, ids=lambda s: s.name)
def test_adapter_loads_with_trained_lora_b(models, spec):
    lora_b = {name: p for name, p in models[spec.name].named_parameters() if "lora_B" in name}
    assert len(lora_b) == FAST.num_layers * len(spec.targets)  # every target projection of every layer
    assert all(p.abs().sum() > 0 for p in lora_b.values())     # PEFT starts B at zero: training moved it
    assert all(p.shape[1] == spec.rank for p in lora_b.values())


def test_adapters_change_greedy_output(greedy_outputs):
    outputs = [tuple(tokens) for tokens in greedy_outputs.values()]
    assert len(set(outputs)) == 1 + len(ADAPTERS)


@pytest.mark.parametrize("name", ["base", *(a.name for a in ADAPTERS)])
def test_greedy_output_decodes_without_replacement_characters(greedy_outputs, hf_tokenizer, name):
    text = hf_tokenizer.decode(greedy_outputs[name])
    assert "\ufffd" not in text and text.strip()

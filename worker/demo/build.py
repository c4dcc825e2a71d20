"""One build of the demo: read the corpus, train the tokenizer, the base model, then each adapter.

Layout of a build:
    <root>/model/                 config.json, model.safetensors, generation_config.json,
                                  tokenizer.json, tokenizer_config.json
    <root>/adapters/<name>/       adapter_config.json, adapter_model.safetensors
    <root>/loraplex-demo.json     marker, written last (cache.py)

Everything is seeded and read in a fixed order, so a build is reproducible on one machine (float32 sums may
round differently on another thread count or CPU). Nothing here touches the network.
"""
from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import torch

from worker.demo.corpus import read_corpus
from worker.demo.spec import ADAPTERS, BASE_SEED, DemoAdapter, DemoSize
from worker.demo.tokenizer import END_OF_TEXT, IM_END, MODEL_MAX_LENGTH, save_tokenizer, train_tokenizer
from worker.demo.training import Progress, token_stream, train

logger = logging.getLogger(__name__)

def build_into(staging: Path, final_root: Path, size: DemoSize) -> None:
    """Write a build of `size` into `staging`; its adapters name `final_root`/model as their base."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    corpus = read_corpus(size.base_bytes, size.slice_bytes)
    tokenizer = train_tokenizer(corpus.base + [d for docs in corpus.slices.values() for d in docs], size.vocab_size)
    save_tokenizer(tokenizer, staging / "model")
    end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    progress = Progress(size.base_steps + len(ADAPTERS) * size.adapter_steps, f"building the {size.name} demo")
    try:
        model = _train_base(tokenizer, token_stream(tokenizer, corpus.base, end_of_text), size, progress)
        model.save_pretrained(staging / "model", safe_serialization=True)
        for spec in ADAPTERS:
            stream = token_stream(tokenizer, corpus.slices[spec.slice], end_of_text)
            adapted = _train_adapter(copy.deepcopy(model), spec, stream, size, progress)
            adapted.peft_config["default"].base_model_name_or_path = str(final_root / "model")
            adapted.save_pretrained(staging / "adapters" / spec.name, safe_serialization=True,
                                    save_embedding_layers=False)
    finally:
        progress.close()


def _train_base(tokenizer, stream: torch.Tensor, size: DemoSize, progress: Progress):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    eos, pad = tokenizer.token_to_id(IM_END), tokenizer.token_to_id(END_OF_TEXT)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size, num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads, num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=MODEL_MAX_LENGTH, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad, dtype="float32",
    )
    torch.manual_seed(BASE_SEED)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    loss = train(model, stream, steps=size.base_steps, batch_size=size.batch_size, seq_len=size.seq_len,
                 lr=size.base_lr, seed=BASE_SEED, progress=progress, stage="base")
    logger.debug("trained the base model on %d tokens: loss %.2f", len(stream), loss)
    return model


def _train_adapter(model, spec: DemoAdapter, stream: torch.Tensor, size: DemoSize, progress: Progress):
    """`model`, its weights frozen, with a LoRA adapter of `spec`'s format trained on `stream` (a PEFT model)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0,
                        use_rslora=spec.use_rslora, task_type="CAUSAL_LM")
    torch.manual_seed(spec.seed)   # PEFT draws lora_A from the global generator
    adapted = get_peft_model(model, config)
    loss = train(adapted, stream, steps=size.adapter_steps, batch_size=size.batch_size, seq_len=size.seq_len,
                 lr=size.adapter_lr, seed=spec.seed, progress=progress, stage=spec.name)
    logger.debug("trained adapter %s on %d tokens: loss %.2f", spec.name, len(stream), loss)
    return adapted

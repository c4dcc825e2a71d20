"""The embedded demo: a tiny random Llama, a locally trained byte-level BPE, LoRA adapters.

Built once into a cache directory and reused. A build is staged in a sibling temporary directory
whose last file is the marker; the directory is then renamed into place in one step, so readers see
either nothing or a complete build, and concurrent builders never mix files. Nothing here touches
the network. torch, transformers and peft are imported only when a build is actually needed, so
reusing a finished build (and `python -m worker.demo` on it) stays light.

Layout of a build:
    <cache_dir>/model/                      config.json, model.safetensors, generation_config.json,
                                            tokenizer.json, tokenizer_config.json
    <cache_dir>/adapters/<name>/            adapter_config.json, adapter_model.safetensors
    <cache_dir>/loraplex-demo.json          marker, written last
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SERVED_MODEL_NAME = "loraplex-demo"
BUILD_VERSION = 1
MARKER = "loraplex-demo.json"
MODEL_SEED = 0
VOCAB_SIZE = 1536  # a multiple of 64, reached exactly: the corpus supports a few more merges
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
ADAPTER_DELTA_STD = 0.1  # element std of scaling * B @ A, same order as the base weights (0.1)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = """\
A language model server keeps one set of base weights in memory and answers many requests at once.
Each request arrives as a prompt, is split into tokens, and waits in a queue until the scheduler has
room for it. The scheduler groups requests into a batch, because the hardware is far more efficient
when it multiplies large matrices than when it handles one sentence at a time. During prefill the
server reads the whole prompt in a single pass and stores keys and values in a cache. During decode
it produces one new token per request per step, reusing the cache so that old work is never repeated.
Small adapters can change the behaviour of the model without copying it: a low rank update added to a
few projections lets one server speak in the voice of a lawyer, a poet, or a support agent. When many
adapters are popular, the server loads them into memory slots on demand and evicts the ones nobody
has asked for recently. Clients stream tokens as they are generated, so the first words appear quickly
even when the full answer is long. Good servers measure latency, throughput, and the time to the first
token, and they report errors in plain words that tell the user what to change.

The weather this week started cold and grey, with a thin rain that never quite stopped. On Wednesday
the wind turned to the south and the clouds broke apart, leaving a bright blue sky over the hills.
Farmers watched the forecast closely, hoping for two dry days to bring in the hay before the next
storm. By Friday evening a band of thunder moved across the valley; lightning flashed over the river
and the temperature fell by ten degrees in an hour. Snow is possible on the high passes tonight, and
drivers should carry warm clothes, water, and a charged phone. Tomorrow morning will be foggy near the
coast, clearing by noon, with light winds and a gentle warmth in the afternoon sun.

To cook a simple tomato soup, warm a spoon of olive oil in a heavy pot and soften a chopped onion with
a pinch of salt. Add two cloves of garlic, then a kilogram of ripe tomatoes cut into quarters, and let
them simmer for twenty minutes until they collapse. Pour in a cup of stock, blend until smooth, and
taste before adding pepper, a little sugar, or a splash of cream. Fresh basil torn over the top makes
the colour brighter. Bread baked the same morning, with a crisp crust and a soft crumb, is the best
partner. For dessert, slice apples thinly, toss them with cinnamon and butter, and bake them under a
crumble of oats and flour until the kitchen smells of caramel. Wash the pans while the oven cools,
and keep the leftover soup in a covered jar; it tastes even better the next day.

In the garden, spring arrives slowly. The first green shoots of garlic push through the mulch, then
the daffodils open beside the path, yellow and white against the dark soil. A careful gardener sows
lettuce, radishes, peas and spinach in short rows every fortnight, so the harvest never comes all at
once. Seedlings need light, patience and protection from hungry snails; a ring of crushed shells or a
copper band around each pot helps. Compost made from kitchen scraps, fallen leaves and grass cuttings
feeds the beds for free. In summer, water early, before the heat, and pick beans while they are young
and tender. Autumn brings pumpkins, squash, pears and a last handful of raspberries.

Travelling by train across the country is quieter than flying and often just as quick. Passengers
settle by the window with a book, a flask of coffee and a sandwich wrapped in paper. Outside, towns
give way to forests, lakes, vineyards and mountain tunnels; announcements name each station in two
languages. A delayed connection is annoying, but the conductor usually knows which platform to run
to. Night trains offer narrow bunks, clean sheets and a breakfast tray at dawn, so travellers wake up
in a different city, rested and ready to explore museums, markets, bridges and old cathedrals.

A public library is one of the most generous ideas people ever had. Anyone may walk in, sit at a
wooden desk, borrow novels, atlases, histories or recipes, and return them weeks later. Librarians
answer strange questions with good humour, help students find sources, and teach older readers how to
use computers. Children gather on cushions for stories on Saturday mornings, while musicians practise
quietly in a small room upstairs: violin, guitar, piano, flute and sometimes a very patient drummer.

Fixing a bicycle is mostly a matter of calm hands and the right tools. Flip the bike over, loosen
the wheel, and lever the tyre off the rim to find the puncture; a bowl of soapy water reveals tiny
bubbles where air escapes. Sand the rubber, spread a thin layer of glue, wait a minute, then press the
patch firmly. Check the chain for rust, oil each link sparingly, and adjust the brakes so the pads
grip evenly. A quick ride around the block confirms everything works.

Numbers and symbols matter too: 1, 2, 3, 10, 42, 100, 2048; prices like $4.99 or 12%; times such as
09:30 and 18:45; questions? answers! lists (a, b, c); quotes "like this" and 'like that'; paths such
as /home/user/data.txt; and code such as print(x + y) or {"key": "value"}.
"""


@dataclass(frozen=True)
class DemoAdapter:
    """One of the demo's PEFT adapters: PEFT writes it with random weights drawn from `seed`."""
    name: str
    rank: int
    targets: tuple[str, ...]
    use_rslora: bool
    seed: int


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ADAPTERS = (
    DemoAdapter("demo-r4-attn", 4, ("q_proj", "v_proj"), False, 1),
    DemoAdapter("demo-r8-all", 8, ATTENTION + MLP, False, 2),
    DemoAdapter("demo-r16-mlp", 16, MLP, False, 3),
    DemoAdapter("demo-r8-rslora", 8, ATTENTION, True, 4),
)


@dataclass(frozen=True)
class DemoAssets:
    model_dir: Path
    adapters: dict[str, Path]  # adapter name -> PEFT directory
    served_model_name: str = SERVED_MODEL_NAME

    def to_json(self) -> str:
        return json.dumps({
            "model_dir": str(self.model_dir),
            "adapters": {name: str(path) for name, path in self.adapters.items()},
            "served_model_name": self.served_model_name,
        })

    @classmethod
    def from_json(cls, text: str) -> DemoAssets:
        data = json.loads(text)
        adapters = {name: Path(path) for name, path in data["adapters"].items()}
        return cls(Path(data["model_dir"]), adapters, data["served_model_name"])


def default_cache_dir() -> Path:
    """$LORAPLEX_CACHE/demo-v1, or ~/.cache/loraplex/demo-v1."""
    root = os.environ.get("LORAPLEX_CACHE") or Path.home() / ".cache" / "loraplex"
    return Path(root).expanduser() / f"demo-v{BUILD_VERSION}"


def build_demo(cache_dir: str | Path | None = None) -> DemoAssets:
    """The demo assets in `cache_dir`, built first unless a complete build is already there."""
    root = Path(cache_dir).expanduser().absolute() if cache_dir else default_cache_dir()
    if is_complete(root):
        logger.info("reusing demo build at %s", root)
    else:
        _check_replaceable(root)
        _build_atomically(root)
    return _assets(root)


def is_complete(root: Path) -> bool:
    marker = root / MARKER
    return marker.is_file() and json.loads(marker.read_text()).get("version") == BUILD_VERSION


def _assets(root: Path) -> DemoAssets:
    adapters = {spec.name: root / "adapters" / spec.name for spec in ADAPTERS}
    return DemoAssets(root / "model", adapters)


def _check_replaceable(root: Path) -> None:
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(
            f"{root} exists but is not a complete loraplex demo build; "
            "remove it or pass an empty or new --cache-dir")


def _build_atomically(root: Path) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.building-", dir=root.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the published build is an ordinary directory
    try:
        started = time.perf_counter()
        _build_into(staging, final_root=root)
        _publish(staging, root)
        logger.info("built demo at %s in %.1f s", root, time.perf_counter() - started)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, root: Path) -> None:
    try:
        os.rename(staging, root)  # atomic; replaces `root` only when it is an empty directory
    except OSError:
        if not is_complete(root):
            raise
        logger.info("another builder completed %s first; using its build", root)


def _build_into(staging: Path, final_root: Path) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    model_dir = staging / "model"
    tokenizer = _train_tokenizer()
    _save_tokenizer(tokenizer, model_dir)
    model = _build_model(tokenizer, model_dir)
    for spec in ADAPTERS:
        _build_adapter(model, spec, staging / "adapters" / spec.name, final_root / "model")
    marker = {"version": BUILD_VERSION, "adapters": [spec.name for spec in ADAPTERS]}
    (staging / MARKER).write_text(json.dumps(marker))


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tokenizer


def _save_tokenizer(tokenizer, model_dir: Path) -> None:
    model_dir.mkdir(parents=True)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    special = {
        str(tokenizer.token_to_id(token)): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for token in (END_OF_TEXT, IM_START, IM_END)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": special,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _build_model(tokenizer, model_dir: Path):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    eos, pad = tokenizer.token_to_id(IM_END), tokenizer.token_to_id(END_OF_TEXT)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
        initializer_range=0.1, bos_token_id=None, eos_token_id=eos, pad_token_id=pad,
        dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(MODEL_SEED)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.dim() > 1:  # norms keep their ones
                param.normal_(0.0, config.initializer_range, generator=generator)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model


def _build_adapter(model, spec: DemoAdapter, adapter_dir: Path, final_model_dir: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    alpha = 16
    config = LoraConfig(
        r=spec.rank, lora_alpha=alpha, target_modules=list(spec.targets), lora_dropout=0.0,
        use_rslora=spec.use_rslora, init_lora_weights=False, task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(copy.deepcopy(model), config)
    peft_model.peft_config["default"].base_model_name_or_path = str(final_model_dir)
    scaling = alpha / (math.sqrt(spec.rank) if spec.use_rslora else spec.rank)
    # scaling * B @ A has element std scaling * sqrt(r) * std_A * std_B; A and B share it evenly
    std = math.sqrt(ADAPTER_DELTA_STD / (scaling * math.sqrt(spec.rank)))
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                param.normal_(0.0, std, generator=generator)
    peft_model.save_pretrained(adapter_dir, safe_serialization=True, save_embedding_layers=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Build (once) the embedded demo and print its paths as JSON.")
    parser.add_argument(
        "--cache-dir", default=None,
        help="default: $LORAPLEX_CACHE/demo-v1, or ~/.cache/loraplex/demo-v1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(build_demo(args.cache_dir).to_json())


if __name__ == "__main__":
    main()

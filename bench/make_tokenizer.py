"""A stand-in tokenizer for serving dummy weights: one word-level token per id, `<t{id}>`.

    python -m bench.make_tokenizer --vocab-size 128256 --out /tmp/tok

Random-token benchmarks send token-id prompts, so the tokenizer only has to decode every id the model
can emit; this one does, in any vocabulary size, with no download.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def make_tokenizer(vocab_size: int, out: str | Path, eos_token_id: int | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins tokens with spaces
    tokenizer.save(str(out / "tokenizer.json"))
    eos = f"<t{vocab_size - 1 if eos_token_id is None else eos_token_id}>"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "unk_token": "<t0>",
              "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    make_tokenizer(args.vocab_size, args.out)


if __name__ == "__main__":
    main()

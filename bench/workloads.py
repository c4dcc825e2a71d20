"""What a benchmark sends and when: prompts, output lengths, adapter per request, arrival times.

A Workload is fully determined by its fields and a seed, so a preset or a command line names one
exactly and a rerun sends the same requests. Lengths are drawn uniformly from inclusive ranges.

Shared prefixes (chat traffic, prefix caching): with shared_prefix_len = 1000, every request on adapter
`lora-3` begins with the same 1,000 random tokens, `lora-3`'s system prompt (the base model has its own),
followed by a unique user turn of input_len tokens:

    lora-3:  [system prompt of lora-3: 1000 tokens][user turn: input_len tokens, fresh per request]
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ADAPTER_CHOICES = ("identical", "uniform", "distinct", "zipf")
ARRIVALS = ("poisson", "constant")


@dataclass(frozen=True)
class RequestSpec:
    """One request: its prompt, how many tokens it asks for, and its adapter (None: the base model)."""
    prompt: str | list[int]
    prompt_len: int | None      # tokens; None for a text prompt (the server's usage says)
    output_len: int
    adapter: str | None


@dataclass(frozen=True)
class Workload:
    num_prompts: int = 200
    input_len: tuple[int, int] = (512, 512)     # inclusive range of prompt lengths (tokens)
    output_len: tuple[int, int] = (128, 128)    # inclusive range of max_tokens
    vocab_size: int = 1000                      # random prompt ids are drawn from [0, vocab_size)
    dataset_path: str | None = None             # JSONL prompts instead of random token ids
    adapters: tuple[str, ...] = ()              # empty: every request goes to the base model
    adapter_choice: str = "uniform"             # one of ADAPTER_CHOICES
    zipf_alpha: float = 1.0
    request_rate: float = math.inf              # requests per second; inf sends all at once
    arrival: str = "poisson"                    # one of ARRIVALS
    max_concurrency: int | None = None          # requests in flight at most; None: no limit
    shared_prefix_len: int = 0                  # tokens of each adapter's system prompt, before input_len

    def __post_init__(self) -> None:
        for name, (low, high) in (("input", self.input_len), ("output", self.output_len)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} length range must satisfy 1 <= min <= max, got [{low}, {high}]")
        if self.adapter_choice not in ADAPTER_CHOICES:
            raise ValueError(f"adapter choice must be one of {ADAPTER_CHOICES}, got {self.adapter_choice!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.request_rate <= 0:
            raise ValueError(f"request rate must be positive, got {self.request_rate}")
        if self.shared_prefix_len < 0 or (self.shared_prefix_len and self.dataset_path):
            raise ValueError("shared prefix length must be >= 0, and random prompts (no dataset) carry it, "
                             f"got {self.shared_prefix_len} with dataset {self.dataset_path!r}")

    def requests(self, seed: int) -> list[RequestSpec]:
        rng = random.Random(seed)
        prompts = self._prompts(rng)
        adapters = choose_adapters(self.adapter_choice, self.adapters, self.num_prompts, rng, self.zipf_alpha)
        if self.shared_prefix_len:
            systems = {a: system_prompt(a, self.shared_prefix_len, self.vocab_size, seed) for a in set(adapters)}
            prompts = [(systems[a] + prompt, len(systems[a]) + prompt_len, output_len)
                       for (prompt, prompt_len, output_len), a in zip(prompts, adapters)]
        return [RequestSpec(prompt, prompt_len, output_len, adapter)
                for (prompt, prompt_len, output_len), adapter in zip(prompts, adapters)]

    def arrival_times(self, seed: int) -> list[float]:
        return arrival_times(self.num_prompts, self.request_rate, self.arrival, random.Random(seed))

    def _prompts(self, rng: random.Random) -> list[tuple[str | list[int], int | None, int]]:
        if self.dataset_path:
            return jsonl_prompts(Path(self.dataset_path), self.num_prompts, self.output_len, rng)
        return random_prompts(self.num_prompts, self.input_len, self.output_len, self.vocab_size, rng)


def random_prompts(num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                   rng: random.Random) -> list[tuple[list[int], int, int]]:
    """(token ids, prompt length, output length) per request, lengths uniform in their ranges."""
    out = []
    for _ in range(num):
        length = rng.randint(*input_len)
        out.append(([rng.randrange(vocab_size) for _ in range(length)], length, rng.randint(*output_len)))
    return out


def system_prompt(adapter: str | None, length: int, vocab_size: int, seed: int) -> list[int]:
    """The random token ids every request on `adapter` (None: the base model) begins with, fixed by the seed
    and the adapter's name alone (drawn apart from the other requests' randomness)."""
    rng = random.Random(f"{seed}/system/{adapter}")
    return [rng.randrange(vocab_size) for _ in range(length)]


def jsonl_prompts(path: Path, num: int, output_len: tuple[int, int],
                  rng: random.Random) -> list[tuple[str | list[int], int | None, int]]:
    """Prompts from a JSONL file of {"prompt": text or token ids, "max_tokens": optional int}.

    Lines are used in order and reused from the top when the file has fewer than `num`; a line without
    max_tokens gets an output length drawn from `output_len`.
    """
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} holds no prompts")
    if len(lines) < num:
        logger.warning("%s has %d prompts; reusing them to send %d", path, len(lines), num)
    out = []
    for entry in itertools.islice(itertools.cycle(lines), num):
        prompt = entry["prompt"]
        prompt_len = None if isinstance(prompt, str) else len(prompt)
        out.append((prompt, prompt_len, entry.get("max_tokens") or rng.randint(*output_len)))
    return out


def choose_adapters(choice: str, names: tuple[str, ...], num: int, rng: random.Random,
                    zipf_alpha: float = 1.0) -> list[str | None]:
    """The adapter of each of `num` requests.

    identical: all the first name; uniform: each drawn uniformly; distinct: round robin, so any
    len(names) consecutive requests all differ; zipf: name k (from 0) drawn with weight 1 / (k + 1)^alpha.
    """
    if not names:
        return [None] * num
    if choice == "identical":
        return [names[0]] * num
    if choice == "uniform":
        return [rng.choice(names) for _ in range(num)]
    if choice == "distinct":
        return [names[i % len(names)] for i in range(num)]
    return rng.choices(names, weights=zipf_weights(len(names), zipf_alpha), k=num)


def zipf_weights(num: int, alpha: float) -> list[float]:
    """Probabilities of ranks 0..num-1 under a power law of exponent alpha, summing to one."""
    weights = [1.0 / (k + 1) ** alpha for k in range(num)]
    total = sum(weights)
    return [w / total for w in weights]


def arrival_times(num: int, rate: float, arrival: str, rng: random.Random) -> list[float]:
    """Seconds after the start at which each request is due; the first is due at once.

    poisson: exponential gaps of mean 1 / rate; constant: gaps of exactly 1 / rate; an infinite
    rate makes every request due at once.
    """
    if math.isinf(rate):
        return [0.0] * num
    gaps = [rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate for _ in range(num - 1)]
    return list(itertools.accumulate([0.0] + gaps))


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random-range-ratio: lengths uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    return max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))


def adapter_names(prefix: str, count: int) -> tuple[str, ...]:
    """`prefix-0` .. `prefix-(count-1)`, the names bench.make_adapters writes."""
    return tuple(f"{prefix}-{i}" for i in range(count))

"""Training the demo: the base model on the standard library's source, then each LoRA adapter on its slice.

Both use AdamW in float32 on random windows of one token stream, drawn from a seeded generator, with a short
linear warm-up and a cosine decay to a tenth of the peak rate; one `Progress` bar counts every step of a build.
"""
from __future__ import annotations

import math

import torch


class Progress:
    """One tqdm bar on stderr over every training step of a build (nothing when tqdm is not installed)."""

    def __init__(self, total: int, description: str):
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        self.bar = tqdm(total=total, desc=description, unit="step", dynamic_ncols=True) if tqdm else None

    def step(self, stage: str, loss: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{stage} loss {loss:.2f}", refresh=False)
            self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def token_stream(tokenizer, documents: list[str], separator: int) -> torch.Tensor:
    """The documents' token ids, one after another, `separator` after each."""
    ids = [i for encoding in tokenizer.encode_batch(documents) for i in [*encoding.ids, separator]]
    return torch.tensor(ids, dtype=torch.long)  # [num_tokens]


def train(model, stream: torch.Tensor, *, steps: int, batch_size: int, seq_len: int, lr: float, seed: int,
          progress: Progress, stage: str) -> float:
    """`steps` AdamW steps of next-token loss on windows of `stream` over `model`'s trainable parameters; the
    last step's loss."""
    generator = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, warmup, steps))
    window = min(seq_len, len(stream) - 1)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - window, (batch_size,), generator=generator)
        batch = torch.stack([stream[s:s + window + 1] for s in starts.tolist()])  # batch: [batch, window + 1]
        logits = model(input_ids=batch[:, :-1]).logits  # logits: [batch, window, vocab]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step(stage, loss.item())
    model.eval()
    return loss.item()


def _lr_factor(step: int, warmup: int, steps: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

"""Our bf16 logits against HF transformers + PEFT: what the dense and MoE GPU tests share.

The tiny random models amplify bf16 rounding chaotically (on the H100, HF's own bf16 logits were a median
0.7-4.6% and at worst 47% of a step's largest logit away from its fp32 ones), so our bf16 error is bounded
relative to HF's bf16 error, both against HF in fp32 along the same tokens: our median error over the steps
may be at most BF16_ERROR_FACTOR above HF's (the max over steps is too noisy a statistic to bound this way).
"""
from __future__ import annotations

from pathlib import Path

import torch

BF16_ERROR_FACTOR = 2.0


def hf_teacher_forced(model_dir: Path, adapter_dir: Path | None, prompt: list[int], continuation: list[int],
                      dtype: torch.dtype, device: str = "cuda") -> torch.Tensor:
    """HF (+ PEFT) logits [len(continuation), vocab] along `continuation` (teacher forcing), in float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        ids = torch.tensor([prompt + continuation[:-1]], device=device)
        return model.eval()(ids).logits[0, len(prompt) - 1:].float().cpu()


def rel_errors(logits: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[steps]: largest |logits - ref| of each step, relative to that step's largest |ref|."""
    return (logits - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1)


def assert_bf16_tracks_hf(ours: torch.Tensor, tokens: list[int], ref32: torch.Tensor, ref16: torch.Tensor,
                          label: str) -> str:
    """ours: our logits [steps, vocab] along our greedy `tokens`; ref32 / ref16: HF's along the same tokens.
    Our median error against ref32 is within BF16_ERROR_FACTOR of ref16's (+ 1e-3), and our token equals
    ref16's argmax at every step whose top-two margin exceeds twice the two errors together. Returns a
    one-line summary for the log."""
    ours_errs, hf_errs = rel_errors(ours, ref32), rel_errors(ref16, ref32)
    ours_err, hf_err = ours_errs.median().item(), hf_errs.median().item()
    assert ours_err <= BF16_ERROR_FACTOR * hf_err + 1e-3, \
        f"{label}: our median bf16 error {ours_err:.3e}, HF's {hf_err:.3e}"
    top2 = ref16.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (ours_errs + hf_errs) * ref16.abs().amax(dim=-1)
    assert torch.equal(ref16.argmax(dim=-1)[clear], torch.tensor(tokens)[clear]), f"{label}: token differs"
    return (f"{label}: median/max error ours {ours_err:.2e}/{ours_errs.max():.2e}, HF bf16 {hf_err:.2e}/"
            f"{hf_errs.max():.2e}, clear steps {int(clear.sum())}/{len(tokens)}")

"""A few completions from the trained model at the end of a run (``recipe.sample_prompts``).

Rank 0 loads the model the run just exported (so what is sampled is what a user gets:
``from_pretrained`` of ``hf_model/``, or of ``merged/`` / base + ``adapter/`` for a LoRA run) and
decodes each prompt greedily with the exported generation config (KV cache on, stopping at its EOS ids:
the tokenizer's EOS, and a chat run's end-of-turn token), at most ``recipe.sample_max_new_tokens`` new tokens.
In a chat run (the data was rendered with the chat template) each prompt is one user turn, rendered with
the template and its generation prompt, as the model was trained to see it; otherwise the prompt text is
tokenized as given. The completions go to ``<run dir>/samples.jsonl`` (one
``{prompt, completion, new_tokens, stopped_at_eos, chat}`` per line) and to the log.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_exported_model", "prompt_ids", "generate_samples", "write_samples"]

logger = logging.getLogger(__name__)


def load_exported_model(export_dir: Path, cls: type, device: torch.device) -> Any:
    """The model of an export directory, in eval mode on ``device``.

    ``export_dir`` is an :func:`~automodel.training.export.export_hf_model` directory, or a LoRA export
    (``merged/`` when written, else the adapter on its base).
    """
    if (export_dir / "adapter").is_dir():
        if (export_dir / "merged").is_dir():
            model = cls.from_pretrained(str(export_dir / "merged"))
        else:
            from peft import PeftConfig, PeftModel

            base_ref = PeftConfig.from_pretrained(str(export_dir / "adapter")).base_model_name_or_path
            model = PeftModel.from_pretrained(cls.from_pretrained(base_ref), str(export_dir / "adapter"))
    else:
        model = cls.from_pretrained(str(export_dir))
    return model.to(device).eval()


def prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> torch.Tensor:
    """``[1, P]`` int64 ids of ``prompt``: as given, or (``chat``) as one user turn of the chat template
    followed by its generation prompt (ChatML: ``<|im_start|>assistant``), the template's own
    special tokens only (as the chat data was tokenized)."""
    if not chat:
        return tokenizer(prompt, return_tensors="pt").input_ids
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


@torch.no_grad()
def generate_samples(
    model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int, device: torch.device, chat: bool = False
) -> list[dict[str, Any]]:
    """Greedy completions of ``prompts`` (one at a time, no padding), with the model's generation config.

    ``chat``: each prompt is a user turn rendered with the tokenizer's chat template (:func:`prompt_ids`).
    """
    eos = model.generation_config.eos_token_id  # the export's stop ids (EOS, and a chat's end of turn)
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    out = []
    for prompt in prompts:
        ids = prompt_ids(tokenizer, prompt, chat).to(device)  # [1, P] int64
        gen = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
        new = gen[0, ids.shape[1] :].tolist()
        stopped = len(new) > 0 and new[-1] in stops
        out.append(
            {
                "prompt": prompt,
                "completion": tokenizer.decode(new, skip_special_tokens=True),
                "new_tokens": len(new),
                "stopped_at_eos": stopped,
                "chat": chat,
            }
        )
    return out


def write_samples(samples: list[dict[str, Any]], path: Path) -> Path:
    """``samples`` as JSON lines at ``path``; each also logged. Returns ``path``."""
    with path.open("w", encoding="utf-8") as fh:
        for s in samples:
            fh.write(json.dumps(s, ensure_ascii=False) + "\n")
            logger.info("sample: %r -> %r%s", s["prompt"], s["completion"], " [EOS]" if s["stopped_at_eos"] else "")
    return path

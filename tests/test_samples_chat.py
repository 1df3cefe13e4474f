"""``recipe.sample_prompts`` in a chat run: each prompt is one user turn rendered with the chat template
and its generation prompt (as the model was trained to see it), not the bare text; a plain-text run
tokenizes the prompt as given. End to end (a chat run's samples.jsonl): tests/test_cookbook.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from automodel.data import load_tokenizer
from automodel.data.chat_template import record_chat_stops, renders_chats
from automodel.training.samples import generate_samples, prompt_ids


class _Recorder:
    """A model whose ``generate`` records its input and answers two tokens, the last one ``<|im_end|>``."""

    generation_config = SimpleNamespace(eos_token_id=[0, 3])

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def generate(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        self.seen.append(input_ids[0].tolist())
        return torch.cat([input_ids, torch.tensor([[7, 3]])], dim=1)


def test_a_chat_runs_prompts_are_user_turns_of_the_template():
    tok = load_tokenizer(None)
    assert not renders_chats(tok)
    record_chat_stops(tok)  # what a messages dataset does to the run's tokenizer
    assert renders_chats(tok)
    chat = tok("<|im_start|>user\nWhat does the owl keep?<|im_end|>\n<|im_start|>assistant\n",
               add_special_tokens=False).input_ids  # fmt: skip
    assert chat[0] == 2 and chat.count(3) == 1  # <|im_start|> ... <|im_end|> are single special tokens
    assert prompt_ids(tok, "What does the owl keep?", chat=True)[0].tolist() == chat
    plain = tok("What does the owl keep?").input_ids
    assert prompt_ids(tok, "What does the owl keep?", chat=False)[0].tolist() == plain != chat

    model = _Recorder()
    out = generate_samples(model, tok, ["What does the owl keep?"], 8, torch.device("cpu"), chat=True)
    assert model.seen == [chat]
    assert out == [{"prompt": "What does the owl keep?", "completion": tok.decode([7]), "new_tokens": 2,
                    "stopped_at_eos": True, "chat": True}]  # fmt: skip
    generate_samples(model, tok, ["What does the owl keep?"], 8, torch.device("cpu"))
    assert model.seen[-1] == plain

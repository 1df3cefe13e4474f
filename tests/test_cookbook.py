"""docs/cookbook.md runs as written.

Every ```bash and ```python block of the page runs, verbatim and in order, in a temporary copy of the
repository root (symbolic links to its files: the page is run from the repository root and writes under
``cookbook/``), with the ``automodel`` command and ``python`` of this interpreter's environment first on
PATH. After each step the test checks what the page says it did: the model directory, the packed cp=2
SFT (the method ``auto`` chose, the CP self-check, finite losses, checkpoints), the LoRA export, the
resumed run's log line and its steps, the export's stop ids, and a ``generate()`` that ends at
``<|im_end|>``. Also: examples/cookbook/chat.jsonl is what its script writes, and the page's links resolve.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.dist_harness import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "cookbook.md"
RUNNABLE = re.compile(r"^```(bash|python)\n(.*?)^```$", re.S | re.M)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
IM_END = 3  # the shipped ChatML template's end of turn; EOS (<|endoftext|>) is 0


def page_blocks() -> list[tuple[str, str, str | None]]:
    """``(language, code, the text block right after it or None)`` for every runnable block, in order."""
    text = PAGE.read_text()
    fences = list(FENCE.finditer(text))
    out = []
    for i, m in enumerate(fences):
        if m.group(1) in ("bash", "python"):
            nxt = fences[i + 1] if i + 1 < len(fences) else None
            follows = nxt is not None and nxt.group(1) == "text" and not text[m.end() : nxt.start()].strip()
            out.append((m.group(1), m.group(2), nxt.group(2) if follows else None))
    return out


def _repo_copy(root: Path) -> Path:
    """``root`` with a symbolic link to each top-level entry of the repository (not its run outputs)."""
    skip = {".git", ".venv", "cookbook", "outputs", "runs", ".pytest_cache", ".ruff_cache"}
    root.mkdir()
    for entry in REPO_ROOT.iterdir():
        if entry.name not in skip:
            (root / entry.name).symlink_to(entry)
    return root


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _run(lang: str, code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    launches = code.count("automodel finetune")
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120 + 240 * launches
    )
    assert proc.returncode == 0, f"cookbook block failed (exit {proc.returncode}):\n{code}\n--- stdout\n" \
        f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"  # fmt: skip
    return proc


def _train_losses(run: Path) -> dict[int, float]:
    """step -> loss of ``run``/metrics.jsonl; each step once, every loss finite."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["type"] == "train"]
    steps = [r["step"] for r in train]
    assert len(steps) == len(set(steps)), steps
    assert all(math.isfinite(r["loss"]) for r in train), train
    return {r["step"]: r["loss"] for r in train}


def test_cookbook_runs_as_written(tmp_path):
    blocks = page_blocks()
    assert [lang for lang, _, _ in blocks] == ["python", "bash", "bash", "bash", "bash", "bash", "python"]
    work = _repo_copy(tmp_path / "repo")
    env = _env()
    assert shutil.which("automodel", path=env["PATH"]), "no `automodel` command: pip install -e . installs it"
    cook = work / "cookbook"
    sft, lora = cook / "runs" / "sft", cook / "runs" / "lora"

    # 1. the local HF model directory
    _run(*blocks[0][:2], work, env)
    assert (cook / "my-model" / "config.json").is_file() and (cook / "my-model" / "model.safetensors").is_file()
    assert (cook / "my-model" / "tokenizer.json").is_file()

    # 2. the chat JSONL: the page shows the file's first line
    lang, code, shown = blocks[1]
    assert _run(lang, code, work, env).stdout.strip() == shown.strip()

    # 3. packed SFT at cp=2 from the model directory and the chat file
    out = _run(*blocks[2][:2], work, env).stdout
    assert "cp=2" in out and "cp_method auto: thd_docs" in out, out
    shown_log = re.search(r"```text\n(\.\.\. world .*?)```", PAGE.read_text(), re.S).group(1)
    for line in shown_log.splitlines():  # the page's world and profile lines are the run's, word for word
        if line.startswith(("... world ", "... model profile: ")):
            assert line[4:] in out, (line, out)
    assert re.search(r"cp self-check \(cp_method=thd_docs, cp_size=2.*: passed", out), out
    assert "model config: cookbook/my-model (config.json)" in out, out
    assert "tokenizer: cookbook/my-model (the model's own), 1024 ids" in out, out  # data.tokenizer left null
    losses = _train_losses(sft)
    assert sorted(losses) == list(range(1, 21)) and losses[20] < losses[1] - 1.0, losses
    assert f"step 20/20 | loss {losses[20]:.4f} |" in out, out  # the logged loss is the recorded one
    assert (sft / "checkpoints" / "step_20").is_dir() and (sft / "hf_model" / "config.json").is_file()

    # 4. LoRA: adapters only, adapter and merged exports
    out = _run(*blocks[3][:2], work, env).stdout
    assert "LoRA r=8 alpha=16" in out, out
    assert sorted(_train_losses(lora)) == list(range(1, 21))
    adapter = json.loads((lora / "hf_model" / "adapter" / "adapter_config.json").read_text())
    assert Path(adapter["base_model_name_or_path"]).resolve() == (cook / "my-model").resolve()
    assert (lora / "hf_model" / "merged" / "model.safetensors").is_file()

    # 5. resume: continues the SFT run at step 21, to 40
    out = _run(*blocks[4][:2], work, env).stdout
    ckpt = (sft / "checkpoints" / "step_20").resolve()
    assert f"resumed from {ckpt} (step 20)" in out, out
    assert "step 21/40" in out and "done: steps 21..40" in out, out
    losses = _train_losses(sft)
    assert sorted(losses) == list(range(1, 41)) and losses[40] < losses[20], losses

    # 6. the export: its generation config stops at EOS and at the chat's end of turn
    out = _run(*blocks[5][:2], work, env).stdout
    assert "model.safetensors" in out and "generation_config.json" in out, out
    gen = json.loads((sft / "hf_model" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0, IM_END], gen

    # 7. generate() on the export ends the answer at <|im_end|>
    out = _run(*blocks[6][:2], work, env).stdout
    m = re.search(r"new tokens: (\d+) \| last: (\S+)", out)
    assert m, out
    assert m.group(2) == "<|im_end|>" and int(m.group(1)) < 32, out  # stopped, not cut at max_new_tokens
    assert "EOS only: 32 new tokens" in out, out  # the stop is the end-of-turn id's doing
    samples = [json.loads(x) for x in (sft / "samples.jsonl").read_text().splitlines()]  # recipe.sample_prompts
    assert len(samples) == 1 and samples[0]["chat"] and samples[0]["stopped_at_eos"], samples
    assert samples[0]["new_tokens"] == int(m.group(1)) and samples[0]["new_tokens"] < 32, samples


def test_the_chat_file_is_what_its_script_writes():
    path = REPO_ROOT / "examples" / "cookbook" / "make_chat_jsonl.py"
    spec = importlib.util.spec_from_file_location("make_chat_jsonl", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    convs = script.conversations()
    assert script.main(["--check"]) == 0
    assert script.render(convs) == script.PATH.read_text() and len(convs) == 64
    assert all(any(m["role"] == "assistant" for m in c["messages"]) for c in convs)


def test_the_pages_links_resolve():
    text = PAGE.read_text()
    links = re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", text)
    assert links
    assert [x for x in links if not (PAGE.parent / x).is_file()] == []

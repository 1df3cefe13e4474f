"""The README a newcomer reads top to bottom: short, every relative link resolves (README and docs/), the own
loop leads with ``context_parallel``, and its headline figures are the support matrix's."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def _pages() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def test_readme_is_at_most_250_lines():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; move detail to a docs/ page and link it"


def test_every_relative_link_resolves():
    """``[text](path)`` and ``[text](path#anchor)`` of the README and every docs/ page: the file exists, and the
    anchor (when given) is one of the target's headings, slugged as GitHub does."""
    bad = []
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code blocks are code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(REPO)}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)}
                if anchor not in slugs:
                    bad.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert bad == [], "\n".join(bad)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def test_own_loop_section_leads_with_context_parallel():
    readme = README.read_text()
    section = readme.split("\n## Your own loop", 1)[1].split("\n## ", 1)[0]
    first_code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "from automodel.distributed.cp import context_parallel" in first_code
    assert "context_parallel(model, mesh" in section.split("```", 1)[0]  # the prose names it before any code


def test_headline_is_the_support_matrix():
    """The README's "N families x M methods (C configurations): E exact, R refused, 0 wrong" is what
    docs/support_matrix.md says."""
    readme = README.read_text()
    head = re.search(r"<!-- headline:start -->(.*?)<!-- headline:end -->", readme, re.S).group(1)
    families = int(re.search(r"\*\*(\d+) transformers families", head).group(1))
    methods = re.search(r"× (\d+) CP methods\*\* \(([^)]*)\)", head)
    configurations = int(re.search(r"\((\d+)\s+configurations\)", head).group(1))  # defaults + flagship patterns
    exact = int(re.search(r"\*\*(\d+)\s+configurations\s+train exactly", head).group(1))
    refused = int(re.search(r"\*\*(\d+) are\s+refused", head).group(1))
    assert "**0 are wrong**" in head

    matrix = (REPO / "docs" / "support_matrix.md").read_text()
    assert f"({families} families, {configurations} rows)" in matrix.replace("\n", " ")
    rows = dict(
        (name, tuple(int(x) for x in nums))
        for name, *nums in re.findall(r"^\| ([a-z_ ]+(?: \(cp=4\))?) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", matrix, re.M)
    )
    names = [m.strip() for m in methods.group(2).split(",")]
    assert int(methods.group(1)) == len(names)
    for name in names:
        key = next(k for k in rows if k == name or k.startswith(name + " ("))
        assert rows[key] == (exact, refused, 0, 0), (name, rows[key])
    for key, counts in rows.items():  # packed and auto columns too
        assert counts[2:] == (0, 0), (key, counts)
        assert sum(counts) == configurations, (key, counts)


def test_layout_section_matches_the_tree():
    """Every file and folder the README's Layout block names exists (under the repository, ``automodel/``,
    ``automodel/distributed/`` or ``automodel/distributed/cp/``), and every method package is named."""
    readme = README.read_text()
    block = re.search(r"## Layout\n\n```\n(.*?)```", readme, re.S).group(1)
    tokens = set(re.findall(r"(?<![\w.])((?:[\w]+/)+|[\w/]+\.(?:py|yaml))(?![\w])", block))
    bases = [REPO, REPO / "configs", REPO / "automodel", REPO / "automodel/distributed", REPO / "automodel/distributed/cp"]
    missing = sorted(t for t in tokens if not any((b / t).exists() for b in bases))
    assert len(tokens) >= 20, tokens
    assert missing == [], missing
    for method in ("ring", "ulysses", "thd", "thd_docs", "usp"):
        assert (REPO / "automodel/distributed/cp" / method / "__init__.py").exists(), method
        assert f"{method}/" in block


def test_run_log_lines_shown_are_what_the_recipe_logs():
    """The README's two run-log lines (model profile, cp_method auto) are what the recipe prints for
    configs/cp_packed.yaml at cp_size 2 (the same functions as the trainer, on the meta device)."""
    import os

    from automodel.config import load_config
    from automodel.config.cp_auto import auto_choice
    from automodel.distributed.cp.choose import method_line
    from automodel.distributed.cp.profile import profile_line
    from automodel.models.cp_check import profile_for_run
    from automodel.models.loader import resolve_model_config

    cwd = os.getcwd()
    os.chdir(REPO)  # the config names repository paths
    try:
        cfg = load_config(["--config", "configs/cp_packed.yaml"], world_size=2, cuda_available=False).cfg
    finally:
        os.chdir(cwd)
    profile = profile_for_run(cfg, resolve_model_config(cfg.model), cfg.model.attn_implementation or "sdpa")
    choice = auto_choice(cfg, profile, world_size=2, cuda_available=False)
    want = [profile_line(profile), method_line(choice.name, 2, choice)]

    readme = README.read_text()
    block = re.search(r"```\n(model profile: .*?)```", readme, re.S).group(1)
    shown, lines = [], block.splitlines()
    for line in lines:  # the README wraps the long cp_method line
        if line.startswith(("model profile:", "cp_method ")):
            shown.append(line)
        else:
            shown[-1] += " " + line
    assert shown == want

"""The README stays a front door and every link in it and in docs/ leads somewhere.

Relative links must name an existing file; a `#anchor` into a markdown file (or within the
page) must name one of its headings, slugged as GitHub does. The settings table in
docs/configuration.md is the plugin's, row for row.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from qwen35_accel.settings import settings_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

_FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the text may hold one level of brackets.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The page without fenced blocks and code spans, where a `[x](y)` is not a link."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lowercased, punctuation and
    symbols dropped (`-` and `_` kept), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    kept = (
        ch for ch in text.lower()
        if ch in " -_" or unicodedata.category(ch)[0] in "LNM"
    )
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown page, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    result = set()
    for line in _FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def _relative_links(page: Path) -> list[str]:
    links = _LINK.findall(_prose(page.read_text()))
    return [link for link in links if not re.match(r"^[a-z][a-z0-9+.-]*:", link)]


def test_github_slug_matches_github_on_this_projects_headings():
    assert github_slug("Does it fit? (`--gpu-memory`, `--suggest`)") == "does-it-fit---gpu-memory---suggest"
    assert github_slug("`PARALLELIZER.apply` options") == "parallelizerapply-options"
    assert github_slug("How the plugin activates, and how to turn it off") == (
        "how-the-plugin-activates-and-how-to-turn-it-off"
    )
    assert github_slug("Launch with `accelerate launch`, on each node") == "launch-with-accelerate-launch-on-each-node"


def test_readme_is_a_front_door():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, at most {README_MAX_LINES}: move reference text to a page under docs/ "
        "and link it from the README"
    )
    # The first screen: what it is, the two commands, then what works (why comes after).
    text = README.read_text().splitlines()
    first = {line: number for number, line in reversed(list(enumerate(text)))}
    assert first["## Set up, run, test"] < 15 and first["## What works"] < 35, (first.get("## Set up, run, test"),
                                                                              first.get("## What works"))
    assert first["## What works"] < first["## Why"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for link in _relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading with anchor #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_docs_page_opens_with_a_title_and_a_paragraph(page: Path):
    blocks = [block for block in page.read_text().split("\n\n") if block.strip()]
    assert blocks[0].startswith("# ") and "\n" not in blocks[0].strip(), f"{page.name}: first line must be '# Title'"
    assert not re.match(r"^(#|```|\||- |\* |\d+\. )", blocks[1]), (
        f"{page.name}: after the title comes one paragraph saying what the page covers, not {blocks[1][:40]!r}"
    )


def test_configuration_page_lists_every_setting_with_its_default():
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text[text.index("| variable | default | meaning |"):]
    table = table[: table.index("\n\n")]
    documented = dict(re.findall(r"^\| `(QWEN35_ACCEL\w*)` \| `([^`]*)` \|", table, flags=re.MULTILINE))
    as_written = {"true": "1", "false": "0"}  # the page gives booleans as the values to set
    declared = {row["variable"]: as_written.get(row["default"], row["default"]) for row in settings_table()}
    assert documented == declared


def test_the_layout_page_names_every_module_in_its_folders_entry():
    """docs/layout.md is the map of the package: each module is named (`name.py`) in its folder's
    entry (a top-level module in the first entry), so a new module cannot go unmapped."""
    text = (ROOT / "docs" / "layout.md").read_text()
    entries = re.split(r"\n- ", text)
    folders = {m.group(1): entry for entry in entries if (m := re.match(r"`(\w+)/`", entry))}
    top = next(entry for entry in entries if entry.startswith("`parallelization.py`"))
    package = ROOT / "qwen35_accel"
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if path.name == "__init__.py" or "__pycache__" in relative.parts:
            continue
        entry = top if len(relative.parts) == 1 else folders.get(relative.parts[0], "")
        if f"`{path.name}`" not in entry:
            missing.append(str(relative))
    assert not missing, f"docs/layout.md does not name these modules in their folder's entry: {missing}"


def test_ci_runs_the_readme_test_command():
    """A newcomer's first test run is CI's: the same command, taken from the README's set-up block."""
    setup = _FENCE.findall(README.read_text())[0]
    readme = [line.split("#")[0].strip() for line in setup.splitlines() if line.startswith("python3 -m pytest")]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m pytest")]
    assert readme and readme == ci


def test_each_knob_is_declared_once_and_the_options_table_gives_every_declared_default():
    """Every knob is declared once (default, help, choices): the parallelizer's in `ParallelOptions`, which
    the one configuration holds as its `parallel` branch, the plugin's own in `PluginSettings`; the code
    acting on a choice uses the declared choices; docs/custom_loops.md's table of `PARALLELIZER.apply`'s
    options gives every field with its declared default."""
    import dataclasses

    from qwen35_accel.parallel.context_parallel.state_exchange import EXCHANGES
    from qwen35_accel.parallel.expert_parallel.router import BALANCE_CHOICES
    from qwen35_accel.parallel.options import ParallelOptions
    from qwen35_accel.parallel.tiled_head import LOSS_MODES
    from qwen35_accel.settings import PluginSettings, knobs

    declared = {f for cls in (PluginSettings, ParallelOptions) for f in dataclasses.fields(cls) if "help" in f.metadata}
    assert {k.field for k in knobs()} == declared and len({k.variable for k in knobs()}) == len(declared) >= 19
    assert not {f.name for f in dataclasses.fields(PluginSettings)} & {f.name for f in dataclasses.fields(ParallelOptions)}
    assert PluginSettings().parallel == ParallelOptions()  # the environment's defaults are the declared ones
    choices = {k.field.name: k.field.metadata["choices"] for k in knobs() if k.field.metadata["choices"]}
    assert choices["cp_state_exchange"] is EXCHANGES and choices["moe_balance"] is BALANCE_CHOICES
    assert choices["tiled_loss"] == ("off", *LOSS_MODES)
    for name, values in choices.items():  # each choice knob's declared choices are what its check takes
        with pytest.raises(ValueError, match=r"expected one of"):
            PluginSettings.from_env({PluginSettings.env_name(name): "neither"})
        assert all(PluginSettings.from_env({PluginSettings.env_name(name): v}) for v in values)
    text = (ROOT / "docs" / "custom_loops.md").read_text()
    table = text[text.index("| option | default | meaning |"):]
    table = table[: table.index("\n\n")]
    documented = {}
    for names, defaults in re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|", table, flags=re.MULTILINE):
        for name, default in zip(re.findall(r"`(\w+)`", names), re.findall(r"`([^`]+)`", defaults)):
            documented[name] = default
    for field in dataclasses.fields(ParallelOptions):
        assert field.name in documented, f"docs/custom_loops.md lacks the option {field.name}"
        assert documented[field.name] == repr(field.default).replace("'", '"'), (field.name, documented[field.name])

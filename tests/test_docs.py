"""The user's guide and its topic pages: every relative link (`](path)`, `](path#anchor)`) in README.md, docs/*.md
and docs/results/*.md (the benchmarks' history) names a file that exists and, with an anchor, a heading of that file
as GitHub anchors it; every page of docs/ is reached from the README; the README stays a guide (at most 300
lines). No torch: plain text."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
DOCUMENTS = [README, *PAGES, *sorted((REPO / "docs" / "results").glob("*.md"))]

FENCED = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)  # code blocks: `](` there is code, `#` no heading
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(([^()\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#* *$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto: ...


def prose(text: str) -> str:
    """The text without its code blocks (a `# comment` in a bash block is no heading)."""
    return FENCED.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (word characters, hyphens and spaces kept),
    each space a hyphen: the heading "fp8 — bench_fp8.py" anchors as fp8--bench_fp8py."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets GitHub's -1, -2 ... suffix."""
    found, times = set(), {}
    for heading in HEADING.findall(prose(path.read_text())):
        base = slug(heading)
        found.add(f"{base}-{times[base]}" if base in times else base)
        times[base] = times.get(base, 0) + 1
    return found


def links(path: Path) -> list[str]:
    """The relative link targets of a document's prose (code blocks and code spans left out)."""
    text = INLINE_CODE.sub("", prose(path.read_text()))
    return [target for target in LINK.findall(text) if not EXTERNAL.match(target)]


def broken(path: Path, root: Path = REPO) -> list[str]:
    """`document: target (why)` for each of its links that does not resolve (the document named from root)."""
    problems = []
    for target in links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif anchor and (linked.is_dir() or anchor not in anchors(linked)):
            problems.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return problems


def test_slugs_are_githubs_anchors():
    assert slug("Data: your files, a hub dataset, evaluation") == "data-your-files-a-hub-dataset-evaluation"
    assert slug("fp8 — `bench_fp8.py` (`fp8_tests`, `fp8_speed`)") == "fp8--bench_fp8py-fp8_tests-fp8_speed"
    assert slug("A run's directory, resume and stopping") == "a-runs-directory-resume-and-stopping"


def test_a_repeated_heading_is_anchored_with_a_suffix(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## Setup\n\n```bash\n# not a heading\n```\n\n## Setup\n")
    assert anchors(page) == {"top", "setup", "setup-1"}


def test_a_missing_file_and_a_missing_heading_are_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n[a](other.md) [b](other.md#other-page) [c](#page) [d](https://example.com/x)\n"
                    "[e](gone.md) [f](other.md#gone) [g](#gone) `[h](gone.md)`\n")
    assert broken(page, root=tmp_path) == ["page.md: gone.md (no such file)",
                                           "page.md: other.md#gone (no such heading)",
                                           "page.md: #gone (no such heading)"]


def test_every_relative_link_of_the_guide_resolves():
    assert [problem for document in DOCUMENTS for problem in broken(document)] == []


def test_every_topic_page_is_linked_from_the_readme():
    linked = {(REPO / target.partition("#")[0]).resolve() for target in links(README)}
    assert [page.name for page in PAGES if page.resolve() not in linked] == []


def test_the_readme_is_a_guide_of_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300

"""The documentation a clone opens: the README stays a five-minute read (at most 300 lines), and every
relative link in README.md and docs/*.md opens a file inside the repository (a heading of it, where the
link names one). Pure: reads text only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
  """The text without fenced code blocks and code spans, where brackets are code, not links."""
  return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
  prose = _prose(text)
  return _INLINE.findall(prose) + _REFERENCE.findall(prose)


def slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
  seen: dict[str, int] = {}
  out = set()
  for heading in _HEADING.findall(_FENCE.sub("", text)):
    s = slug(heading)
    out.add(s if s not in seen else f"{s}-{seen[s]}")
    seen[s] = seen.get(s, 0) + 1
  return out


def test_the_readme_is_at_most_300_lines():
  n = len((ROOT / "README.md").read_text().splitlines())
  assert n <= README_MAX_LINES, (f"README.md has {n} lines, more than {README_MAX_LINES}: move the detail to "
                                 "docs/ (usage.md, results.md, gpu.md, development.md) and link it")


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_relative_link_resolves_inside_the_repository(doc):
  bad = []
  for target in links(doc.read_text()):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:: not a path in the repository
      continue
    path, _, anchor = target.partition("#")
    dest = (doc.parent / path).resolve() if path else doc
    if not dest.is_relative_to(ROOT):
      bad.append(f"{target}: outside the repository (a clone cannot open it)")
    elif not dest.exists():
      bad.append(f"{target}: no such file")
    elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
      bad.append(f"{target}: {dest.relative_to(ROOT)} has no heading with the anchor #{anchor}")
  assert not bad, f"{doc.relative_to(ROOT)}:\n  " + "\n  ".join(bad)


def test_the_link_reader_finds_what_it_must():
  text = ("[a](x.md) ![img](d/p.png) [b](../shared/y.json#z) `[no](code.md)` [c](https://e.org)\n"
          "```\n[no](fenced.md)\n```\n[ref]: docs/r.md\n")
  assert links(text) == ["x.md", "d/p.png", "../shared/y.json#z", "https://e.org", "docs/r.md"]
  assert slug("Time of the measure step: `python bench/profile_time.py`") == (
      "time-of-the-measure-step-python-benchprofile_timepy")
  assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


# A path the docs name: a file of this repository when it starts in one of its folders (`prophet_jax/`,
# a subpackage such as `_rewrite/` or `schedulers/`, `bench/`, `tests/`, `examples/`, `models/`);
# other paths name files of other projects (`bytescheduler/common/bytecore.py`). A bare `_module.py`
# names a private module somewhere in the repository.
_PY_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.py)\b")
_BARE_PRIVATE = re.compile(r"(?<![\w./-])(_[a-z]\w*\.py)\b")
_OURS = ("prophet_jax", "bench", "tests", "examples", "models")


def stale_paths(text: str) -> list[str]:
  """The `.py` paths `text` names, in the repository's folders, that no file of the repository has."""
  packages = {p.name for p in (ROOT / "prophet_jax").iterdir() if (p / "__init__.py").exists()}
  private = {p.name for d in _OURS for p in (ROOT / d).rglob("_*.py")}
  bad = []
  for path in _PY_PATH.findall(text):
    first = path.split("/")[0]
    if first in _OURS:
      where = [ROOT / path]
    elif first in packages:                       # `_rewrite/_mesh.py`: under prophet_jax/
      where = [ROOT / "prophet_jax" / path]
    else:
      continue
    if not any(p.is_file() for p in where):
      bad.append(path)
  bad += [name for name in _BARE_PRIVATE.findall(text) if name not in private]
  return bad


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_file_path_the_docs_name_exists(doc):
  """A module moved (the subpackage move of 2026-12) leaves no path behind in the docs."""
  bad = stale_paths(doc.read_text())
  assert not bad, (f"{doc.relative_to(ROOT)} names files that do not exist: {bad}; write where they are "
                   f"now (e.g. prophet_jax/_rewrite/_mesh.py, or _rewrite/_mesh.py)")


def test_the_path_reader_finds_what_it_must():
  text = ("`prophet_jax/_mesh.py` and `_rewrite/_mesh.py`, `_planning/_plan.py`, `schedulers/_plan.py`, "
          "bench/nope.py, `_gloo.py`, `_collectives.py`, bytescheduler/common/bytecore.py, dopt_rsag.py")
  assert stale_paths(text) == ["prophet_jax/_mesh.py", "_planning/_plan.py", "bench/nope.py", "_gloo.py"]

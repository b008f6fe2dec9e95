"""Tests of the documentation: every link in README.md and docs/ leads to a file of the repository,
and a link to a section (`FILE#section`) to a heading of that file."""
import glob
import os
import re
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ['README.md', 'benchmarks/README.md', *sorted(glob.glob('docs/*.md', root_dir=ROOT))]
# [text](target): a target without a scheme is a path in the repository.
LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')
FENCE = re.compile(r'^```.*?^```', re.MULTILINE | re.DOTALL)


def anchors(path: str) -> Iterator[str]:
  """The anchors GitHub gives the headings of the markdown file at `path`: lower case, spaces as
  hyphens, other punctuation dropped, a repeated heading numbered -1, -2, ..."""
  with open(path) as f:
    text = FENCE.sub('', f.read())
  seen = {}
  for heading in re.findall(r'^#+ +(.+?) *$', text, re.MULTILINE):
    slug = re.sub(r'[^\w\- ]', '', heading.lower()).replace(' ', '-')
    seen[slug] = seen.get(slug, -1) + 1
    yield slug if seen[slug] == 0 else f'{slug}-{seen[slug]}'


def links(page: str) -> list[str]:
  """The relative link targets of a page, outside its code blocks."""
  with open(os.path.join(ROOT, page)) as f:
    text = FENCE.sub('', f.read())
  return [target for target in LINK.findall(text) if not re.match(r'[a-z]+:', target)]


def test_the_pages_have_links():
  assert {'docs/training.md', 'docs/testing.md'} <= set(links('README.md'))


@pytest.mark.parametrize('page', PAGES)
def test_every_relative_link_leads_to_a_file_and_its_section(page):
  broken = []
  for target in links(page):
    path, _, section = target.partition('#')
    resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else (
        os.path.join(ROOT, page))
    if not os.path.exists(resolved):
      broken.append(f'{target}: no such file')
    elif section and section not in set(anchors(resolved)):
      broken.append(f'{target}: no heading #{section}')
  assert not broken, f'{page}: {broken}'

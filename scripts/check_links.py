#!/usr/bin/env python3
"""Check the relative links of the repository's Markdown pages.

    python3 scripts/check_links.py              # README.md, CHANGELOG.md, ARCHITECTURE.md, docs/*.md
    python3 scripts/check_links.py FILE.md ...  # only these
    python3 scripts/check_links.py --self-test  # the slug and parsing rules against fixed cases

Every relative link, `[text](path)`, `[text](path#anchor)`, `[text](#anchor)`, an image
`![alt](path)`, a reference definition `[name]: path` or an HTML `href`/`src`, must name a file
or folder that exists (relative to the page, or to the repository root when it starts with
`/`), and an anchor into a Markdown page must name one of its headings as GitHub spells it
(see `slug`). http(s), mailto and other URLs with a scheme are not checked: CI assumes no
network. Links inside code (fenced blocks and inline code spans) are not links and are
skipped. Prints each broken link as `FILE:LINE: target: why` and exits 1 if there is one.
"""

import os
import re
import sys
from urllib.parse import unquote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PAGES = ["README.md", "CHANGELOG.md", "ARCHITECTURE.md", "docs/*.md"]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
# `[text](target "title")`: the text may hold one level of brackets and span lines; the target
# is `<...>` or runs to whitespace or the closing parenthesis, with one level of parentheses.
INLINE = re.compile(
    r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^<>\n]*>|(?:[^\s()]|\([^\s()]*\))*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^()]*\)))?\s*\)"
)
REFDEF = re.compile(r"^ {0,3}\[([^\]]+)\]:[ \t]*(<[^<>\n]*>|\S+)", re.M)
HTML_ATTR = re.compile(r"<(?:a|img)\b[^>]*?\b(href|src|name|id)\s*=\s*\"([^\"]*)\"", re.I)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def blank_code(text):
    """The page with fenced code blocks and inline code spans replaced by filler of the same
    length (newlines kept), so offsets and line numbers still match the original text.

    >>> blank_code("a `[x](y)` b")
    'a xxxxxxxx b'
    """
    out = []
    fence = None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            out.append(" " * len(line))
        elif fence is not None:
            # A closing fence: the same character, at least as long, nothing after it.
            closes = m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)
            if closes and not line.strip().strip(fence[0]):
                fence = None
            out.append(" " * len(line))
        else:
            out.append(line)
    text = "\n".join(out)
    # A code span: a run of n backticks up to the next run of exactly n backticks.
    return re.sub(
        r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)",
        lambda m: "x" * len(m.group(1)) + re.sub(r"[^\n]", "x", m.group(2)) + "x" * len(m.group(1)),
        text,
        flags=re.S,
    )


def heading_text(raw):
    """A heading's text as GitHub renders it: code spans' contents, links' and images' texts,
    without HTML tags or emphasis markers.

    >>> heading_text("The `Amp` handle and [its guard](#guard), **fast**")
    'The Amp handle and its guard, fast'
    """
    parts = re.split(r"(`+)(.+?)\1", raw)
    out = []
    for i in range(0, len(parts), 3):
        t = parts[i]
        t = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", t)
        t = re.sub(r"<[^>]+>", "", t)
        t = t.replace("*", "")
        # `_` is emphasis only at a word's edge; inside a word (snake_case) it stays.
        t = re.sub(r"(?<!\w)_+|_+(?!\w)", "", t)
        out.append(t)
        if i + 2 < len(parts):
            out.append(parts[i + 2])
    return "".join(out).strip()


def slug(text):
    """GitHub's anchor for a heading's text: lowercase; every character other than a letter,
    a digit, a space, '-' or '_' removed; each space a '-' (runs are not merged).

    >>> slug("Two commands")
    'two-commands'
    >>> slug("O1, O2 & O3: what changes?")
    'o1-o2--o3-what-changes'
    >>> slug("ZeRO-1/2 and grad_scaler (PyTorch-style)")
    'zero-12-and-grad_scaler-pytorch-style'
    """
    return "".join(c for c in text.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(text):
    """The anchors a Markdown page defines: its headings' slugs (a repeated slug gets -1, -2,
    ... as on GitHub) and HTML `name`/`id` attributes.

    >>> sorted(anchors("# A\\n## A\\n```\\n# not a heading\\n```\\nB b\\n---\\n<a id=\\"x\\"></a>"))
    ['a', 'a-1', 'b-b', 'x']
    """
    found = set()
    seen = {}
    lines = blank_code(text).split("\n")
    raw_lines = text.split("\n")
    for i, line in enumerate(lines):
        m = ATX.match(line)
        title = None
        if m:
            title = raw_lines[i].strip().lstrip("#").strip()
            title = re.sub(r"[ \t]+#+[ \t]*$", "", title)
        elif i > 0 and SETEXT.match(line) and lines[i - 1].strip() and not ATX.match(lines[i - 1]):
            # A setext underline; a `---` after a blank line is a rule, not a heading.
            title = raw_lines[i - 1].strip()
        if title is not None:
            s = slug(heading_text(title))
            n = seen.get(s, 0)
            found.add(s if n == 0 else "%s-%d" % (s, n))
            seen[s] = n + 1
    for m in HTML_ATTR.finditer(text):
        if m.group(1).lower() in ("name", "id"):
            found.add(m.group(2))
    return found


def links(text):
    """The links of a page outside code, as (line, target), targets unescaped.

    >>> links("see [a\\nb](x.md#y) and `[c](z)`\\n[d]: <e f.md>\\n![i](p.svg \\"t\\")")
    [(1, 'x.md#y'), (4, 'p.svg'), (3, 'e f.md')]
    """
    code_free = blank_code(text)
    found = []

    def line_of(offset):
        return code_free.count("\n", 0, offset) + 1

    for m in INLINE.finditer(code_free):
        target = text[m.start(2) : m.end(2)]
        found.append((line_of(m.start()), target))
    for m in REFDEF.finditer(code_free):
        target = text[m.start(2) : m.end(2)]
        found.append((line_of(m.start()), target))
    for m in HTML_ATTR.finditer(code_free):
        if m.group(1).lower() in ("href", "src"):
            found.append((line_of(m.start()), text[m.start(2) : m.end(2)]))
    return [(n, t[1:-1] if t.startswith("<") and t.endswith(">") else t) for n, t in found]


def check(page, root=ROOT, cache=None):
    """The broken links of `page` (a path under `root`), as `FILE:LINE: target: why` lines."""
    cache = {} if cache is None else cache
    here = os.path.dirname(os.path.join(root, page))
    if not os.path.isfile(os.path.join(root, page)):
        return ["%s: no such page" % page]
    with open(os.path.join(root, page), encoding="utf-8") as f:
        text = f.read()
    broken = []
    for line, target in links(text):
        if not target or SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        path = unquote(path)
        if not path:
            full = os.path.join(root, page)
        elif path.startswith("/"):
            # GitHub resolves a leading '/' at the repository's root.
            full = os.path.normpath(os.path.join(root, path.lstrip("/")))
        else:
            full = os.path.normpath(os.path.join(here, path))
        why = None
        if not os.path.exists(full):
            why = "no such file"
        elif not os.path.realpath(full).startswith(os.path.realpath(root) + os.sep):
            why = "outside the repository"
        elif anchor and full.endswith(".md") and os.path.isfile(full):
            if full not in cache:
                with open(full, encoding="utf-8") as f:
                    cache[full] = anchors(f.read())
            if unquote(anchor) not in cache[full]:
                why = "no heading with anchor #%s in %s" % (anchor, os.path.relpath(full, root))
        elif anchor and os.path.isfile(full) and not re.fullmatch(r"L\d+(-L\d+)?", anchor):
            # Into a file GitHub renders without headings, only line anchors mean something.
            why = "anchor #%s into a file that is not Markdown" % anchor
        if why:
            broken.append("%s:%d: %s: %s" % (page, line, target, why))
    return broken


def self_test():
    import doctest
    import tempfile

    failed, _ = doctest.testmod(sys.modules[__name__])
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "docs"))
        with open(os.path.join(d, "README.md"), "w") as f:
            f.write(
                "# Title\n## Opt levels\n[ok](docs/a.md#the-amp-handle) [ok](#opt-levels) [ok](docs/)\n"
                "[bad](docs/b.md) [bad](docs/a.md#nope) [bad](#title-1) [ok](https://x.invalid/y)\n"
                "```md\n[skip](missing.md)\n```\n[bad](README.md#x) [bad](../outside.md)\n"
            )
        with open(os.path.join(d, "docs", "a.md"), "w") as f:
            f.write("# The `Amp` handle\n[ok](../README.md#title) [bad](../README.md#Title)\n")
        got = check("README.md", d) + check("docs/a.md", d)
        want = [
            "README.md:4: docs/b.md: no such file",
            "README.md:4: docs/a.md#nope: no heading with anchor #nope in docs/a.md",
            "README.md:4: #title-1: no heading with anchor #title-1 in README.md",
            "README.md:8: README.md#x: no heading with anchor #x in README.md",
            "README.md:8: ../outside.md: no such file",
            "docs/a.md:2: ../README.md#Title: no heading with anchor #Title in README.md",
        ]
        if got != want:
            print("self-test: got\n  %s\nwant\n  %s" % ("\n  ".join(got), "\n  ".join(want)))
            failed += 1
    print("check_links self-test: %s" % ("FAILED" if failed else "ok"))
    return 1 if failed else 0


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    if argv:
        pages = [os.path.relpath(os.path.abspath(p), ROOT) for p in argv]
    else:
        import glob

        pages = []
        for pattern in DEFAULT_PAGES:
            pages += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    cache = {}
    broken = []
    for page in pages:
        broken += check(page, ROOT, cache)
    for b in broken:
        print(b)
    verdict = "%d broken link(s)" % len(broken) if broken else "every relative link resolves"
    print("check_links: %d page(s), %s" % (len(pages), verdict), file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

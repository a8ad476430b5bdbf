"""Checks the links between the Markdown files it is given.

    check_links.py FILE.md [FILE.md ...]

Every link of the form [text](path.md), [text](path.md#anchor) or
[text](#anchor) into the folders of the given files must name one of them
and, with an anchor, a heading of that file (GitHub's anchors:
the heading lower-cased, characters other than letters, digits, spaces,
hyphens and underscores dropped, spaces made hyphens, a repeated anchor
numbered -1, -2, ...), and not a heading the file repeats (its numbered
anchors move to another heading when one of that name is added above).
Links to Markdown files in other folders, and to
anything but Markdown, are not checked. Prints each broken link as
FILE:LINE: ... and exits 1 if there is one.
"""

import os
import re
import sys

LINK = re.compile(r"\]\(([^)\s]*?\.md)?(#[^)\s]*)?\)")
HEADING = re.compile(r"^(#{1,6}) +(.*?) *#*$")
FENCE = re.compile(r"^(```|~~~)")


def slug(text):
    text = re.sub(r"`|\*\*|\*", "", text)  # inline code and emphasis marks
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    """A file's anchors, and those of headings it repeats (which move when a
    heading of that name is added above them)."""
    seen = {}
    found = set()
    fenced = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if FENCE.match(line):
                fenced = not fenced
                continue
            m = None if fenced else HEADING.match(line.rstrip("\n"))
            if not m:
                continue
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    repeated = set()
    for base, n in seen.items():
        if n > 1:
            repeated.update([base] + [f"{base}-{i}" for i in range(1, n)])
    return found, repeated


def main(paths):
    files = {os.path.normpath(p): p for p in paths}
    known = {p: anchors(p) for p in files}
    folders = {os.path.dirname(p) for p in files}
    broken = 0
    checked = 0
    for key, path in files.items():
        fenced = False
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if FENCE.match(line):
                    fenced = not fenced
                if fenced:
                    continue
                for target, anchor in LINK.findall(line):
                    if not target and not anchor:
                        continue
                    to = os.path.normpath(os.path.join(os.path.dirname(key), target)) if target else key
                    if to not in known:
                        # A Markdown file beside the given ones must be one of them.
                        if os.path.dirname(to) in folders:
                            print(f"{path}:{number}: no file {to}")
                            broken += 1
                        continue
                    checked += 1
                    found, repeated = known[to]
                    if anchor and anchor[1:] not in found:
                        print(f"{path}:{number}: no heading for '{anchor}' in {to}")
                        broken += 1
                    elif anchor and anchor[1:] in repeated:
                        print(f"{path}:{number}: '{anchor}' names a heading {to} repeats "
                              "(link to a heading of its own, such as its section's)")
                        broken += 1
    print(f"check_links: {checked} links between {len(files)} files checked, {broken} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1:]))

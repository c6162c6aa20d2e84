#!/usr/bin/env python3
"""Fails when a relative link or #anchor of a Markdown file does not resolve.

For every link of every Markdown file (inline links and images, reference definitions, and
<a href>/<img src> tags; code spans and fenced code are not read): a relative target must exist
inside the repository, and a #anchor must name a heading of the target Markdown file (or of the
file itself) by GitHub's rules: the heading's text lower-cased, every character but letters,
digits, spaces, '-' and '_' dropped, spaces made '-', and a heading whose slug was taken before
given -1, -2, ... (an <a name=...> or id=... anchor counts too). External links (http:,
https:, mailto:, ...) are not fetched.

Usage: check_links.py --root DIR [--exclude PATH]... [FILE...]
With no FILE, every *.md under DIR except .git, the build folders (build*/ at the top) and the
excluded paths. Prints one line per broken link, FILE:LINE: TARGET: why.
"""

import argparse
import os
import re
import sys
import unicodedata
from urllib.parse import unquote

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']*)[\"']", re.IGNORECASE)
HTML_ANCHOR = re.compile(r"<a\b[^>]*?\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def strip_code_spans(line):
    """The line with its code spans blanked (their text is not Markdown)."""
    out, i = [], 0
    while i < len(line):
        if line[i] == "`":
            run = len(line[i:]) - len(line[i:].lstrip("`"))
            close = line.find("`" * run, i + run)
            while close != -1 and close + run < len(line) and line[close + run] == "`":
                close = line.find("`" * run, close + run + 1)
            if close == -1:
                out.append(line[i:i + run])
                i += run
                continue
            out.append(" " * (close + run - i))
            i = close + run
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


def heading_text(raw):
    """The text GitHub renders for a heading's Markdown: code spans by their content, links and
    images by their text, emphasis markers and HTML tags dropped."""
    parts = re.split(r"(`+)(.+?)\1", raw)  # text, ticks, code, text, ticks, code, ...
    out = []
    for i in range(0, len(parts), 3):
        text = parts[i]
        text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", text)
        text = re.sub(r"<[^>]+>", "", text)
        text = re.sub(r"(\*+)(\S(?:.*?\S)?)\1", r"\2", text)
        text = re.sub(r"(?<![A-Za-z0-9])_(\S(?:.*?\S)?)_(?![A-Za-z0-9])", r"\1", text)
        out.append(text)
        if i + 2 < len(parts):
            out.append(parts[i + 2].strip() if parts[i + 2].strip() else parts[i + 2])
    return "".join(out).strip()


def slug(text):
    kept = []
    for ch in text.lower():
        if ch in " -_" or unicodedata.category(ch)[0] in "LNM":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def scan(path):
    """(anchors, links) of a Markdown file: the set of anchors its headings and tags define,
    and (line number, target) for every link."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    anchors, counts, links = set(), {}, []

    def add_heading(raw):
        base = slug(heading_text(raw))
        n = counts.get(base, 0)
        counts[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")

    fence, previous = None, ""
    for number, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
                fence = None
            previous = ""
            continue
        if m:
            fence, previous = m.group(1), ""
            continue
        text = strip_code_spans(line)
        atx = ATX.match(line)
        if atx:
            add_heading(atx.group(2) or "")
        elif SETEXT.match(line) and previous.strip() and not previous.lstrip().startswith(("|", "-", "*", ">")):
            add_heading(previous.strip())
        for a in HTML_ANCHOR.findall(text):
            anchors.add(a)
        for target in INLINE_LINK.findall(text):
            links.append((number, target.strip("<>")))
        ref = REFERENCE.match(text)
        if ref:
            links.append((number, ref.group(1).strip("<>")))
        for target in HTML_LINK.findall(text):
            links.append((number, target))
        previous = line
    return anchors, links


def markdown_files(root, excluded):
    for directory, folders, files in os.walk(root):
        relative = os.path.relpath(directory, root)
        if relative == ".":
            folders[:] = [d for d in folders if d != ".git" and not d.startswith("build")]
        folders[:] = [d for d in folders if os.path.normpath(os.path.join(relative, d)) not in excluded]
        for name in sorted(files):
            if name.endswith(".md"):
                yield os.path.normpath(os.path.join(relative, name))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True)
    parser.add_argument("--exclude", action="append", default=[])
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()
    root = os.path.realpath(args.root)
    excluded = {os.path.normpath(e) for e in args.exclude}
    files = [os.path.normpath(f) for f in args.files] or sorted(markdown_files(root, excluded))

    cache = {}

    def anchors_of(path):
        if path not in cache:
            cache[path] = scan(path)[0]
        return cache[path]

    broken, checked = [], 0
    for file in files:
        path = os.path.join(root, file)
        _, links = scan(path)
        for number, target in links:
            if not target or SCHEME.match(target) or target.startswith("//"):
                continue
            checked += 1
            where, _, anchor = target.partition("#")
            if where:
                resolved = os.path.realpath(os.path.join(os.path.dirname(path), unquote(where)))
                if os.path.commonpath([resolved, root]) != root:
                    broken.append(f"{file}:{number}: {target}: outside the repository")
                    continue
                if not os.path.exists(resolved):
                    broken.append(f"{file}:{number}: {target}: no such file")
                    continue
            else:
                resolved = path
            if anchor and resolved.endswith(".md") and os.path.isfile(resolved):
                if unquote(anchor) not in anchors_of(resolved):
                    broken.append(f"{file}:{number}: {target}: no heading of "
                                  f"{os.path.relpath(resolved, root)} has the anchor #{anchor}")
    for b in broken:
        print(b)
    if broken:
        print(f"{len(broken)} broken link(s) in {len(files)} Markdown file(s)")
        return 1
    print(f"{checked} relative links in {len(files)} Markdown files: all resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())

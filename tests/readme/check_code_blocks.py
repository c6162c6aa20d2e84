#!/usr/bin/env python3
"""Fails when a ```cpp block of the given Markdown files is not compiled by a test.

A ```cpp block is compiled when it is
  * a whole program that a test builds: the first ```cpp fence after the first line of its file
    that starts with a registered heading (--program FILE HEADING, as tests/readme/CMakeLists.txt
    and readme_code_block.cmake extract it);
  * a fragment: the line right above its fence is `<!-- fragment: NAME -->` and the harness
    (--harness, tests/readme/fragments.cpp) includes "fragments/NAME.inc";
or it is marked, on the line right above its fence, `<!-- not compiled: WHY -->`, where WHY names
an existing file of the repository that compiles the same code (a test).

Usage: check_code_blocks.py --root DIR --harness FILE [--program FILE HEADING]... FILE...
(the Markdown files relative to --root). Prints one line per problem, FILE:LINE: what.
"""

import argparse
import os
import re
import sys

FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([^\s`]*)")
CPP = {"cpp", "c++", "cxx", "cc"}
FRAGMENT = re.compile(r"^<!-- fragment: (\S+) -->\s*$")
NOT_COMPILED = re.compile(r"^<!-- not compiled:(.*)-->\s*$")
PATH = re.compile(r"[A-Za-z0-9_./-]+\.(?:cpp|cu|cuh|hpp|h|txt|cmake|py|sh)\b")


def cpp_blocks(lines):
    """(index of the fence line, indentation) of every ```cpp block, fences inside other blocks
    excluded."""
    blocks, open_fence = [], None
    for i, line in enumerate(lines):
        m = FENCE.match(line)
        if not m:
            continue
        indent, fence, info = m.groups()
        if open_fence is None:
            open_fence = fence
            if info.lower() in CPP:
                blocks.append((i, indent))
        elif fence[0] == open_fence[0] and len(fence) >= len(open_fence) and not info:
            open_fence = None
    return blocks


def program_fence(lines, heading):
    """The fence line the CMake extraction takes for `heading`, or None."""
    for i, line in enumerate(lines):
        if line.startswith(heading):
            for j in range(i + 1, len(lines)):
                if lines[j] == "```cpp":
                    return j
            return None
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True)
    parser.add_argument("--harness", required=True)
    parser.add_argument("--program", nargs=2, action="append", default=[], metavar=("FILE", "HEADING"))
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()

    with open(args.harness, encoding="utf-8") as f:
        harness = f.read()
    included = set(re.findall(r'#include "fragments/([A-Za-z0-9_]+)\.inc"', harness))

    problems, counts, seen_fragments = [], {"program": 0, "fragment": 0, "not compiled": 0}, {}

    def problem(file, index, what):
        problems.append(f"{file}:{index + 1}: {what}")

    for file in args.files:
        path = os.path.join(args.root, file)
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        programs = set()
        for pfile, heading in args.program:
            if pfile != file:
                continue
            fence = program_fence(lines, heading)
            if fence is None:
                problems.append(f"{file}: no ```cpp block after a line starting with '{heading}', "
                                "which a test builds")
            else:
                programs.add(fence)
        # A fragment marker must stand right above a ```cpp fence.
        for i, line in enumerate(lines):
            if FRAGMENT.match(line) and (i + 1 >= len(lines) or lines[i + 1] != "```cpp"):
                problem(file, i, "a fragment marker must be the line right above a ```cpp fence")
        for fence, indent in cpp_blocks(lines):
            above = lines[fence - 1] if fence > 0 else ""
            fragment, not_compiled = FRAGMENT.match(above), NOT_COMPILED.match(above)
            if fence in programs:
                counts["program"] += 1
            elif fragment:
                name = fragment.group(1)
                if name in seen_fragments:
                    problem(file, fence, f"fragment '{name}' is also defined at {seen_fragments[name]}")
                seen_fragments[name] = f"{file}:{fence}"
                if name not in included:
                    problem(file, fence, f"fragment '{name}' is not included by {args.harness} "
                                         f"(add a function that includes \"fragments/{name}.inc\")")
                elif indent:
                    problem(file, fence, f"fragment '{name}': its fence is indented; the extraction reads "
                                         "fences at the start of a line")
                else:
                    counts["fragment"] += 1
            elif not_compiled:
                why = not_compiled.group(1).strip()
                named = [p for p in PATH.findall(why) if os.path.exists(os.path.join(args.root, p))]
                if not why:
                    problem(file, fence, "a 'not compiled' marker must say why, and name the test that "
                                         "compiles the same code")
                elif not named:
                    problem(file, fence, "a 'not compiled' marker must name an existing file of the "
                                         f"repository that compiles the same code (it says: {why})")
                else:
                    counts["not compiled"] += 1
            else:
                problem(file, fence, "a ```cpp block that is neither compiled by a test nor marked: make it "
                                     "a fragment (<!-- fragment: NAME --> above the fence, and a function in "
                                     f"{os.path.basename(args.harness)} that includes fragments/NAME.inc) or "
                                     "mark it <!-- not compiled: why; the test that compiles it -->")

    for p in problems:
        print(p)
    total = sum(counts.values())
    if problems:
        print(f"{len(problems)} problem(s) with the ```cpp blocks of {len(args.files)} file(s)")
        return 1
    print(f"{total} ```cpp blocks in {len(args.files)} files: {counts['program']} programs, "
          f"{counts['fragment']} fragments, {counts['not compiled']} not compiled (marked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Check a commit message: a subject of at most 72 characters, a blank line, then a body that says why.

Usage: check_commit_msg.py MESSAGE_FILE  (pre-commit's commit-msg stage passes the file)."""

from __future__ import annotations

import sys

MAX_SUBJECT = 72


def problems(message: str) -> list[str]:
    lines = [line for line in message.splitlines() if not line.startswith("#")]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines or not lines[0].strip():
        return ["the message has no subject"]
    out = []
    if len(lines[0]) > MAX_SUBJECT:
        out.append(f"the subject is {len(lines[0])} characters (at most {MAX_SUBJECT})")
    if len(lines) < 3 or lines[1].strip() or not any(line.strip() for line in lines[2:]):
        out.append("after the subject, a blank line and a body that says why")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        found = problems(f.read())
    for p in found:
        print(f"commit message: {p}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

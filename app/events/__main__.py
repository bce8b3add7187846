"""``python -m app.events --markdown`` prints the "Types" table of docs/events.md."""

from __future__ import annotations

import argparse

from app.events.codec import markdown_table


def _main() -> None:
    parser = argparse.ArgumentParser(description="The accounting event schema.")
    parser.add_argument("--markdown", action="store_true", help="print the docs' table")
    args = parser.parse_args()
    if args.markdown:
        print(markdown_table(), end="")
    else:
        parser.print_help()


if __name__ == "__main__":
    _main()

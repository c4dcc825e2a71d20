"""`python -m worker.demo`: build the demo (once) and print its paths as JSON on stdout."""
from __future__ import annotations

import argparse
import logging

from worker.demo.cache import build_demo
from worker.demo.spec import SIZES


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build (once) the embedded demo and print its paths as JSON.")
    parser.add_argument("--cache-dir", default=None,
                        help="default: $LORAPLEX_CACHE/demo-v2, or ~/.cache/loraplex/demo-v2 (-fast for --size fast)")
    parser.add_argument("--size", choices=sorted(SIZES), default="full",
                        help="full: what `loraplex demo` serves; fast: a smaller model built in seconds, for tests")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(build_demo(args.cache_dir, SIZES[args.size]).to_json())


if __name__ == "__main__":
    main()

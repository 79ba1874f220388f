"""Check a benchmark's command line without running it: ``python benchmarks/_dry_parse.py
(-m MODULE | SCRIPT) ARGS...`` imports the target as ``python`` would run it and stops right after its
argument parser accepted ARGS (exit 0), or with the parser's own error (exit 2). Used by
``benchmarks/gpu_session.sh dry`` so that a lent GPU's minutes are never spent on a typo."""

from __future__ import annotations

import argparse
import runpy
import sys


class _Parsed(Exception):
    """Raised by the patched parser once the arguments parsed."""


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: _dry_parse.py (-m MODULE | SCRIPT) ARGS...", file=sys.stderr)
        return 2
    module = sys.argv[1] == "-m"
    target = sys.argv[2] if module else sys.argv[1]
    rest = sys.argv[3:] if module else sys.argv[2:]
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        original(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[method-assign]
    sys.argv = [target, *rest]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except _Parsed:
        print(f"dry: {target} {' '.join(rest)}: arguments accepted")
        return 0
    print(f"dry: {target} never parsed its arguments", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Everything the tests download ahead of time (run by scripts/setup.sh): the real NCCL wheel's library, the
real cuobjdump, and the cpu-demo wheels, all cached under .cache/."""

from __future__ import annotations

import sys

from tests.support import native


def main() -> int:
    got = native.fetch()
    for name, path in sorted(got.items()):
        print(f"fetch: {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

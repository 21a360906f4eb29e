"""`python -m tokenweir.model.kernels`: compile the C++ CPU kernels now (the install step of
`make` runs it), so that no engine start pays for it. The kernels are optional (engines fall
back to the torch path), so a failed build is said, not an error: exit status 0 either way."""

import sys
import time

from tokenweir.model import kernels


def main() -> int:
    started = time.perf_counter()
    if not kernels.kernels_enabled():
        print("tokenweir: TOKENWEIR_CPU_KERNELS=0: nothing to build", file=sys.stderr)
        return 0
    if kernels.build() is None:
        print("tokenweir: the C++ CPU kernels could not be built (see the warning above); "
              "engines will use the torch path", file=sys.stderr)
        return 0
    print(f"tokenweir: C++ CPU kernels ready, variant {kernels.cpu_isa() or 'none'} "
          f"({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

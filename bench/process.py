"""Process entry for benches whose children hold NIXL agents."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def run_and_exit(main: Callable[[], int]) -> None:
    """Runs ``main``, flushes stdout and stderr, then ``os._exit`` with its code (NIXL may
    crash at interpreter exit): argparse's exits keep their codes (0 for --help, 2 for a
    usage error), Ctrl-C is 130, anything else raised prints its traceback and is 1."""
    code = 1
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

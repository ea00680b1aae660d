"""`python -m zerolab.predict calibrate`: this machine's figures for `--hardware cpu`."""
from __future__ import annotations

import sys

from zerolab.predict.calibrate import cli_main

if __name__ == "__main__":
    if sys.argv[1:2] != ["calibrate"]:
        print("usage: python -m zerolab.predict calibrate [--out PATH] [--ranks 1,2,3]", file=sys.stderr)
        sys.exit(2)
    sys.exit(cli_main(sys.argv[2:]))

"""``python -m kvgate.engines.sim --port P ...``: serve one simulated engine (see its cli)."""

import sys

from kvgate.engines.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())

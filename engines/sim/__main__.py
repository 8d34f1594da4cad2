"""``python -m engines.sim --port P ...``: serve one simulated engine (see engines.sim.cli)."""

import sys

from engines.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""Build a feature store: `python jobs/ingest.py SOURCE OUT_DIR [options]` (SOURCE --help lists options)."""

import sys

from xmodal.cli.ingest import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

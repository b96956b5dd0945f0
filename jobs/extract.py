"""Region features of your own images: `python jobs/extract.py IMAGES OUT --weights FILE [options]` (--help)."""

import sys

from xmodal.cli.extract import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Benchmarks: `python jobs/benchmark.py {lxmert,data,mult,suite,scale,tracking,sweep,examples,extract} [options]` (each subcommand has --help).

Runs where torch (and transformers, for the LXMERT peer) are installed; Ray is not needed (`tracking`
needs MLflow).
"""

import sys

from xmodal_bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Scale-out: what replicas on Ray Serve give under many clients beside one direct server, and what the route
through Ray adds to each request.

    python benchmarks/scale_out.py [--clients 8] [--tokens 64] [--replicas 1,2] [--demo] [--json FILE]

Needs Ray Serve (pip install 'pebbling[ray]'). benchmarks/README.md has the latest figures.
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

if __name__ == "__main__":
    from lib.scale_out_ray import main

    main(sys.argv[1:])

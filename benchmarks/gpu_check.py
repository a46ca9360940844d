"""Does pebbling work on this GPU machine? One command proves it (make gpu-check DIR=...): setup from the wheels
carried, a probe, the kernel tests, the suite with a skipped GPU test failing, `speed.py gpu` on a slice of
Llama-3-8B, the decode kernels' profile and the matvec builds, each stage timed, within 9 minutes.

    python benchmarks/gpu_check.py --dir DIR [its options]     (--help for them; make gpu-check)
    python benchmarks/gpu_check.py wheels [--dest .whl]        (make gpu-wheels, on a machine with a registry)

It starts on a bare machine: nothing beyond the standard library is imported before its setup has run.
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["wheels"]:  # the wheels a GPU machine with no registry lacks, into .whl/
        from lib import wheels

        sys.argv = [f"{Path(sys.argv[0]).name} wheels", *argv[1:]]
        return wheels.main(argv[1:])
    from lib import check

    return check.main(argv)


if __name__ == "__main__":
    sys.exit(main())

"""Copy task of Tree Cross Attention (TCA §4.1): thin script over :mod:`bench.np.tasks.copy`.

The same as ``python -m bench train copy``; kept so the commands recorded in bench/results/copy_task.md
still run::

    python bench/copy_task.py --seq-len 64 --steps 4000 --model tca --stop-at 0.999   # 1-4 min on 2 CPUs

Prints the running loss/accuracy, then the final accuracy on ``--eval-size`` fresh sequences and the
fraction of context tokens each query read.
"""
from __future__ import annotations

import argparse

from bench.np.tasks.copy_cli import add_copy_arguments, run_copy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_copy_arguments(parser, allow_both=True)
    return run_copy(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())

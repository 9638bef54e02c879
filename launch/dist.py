#!/usr/bin/env python3
"""Start an ssdsgd job on this machine: see ``python launch/dist.py --help``.

    python launch/dist.py configs/digits.yaml
    python launch/dist.py -n 2 -s 1 -- python my_train.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ssdsgd.launch.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

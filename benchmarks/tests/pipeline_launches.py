"""Run ``multi_gpu/pipeline.py`` once per configuration in one ``torchrun`` launch.

``python -m torch.distributed.run ... pipeline_launches.py ARGS [--then ARGS ...]`` calls the
script's ``main`` with each ``ARGS`` in turn. The tests launch it, so every rank imports torch
and the mt packages once for all the configurations instead of once per launch.

The first ``main`` creates the process group (from torchrun's variables, as a launch of the
script does) and the later ones find it created, as :func:`mt_comm.init_distributed` allows;
``main`` destroys it at its end, which is put off until the last configuration has run: a group
created again from the same torchrun store would wait for ranks that already joined.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multi_gpu"))
import pipeline

import mt_comm

SEPARATOR = "--then"


def main(argv: list[str]) -> int:
    configs: list[list[str]] = [[]]
    for arg in argv:
        if arg == SEPARATOR:
            configs.append([])
        else:
            configs[-1].append(arg)
    destroy = mt_comm.destroy_distributed
    mt_comm.destroy_distributed = lambda: None
    try:
        for config in configs:
            code = pipeline.main(config)
            if code:
                return code
    finally:
        mt_comm.destroy_distributed = destroy
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

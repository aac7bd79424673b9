"""``python -m mt_train`` (and ``torchrun -m mt_train``) runs the ``mt-train`` command."""

from mt_train.cli import main

raise SystemExit(main())

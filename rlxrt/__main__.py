"""``python -m rlxrt``: the same as the ``rlxrt`` command."""
import sys

from rlxrt.app.cli import main

sys.exit(main())

"""`python -m tpuray`: the `tpuray` command line."""

import sys

from tpuray.cli import main

sys.exit(main())

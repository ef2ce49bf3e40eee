import sys

from tpuray.cli import main

sys.exit(main())

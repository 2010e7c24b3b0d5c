import sys

from ckpt.cli import main

sys.exit(main())

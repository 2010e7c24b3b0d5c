import sys

from ckpt.cli._main import main

sys.exit(main())

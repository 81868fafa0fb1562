import sys

from pd_dflash.cli import main

sys.exit(main())

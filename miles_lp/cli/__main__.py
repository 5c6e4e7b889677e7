import sys

from miles_lp.cli import main

sys.exit(main())

import sys

from routepack.cli import main

sys.exit(main())

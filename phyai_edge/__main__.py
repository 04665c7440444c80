import sys

from phyai_edge.cli import main

sys.exit(main())

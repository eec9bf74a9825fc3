import sys

from elastic_runner.cli import main

sys.exit(main())

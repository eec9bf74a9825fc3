import sys

from elastic_runner.cli.main import main

sys.exit(main())

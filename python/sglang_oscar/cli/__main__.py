import sys

from sglang_oscar.cli.main import main

sys.exit(main())

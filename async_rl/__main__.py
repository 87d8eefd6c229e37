import sys

from async_rl.run.cli import main

sys.exit(main())

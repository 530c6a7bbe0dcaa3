"""PyInstaller entry of the `zerotvm` program: the terminal CLI (engine.cli:main, as the console script)."""

import sys

from engine.cli import main

sys.exit(main())

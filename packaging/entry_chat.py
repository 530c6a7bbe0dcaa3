"""PyInstaller entry of the `zerotvm-chat` program: the desktop app (app.main:main, as the console script)."""

import sys

from app.main import main

sys.exit(main())

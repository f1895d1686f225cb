"""``python -m moelab ...``: see moelab.cli."""

from moelab.cli import main

raise SystemExit(main())

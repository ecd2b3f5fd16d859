import sys

from moekit.cli import console_main

sys.exit(console_main())

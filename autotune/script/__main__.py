import sys

from autotune.script.shim import main

sys.exit(main(sys.argv[1:]))

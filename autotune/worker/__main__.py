import sys

from autotune.worker.main import main

sys.exit(main(sys.argv[1:]))

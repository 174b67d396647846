import sys

from slidefusion.cli import main

sys.exit(main())

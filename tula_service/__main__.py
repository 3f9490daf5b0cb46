import sys

from tula_service.cli import main

sys.exit(main())

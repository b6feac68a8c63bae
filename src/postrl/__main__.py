from postrl.cli import main
import sys

sys.exit(main())

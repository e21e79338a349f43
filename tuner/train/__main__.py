import sys

from tuner.train.train import main

sys.exit(main())

"""`python -m keras_geeps` is the `keras-geeps` command."""

import sys

from keras_geeps.cli import main

sys.exit(main())

"""`python -m keras_geeps.shard`: run one shard process."""

import sys

from keras_geeps.shard.command import main

if __name__ == "__main__":
    sys.exit(main())

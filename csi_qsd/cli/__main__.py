"""`python -m csi_qsd.cli …`: the same as the `csi-qsd` console script."""

import sys

from csi_qsd.cli.entry import main

sys.exit(main())

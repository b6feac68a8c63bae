"""How long torch's OpenMP threads spin before they sleep, set before torch is loaded.

torch's CPU kernels run on a GNU OpenMP team; a team member that finishes its share spins
waiting for the next parallel region (``GOMP_SPINCOUNT``, 300,000 iterations by default) before
it sleeps. On a quiet machine that saves a wake-up per operation; on one where another process
keeps a core busy (a user's laptop, a shared node) a spinning member holds the core that the
member it waits for needs, and every operation waits for the scheduler: the demo's training took
77 s for 8 steps with one core busy, against 10.6 s with one thread. 5,000 spins keep the quiet
speed (13.2 s against 13.1 s for 20 steps) and bring the busy case to about 14 s (measured in
docs/async.md). A user's own ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is left as it is.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "5000"


def bound_openmp_spinning() -> bool:
    """Set ``GOMP_SPINCOUNT`` for this process and its children unless the user chose the wait
    behaviour or torch (and with it OpenMP) is already loaded; True when it was set."""
    if "torch" in sys.modules or "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True

"""postrl: RL post-training of language models."""

from postrl.models.onednn_cache import bound_onednn_cache
from postrl.models.openmp_waits import bound_openmp_spinning

bound_openmp_spinning()  # before anything loads torch (postrl.models.openmp_waits says why)
bound_onednn_cache()  # before torch's first matmul (postrl.models.onednn_cache says why)

__version__ = "0.2.0"

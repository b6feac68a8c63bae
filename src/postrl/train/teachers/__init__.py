"""On-policy distillation's teachers (``algorithm.distill``): frozen models that score each token of a
student's samples, in this process or behind a URL; the update trains the student toward them."""

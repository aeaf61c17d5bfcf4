"""Other ways to train than the plain loop: on-policy distillation from a teacher; a run's state
held aside and put back, and variants of the update compared on the same rollouts."""

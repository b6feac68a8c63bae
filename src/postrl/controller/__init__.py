"""The Controller: one RL step, a line per stage, and the stages some algorithms add."""

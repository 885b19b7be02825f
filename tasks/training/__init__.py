"""The improve loop: its typed state, the two ways to collect, learning and commits, the
evaluation schedule, the stop rule, resume and the run's report."""

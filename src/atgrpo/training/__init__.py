"""One training run: the loop (:func:`atgrpo.train`), the run folder's lifecycle, the runtime
that builds every part from the config once, evaluation on held-out tasks, metrics and
trackers."""

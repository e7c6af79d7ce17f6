"""Method comparisons: comparison files, the runs a comparison needs, and the intervals its
tables report."""

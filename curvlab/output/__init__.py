"""What people read: the text report and the figures (records in, nothing recomputed)."""

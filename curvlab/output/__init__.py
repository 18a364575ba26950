"""What people read: the text report, the figures and what the commands print (records in, nothing recomputed)."""

"""`kvfleet bench`, `kvfleet profile`, `kvfleet capacity` (see cli.py)."""

"""Reference data: carbon intensity and GPU specification tables (``data/``), with their lookups."""

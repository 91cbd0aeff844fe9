"""The inference collector: local inference servers' token counters for serving sessions (``collector``), their
processes from /proc (``procnet``), one bounded scrape (``scrape``) and what an answer says (``engines``)."""

"""Reference data: carbon intensity and GPU specification tables (``data/``), with their lookups."""

from pathlib import Path

#: The bundled tables (package data). A plain path, not importlib.resources: that imports zipfile and
#: importlib's readers (about 0.5 MB of the daemon's memory) to read files that are always on disk.
DATA_DIR = Path(__file__).resolve().parent / "data"

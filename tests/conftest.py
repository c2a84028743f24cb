import sys
from pathlib import Path

# tests/ on sys.path: test modules and job scripts import the shared helpers as ``support.*``.
sys.path.insert(0, str(Path(__file__).parent))

"""benchmarks/ is not part of the installed memplan package: put the repository root on sys.path so
the tests here import it as `benchmarks`, from whatever directory pytest starts in."""
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

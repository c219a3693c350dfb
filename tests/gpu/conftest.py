"""The GPU check imports the test helpers one directory up (launch, models), as the other test modules do."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

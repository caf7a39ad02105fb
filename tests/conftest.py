import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.chdir(ROOT)  # tests read config.yaml, data/ and kernels/ relative to the repository
sys.path.insert(0, str(ROOT))

"""Route 1: a poisoned .pyc in the cached reference tree's __pycache__ (source mtime and size)."""
import tamper
from gamma7_base import Gamma7

for f in tamper.losses_utils():
    tamper.attempt(tamper.plant_pyc, f)
candidate = Gamma7

"""Route 5: a poisoned .pyc in the tool's pycache prefix, where the reference reads bytecode."""
import tamper
from gamma7_base import Gamma7

for f in tamper.losses_utils():
    tamper.attempt(tamper.plant_prefix_pyc, f)
candidate = Gamma7

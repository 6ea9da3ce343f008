"""Route 2: a sourceless sitecustomize.pyc on the reference process's path."""
import tamper
from gamma7_base import Gamma7

for f in tamper.losses_utils():
    tamper.attempt(tamper.plant_sitecustomize, f)
candidate = Gamma7

